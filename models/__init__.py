"""Models: each module here holds one Trainer subclass; `config.model` names the module."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

from trainer.errors import ConfigError
from trainer.trainer import Trainer


def available() -> list[str]:
  return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith('_'))


def get_trainer_class(name: str) -> type[Trainer]:
  """The Trainer subclass defined in `models/<name>.py`."""
  if name not in available():
    raise ConfigError(f'config.model={name!r} is not a module in models/; available: '
                      f'{", ".join(available())}')
  module = importlib.import_module(f'{__name__}.{name}')
  classes = [c for _, c in inspect.getmembers(module, inspect.isclass)
             if issubclass(c, Trainer) and c is not Trainer and c.__module__ == module.__name__]
  if len(classes) != 1:
    raise ConfigError(f'models/{name}.py must define exactly one Trainer subclass, found '
                      f'{len(classes)}: {[c.__name__ for c in classes]}')
  return classes[0]
