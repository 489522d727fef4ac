"""A mixed-precision training loop for TensorFlow with its own loss scaling.

The public names are imported on first use (PEP 562), so `import trainer.config` (the schema) or
`from trainer import ConfigError` loads no TensorFlow; `from trainer import Trainer` does.
Importing the package changes nothing in the process: no environment variable, no file, no
thread setting. `launcher_defaults()` opts in to what launch.py runs with.
"""

from __future__ import annotations

import importlib

from trainer import compile_cache, onednn
from trainer.errors import ConfigError, DataError, UserError
from trainer.registry import register_optimizer


def launcher_defaults() -> None:
  """What launch.py sets before TensorFlow loads, for a script of your own: TensorFlow's oneDNN
  CPU kernels on (trainer/onednn.py; TensorFlow's default turns them on only on CPUs with
  AVX512) and XLA's persistent compile cache in ~/.cache/mpt-trainer/xla (trainer/compile_cache.py).
  Call it before importing TensorFlow; what the environment already says (TF_ENABLE_ONEDNN_OPTS,
  TF_XLA_FLAGS) is kept. The run's log says what is on."""
  onednn.prefer()
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
  'launcher_defaults',
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
