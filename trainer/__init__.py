"""A mixed-precision training loop for TensorFlow with its own loss scaling.

The public names are imported on first use (PEP 562), so `import trainer.config` (the schema) or
`from trainer import ConfigError` loads no TensorFlow; `from trainer import Trainer` does.
Importing the package turns TensorFlow's oneDNN CPU kernels (trainer/onednn.py) and XLA's persistent
compile cache (trainer/compile_cache.py) on, unless the environment says otherwise or TensorFlow
is already loaded.
"""

from __future__ import annotations

import importlib

from trainer import compile_cache, onednn
from trainer.errors import ConfigError, DataError, UserError
from trainer.registry import register_optimizer

onednn.prefer()  # before TensorFlow loads (the three imports above load none): read once
compile_cache.prefer()

_LAZY = {
  'Datasets': 'trainer.data.datasets',
  'Event': 'trainer.run.actions',
  'LossScaler': 'trainer.step.loss_scale',
  'Runner': 'trainer.run.runner',
  'Trainer': 'trainer.trainer',
  'TrainStep': 'trainer.step.train_step',
  'UpdateGroup': 'trainer.step.train_step',
}

__all__ = [
  'ConfigError',
  'DataError',
  'Datasets',
  'Event',
  'LossScaler',
  'Runner',
  'Trainer',
  'TrainStep',
  'UpdateGroup',
  'UserError',
  'register_optimizer',
]


def __getattr__(name: str):
  if name in _LAZY:
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # once
    return value
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__():
  return sorted(__all__)
