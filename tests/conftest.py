"""Shared fixtures: the data folder, a tiny Trainer factory, and policy reset.

The tests live in folders named after the packages they test (tests/step/, tests/run/, ...;
tests/e2e/ for the runs through launch.py and the benchmarks). The shared helpers (tiny.py,
docblocks.py, local_cluster.py, the *_run(s).py scripts) stay here in tests/, and every test
folder is on sys.path, so a test imports a helper or another test's function by module name
wherever it lives.
"""

import gc
import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
# XLA's compile cache off for the tests and the runs they launch: a test's programs are named
# after the functions traced before them, so each run of the suite would add programs to the
# user's cache (trainer/compile_cache.py; tests/package/test_compile_cache.py turns it on).
if '--tf_xla_persistent_cache_directory' not in os.environ.get('TF_XLA_FLAGS', ''):
  os.environ['TF_XLA_FLAGS'] = (
    os.environ.get('TF_XLA_FLAGS', '') + ' --tf_xla_persistent_cache_directory='
  ).strip()

import trainer  # noqa: E402

trainer.launcher_defaults()  # before TensorFlow: the tests run the kernels launch.py runs
import keras  # noqa: E402
import pytest  # noqa: E402
from tensorflow.python.framework import config as tf_config  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
FOLDERS = sorted(
  e.path for e in os.scandir(TESTS) if e.is_dir() and e.name != 'fixtures' and e.name[0] not in '._'
)
sys.path[:0] = [p for p in [TESTS, *FOLDERS] if p not in sys.path]

from tiny import TinyTrainer, tiny_config  # noqa: E402

DATA = os.path.join(ROOT, '..', 'shared', 'data')
MNIST_DIR = os.path.join(DATA, 'mnist')
# TensorFlow's switch has no public getter or off (tf.config.experimental has only the enable).
_OP_DETERMINISM = tf_config.is_op_determinism_enabled()


@pytest.fixture(autouse=True)
def _reset_policy():
  yield
  keras.mixed_precision.set_global_policy('float32')


@pytest.fixture(autouse=True)
def _restore_op_determinism():
  """A run with config.train.deterministic switches op determinism on for the whole process
  (trainer/run/build.py); without this every later test of the same xdist worker ran under it
  (TensorFlow's deterministic kernels fail and word errors differently, test_contract.py). Each
  test ends with it as the process started (set up after any module fixture, so not read here)."""
  yield
  if tf_config.is_op_determinism_enabled() != _OP_DETERMINISM:
    (tf_config.enable_op_determinism if _OP_DETERMINISM else tf_config.disable_op_determinism)()


def pytest_collection_finish(session):
  """Moves everything alive once the tests are imported (TensorFlow, Keras, the test modules:
  hundreds of thousands of objects) out of the collector's sight for good: a full collection
  then walks only what the tests make, which `_collect_garbage` below pays after every test."""
  gc.collect()
  gc.freeze()


@pytest.fixture(autouse=True)
def _collect_garbage():
  """Frees each test's trainers when it ends. Keras models and tf.functions sit in reference
  cycles, so only a full collection frees them; left to Python's thresholds, the garbage of
  dozens of tests piled up in a worker and one unrelated test paid for collecting it (a pause of
  many seconds inside a short test), and the functions it held kept TensorFlow's function
  library large for every trace meanwhile."""
  yield
  gc.collect()


@pytest.fixture
def mnist_dir():
  if not os.path.isdir(MNIST_DIR):
    pytest.fail(f'MNIST data not found at {MNIST_DIR}: tests read ../shared/data/mnist')
  return MNIST_DIR


def once_per_session(tmp_path_factory, name: str, make):
  """The folder `name` after `make(folder)` filled it, once per test session: under xdist the
  first worker to ask makes it and any other waits for it (a file lock in the session's shared
  temporary folder), instead of each worker that runs one of the module's tests making its own.
  worksteal hands a module's tests to several workers when one runs out of work, and each would
  have run tests/step/test_distribute.py's long fixture again. A failed
  `make` leaves no folder behind, so the next asker tries again (and fails in its own test)."""
  import fcntl
  import shutil

  root = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    root = root.parent  # the session's folder, above each worker's popen-gw<N>
  folder, done = root / f'once-{name}', root / f'once-{name}.done'
  with open(root / f'once-{name}.lock', 'w') as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    if not done.exists():
      shutil.rmtree(folder, ignore_errors=True)
      folder.mkdir()
      make(folder)
      done.touch()
  return folder


@pytest.fixture
def tiny_trainer(tmp_path):
  """Makes TinyTrainers (tests/tiny.py) on a fresh workdir; dotted-key overrides."""

  def make(**overrides):
    return TinyTrainer(tiny_config(**overrides), str(tmp_path / 'work'))

  return make


_SPAWNS = ('subprocess.', 'sys.executable', 'multiprocessing')


def _spawning_names(module) -> set[str]:
  """The functions a test module defines or imports from tests/ (any folder in it) that start a
  Python process, directly or through another such function."""
  import inspect

  sources = {}
  for name, value in vars(module).items():
    defined = getattr(inspect.getmodule(value), '__file__', '') or ''
    if inspect.isfunction(value) and defined.startswith(TESTS + os.sep):
      try:
        sources[name] = inspect.getsource(value)
      except OSError:
        continue
  found = {n for n, s in sources.items() if any(p in s for p in _SPAWNS)}
  while True:
    more = {n for n, s in sources.items() if n not in found and any(f + '(' in s for f in found)}
    if not more:
      return found
    found |= more


def pytest_collection_modifyitems(items):
  """Marks `subprocess` every test that starts its own Python process (`-m subprocess` selects
  them, `-m 'not subprocess'` leaves them out)."""
  import inspect

  cache: dict = {}
  for item in items:
    function = getattr(item, 'function', None)
    if function is None:
      continue
    module = item.module
    if module not in cache:
      cache[module] = _spawning_names(module)
    source = inspect.getsource(function)
    if any(p in source for p in _SPAWNS) or any(n + '(' in source for n in cache[module]):
      item.add_marker(pytest.mark.subprocess)
