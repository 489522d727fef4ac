"""oneDNN's CPU kernels for TensorFlow: on for launch.py's runs unless the user says otherwise.

TensorFlow reads its switch, the environment variable TF_ENABLE_ONEDNN_OPTS, when its library
loads, and by default turns oneDNN's kernels on only with AVX512 (or newer); elsewhere its
matmuls and convolutions are Eigen's. On this project's AVX2 CPU oneDNN's won every race run
(docs/guides/performance.md links them), so `prefer` (called by `trainer.launcher_defaults()`,
which launch.py calls first; importing trainer sets nothing) sets TF_ENABLE_ONEDNN_OPTS=1 when:
  * the variable is unset (TF_ENABLE_ONEDNN_OPTS=0 keeps Eigen's kernels);
  * TensorFlow is not imported yet (after that the switch no longer changes anything).
The run's first log line says whether oneDNN's kernels are on (`enabled`), whatever set them.
TensorFlow-free: this module only touches the environment.
"""

from __future__ import annotations

import os
import sys

ENV = 'TF_ENABLE_ONEDNN_OPTS'


def prefer() -> None:
  """Sets TF_ENABLE_ONEDNN_OPTS=1 if it is unset and TensorFlow is not loaded yet."""
  if 'tensorflow' not in sys.modules:
    os.environ.setdefault(ENV, '1')


def user_setting() -> str | None:
  """The variable's value when the user set it to something other than the '1' `prefer` sets
  (None when unset or '1': set by `prefer`, by the user, or inherited from a process that
  imported trainer, the kernels are the same)."""
  value = os.environ.get(ENV)
  return None if value == '1' else value


def enabled() -> bool:
  """Whether this process's TensorFlow runs oneDNN's kernels (its own answer, which accounts for
  the CPU's default; the environment variable where TensorFlow has no such function)."""
  try:
    from tensorflow.python.util import _pywrap_util_port
  except ImportError:  # pragma: no cover - a TensorFlow without the function
    return os.environ.get(ENV, '0').lower() in ('1', 'true')
  return bool(_pywrap_util_port.IsMklEnabled())


def hint() -> str | None:
  """One line for the log when oneDNN's kernels are off and the user did not ask for that (it
  was TensorFlow's own default for this CPU), else None."""
  if enabled() or user_setting() is not None:
    return None
  return (
    "TensorFlow's oneDNN CPU kernels are off (TensorFlow's default for this CPU); call "
    'trainer.launcher_defaults() before TensorFlow loads, or set TF_ENABLE_ONEDNN_OPTS=1, for '
    'the faster kernels (TF_ENABLE_ONEDNN_OPTS=0 keeps them off quietly)'
  )
