"""The optimizer registry: `config.optimizer.name` -> the builder that makes the optimizer.

It imports no TensorFlow, so the config schema can check a name without loading it. The built-in
names map to builders in trainer/optim/optimizers.py, imported only when an optimizer is built; a
project adds its own with `register_optimizer(name, builder)` before the Trainer is built (e.g.
at the top of its model's module).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

# (opt_config, learning_rate) -> a Keras optimizer
Builder = Callable[..., Any]
# A built-in builder is named by its dotted path and imported on first use.
_REGISTRY: dict[str, Builder | str] = {
  'adam': 'trainer.optim.optimizers._adam',
  'adamw': 'trainer.optim.optimizers._adamw',
  'sgd': 'trainer.optim.optimizers._sgd',
}


def register_optimizer(name: str, builder: Builder) -> None:
  """Makes `config.optimizer.name = name` build its optimizer with
  `builder(opt_config, learning_rate)`; registering a name again replaces its builder."""
  if not isinstance(name, str) or not name:
    raise ValueError(f'register_optimizer: the name must be a non-empty string, got {name!r}')
  if not callable(builder):
    raise TypeError(
      f'register_optimizer({name!r}, ...): the builder must be callable as '
      f'builder(opt_config, learning_rate), got {builder!r}'
    )
  _REGISTRY[name] = builder


def names() -> tuple[str, ...]:
  """The registered optimizer names, sorted."""
  return tuple(sorted(_REGISTRY))


def check_name(name: str) -> str | None:
  """A complaint for config validation when `name` is not registered, else None."""
  if name in _REGISTRY:
    return None
  return (
    f'must be a registered optimizer: {", ".join(names())} (a project adds its own with '
    'trainer.register_optimizer(name, builder))'
  )


def builder(name: str) -> Builder | None:
  """The builder registered under `name` (a built-in one imported now), or None."""
  found = _REGISTRY.get(name)
  if isinstance(found, str):
    module, _, attr = found.rpartition('.')
    found = getattr(importlib.import_module(module), attr)
  return found
