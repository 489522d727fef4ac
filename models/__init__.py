"""Models: each module here holds one Trainer subclass; `config.model` names the module.

`config.model` is either the name of a module in models/ (`mnist_cnn`) or the dotted path of any
importable module holding exactly one Trainer subclass (`my_project.gan`: a package on sys.path,
e.g. through PYTHONPATH or `pip install -e`).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import ml_collections

from trainer.errors import ConfigError
from trainer.trainer import Trainer


def model_section(config, defaults: dict, model: str) -> ml_collections.ConfigDict:
  """config.model_config (the model's own section, which the schema does not check) with
  `defaults` filled in; a ConfigError names the first key `defaults` lacks."""
  given = config.get('model_config', ml_collections.ConfigDict()).to_dict()
  unknown = sorted(set(given) - set(defaults))
  if unknown:
    raise ConfigError(
      f'config.model_config.{unknown[0]} is not a key of {model}; known: {", ".join(defaults)}'
    )
  return ml_collections.ConfigDict({**defaults, **given})


def available() -> list[str]:
  return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith('_'))


def get_trainer_class(name: str) -> type[Trainer]:
  """The Trainer subclass defined in `models/<name>.py`, or in the module at dotted path `name`."""
  if '.' in name:
    module = _import(name)
    where = f'module {name}'
  elif name in available():
    module = importlib.import_module(f'{__name__}.{name}')
    where = f'models/{name}.py'
  else:
    raise ConfigError(
      f'config.model={name!r} is not a module in models/; available: '
      f'{", ".join(available())}; or give the dotted path of a module of your '
      "own, such as 'my_project.gan'"
    )
  classes = [
    c
    for _, c in inspect.getmembers(module, inspect.isclass)
    if issubclass(c, Trainer) and c is not Trainer and c.__module__ == module.__name__
  ]
  if len(classes) != 1:
    found = ', '.join(c.__name__ for c in classes) or 'none'
    raise ConfigError(
      f'config.model={name!r}: {where} must define exactly one Trainer subclass, '
      f'found {len(classes)} ({found})'
    )
  return classes[0]


def _import(name: str):
  parts = name.split('.')
  if not all(part.isidentifier() for part in parts):
    raise ConfigError(
      f'config.model={name!r} is not a module name: give a module in models/ '
      f'({", ".join(available())}) by its name, or a dotted path of Python '
      "identifiers such as 'my_project.gan' (not a file path, no leading or "
      'doubled dots)'
    )
  try:
    return importlib.import_module(name)
  except ModuleNotFoundError as e:
    # Only a missing `name` (or a parent package) is the config's fault; a missing import inside
    # the user's module is an error in that module and keeps its traceback.
    if e.name is None or not (name == e.name or name.startswith(e.name + '.')):
      raise
    raise ConfigError(
      f'config.model={name!r}: no module {e.name!r} can be imported; put the '
      'folder holding its package on PYTHONPATH (or install it), or use a model '
      f'in models/: {", ".join(available())}'
    ) from None
