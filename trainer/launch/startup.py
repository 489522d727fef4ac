"""The start-up and the end of a launch: TensorFlow imported without its C++ start-up lines,
Keras without matplotlib, the cycle collector kept off TensorFlow's object graph, and an exit that
skips the interpreter's teardown once results are out. launch.py calls these; none runs at import.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import os
import re
import sys
import tempfile
import warnings

from absl import logging


def tf_logs_requested(argv) -> bool:
  """--tf_logs, read before absl parses the flags (the last spelling wins, as in absl)."""
  wanted = False
  for arg in argv[1:]:
    if arg in ('--tf_logs', '--tf_logs=true', '--tf_logs=True', '--tf_logs=1'):
      wanted = True
    elif arg in ('--notf_logs', '--tf_logs=false', '--tf_logs=False', '--tf_logs=0'):
      wanted = False
  return wanted


def quiet_tensorflow() -> None:
  """Imports TensorFlow without its C++ start-up lines. TF_CPP_MIN_LOG_LEVEL=3 (read at load)
  hides C++ info, warnings and errors such as `failed call to cuInit` on a CPU-only machine; the
  lines its shared libraries print while loading (oneDNN, CUDA drivers) ignore that level, so
  stderr is captured while importing and every captured line that is not such a start-up line is
  passed on. Python-side warnings and errors are unaffected, but one: TensorFlow's UserWarning
  about tf.data options in graph mode, which its own distributed-dataset reduce raises (a
  mirrored eval) and no user code can act on."""
  warnings.filterwarnings(
    'ignore', message='To make it possible to preserve tf.data options', category=UserWarning
  )
  if 'tensorflow' in sys.modules:
    return
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      import tensorflow  # noqa: F401  (imported here, while its start-up lines are captured)
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      lines = captured.read().decode(errors='replace').splitlines()
      kept = [l for l in lines if not _START_UP_LINE.match(l)]
      if kept:
        print('\n'.join(kept), file=sys.stderr)


class _OnFirstUse:
  """Stands for a module that is imported when one of its attributes is first read."""

  def __init__(self, name: str):
    self._name = name

  def __getattr__(self, attr: str):
    return getattr(importlib.import_module(self._name), attr)


@contextlib.contextmanager
def collector_paused():
  """Python's cycle collector off for the block (and from launch.py's `__main__` on), then back on
  with every object made so far frozen out of its later passes (`gc.freeze`): TensorFlow's and
  Keras's modules, functions and classes, which live as long as the process. While they import,
  the collector runs hundreds of times over a growing heap, and its full passes during the step's
  tracing would walk them all again (docs/references.md's start-up timeline). On between the two
  blocks: a supervisor of `--workers` runs there for the whole run."""
  gc.disable()
  try:
    yield
  finally:
    gc.freeze()
    gc.enable()


def import_keras() -> None:
  """Imports Keras without matplotlib. `import keras` loads keras.visualization, whose modules
  import matplotlib.pyplot and .patches at module level (in a try/except ImportError): with
  matplotlib installed every launch pays for it, for functions training never calls. It is hidden
  while Keras loads, then each module attribute Keras left at None (`plt`, `patches`) becomes a
  stand-in importing it on first use, so those functions still work. Nothing is done when Keras
  or matplotlib is already imported, or matplotlib is not installed."""
  if 'keras' in sys.modules or 'matplotlib' in sys.modules:
    return
  if importlib.util.find_spec('matplotlib') is None:
    import keras  # noqa: F401

    return
  # None in sys.modules: `import matplotlib...` raises ImportError while Keras loads.
  sys.modules['matplotlib'] = None  # type: ignore[assignment]
  try:
    import keras  # noqa: F401
  finally:
    del sys.modules['matplotlib']
  for name, module in list(sys.modules.items()):
    if not name.startswith('keras.') or module is None:
      continue
    for attr, real in (('plt', 'matplotlib.pyplot'), ('patches', 'matplotlib.patches')):
      if attr in vars(module) and vars(module)[attr] is None:
        setattr(module, attr, _OnFirstUse(real))


# absl's C++ lines before InitializeLog: "I0000 00:00:<time> <thread> <file>:<line>] ..." and
# the notice about them; the CPU-feature notice's second line.
_START_UP_LINE = re.compile(
  r'[IW]0000 00:00:|WARNING: All log messages before absl::'
  r'InitializeLog|To enable the following instructions:'
)


def hide_tensorflow_info(record) -> bool:
  """absl handler filter: drops INFO records logged from TensorFlow's own Python files."""
  file = getattr(sys.modules.get('tensorflow'), '__file__', None)
  if record.levelno >= 30 or not file:
    return True
  return not record.pathname.startswith(os.path.dirname(file) + os.sep)


def exit_now(code: int, config) -> None:
  """Ends the process once the results (or the error line) are out; everything the run writes
  (checkpoints, TensorBoard events, config.json, exports) is written and flushed before this.
  With TensorFlow loaded a normal exit spends seconds in the interpreter's finalization (tearing
  down modules, collecting TensorFlow's and Keras's object graph; not in atexit handlers, and no
  other thread is alive), so the process exits at once; without it a normal exit is as fast.
  Multi-worker and TPU runs exit normally: their runtimes shut down with the cluster at exit."""
  if 'tensorflow' not in sys.modules or (
    getattr(getattr(config, 'distribute', None), 'strategy', None) in ('multi_worker', 'tpu')
  ):
    sys.exit(code)
  from trainer.run import lock as workdir_lock

  workdir_lock.release_all()  # os._exit skips the atexit handler that would
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)
