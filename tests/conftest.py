"""Shared fixtures: the data folder, a tiny Trainer factory, and policy reset."""
import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import keras  # noqa: E402
import pytest  # noqa: E402

from tiny import TinyTrainer, tiny_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, '..', 'shared', 'data')
MNIST_DIR = os.path.join(DATA, 'mnist')


@pytest.fixture(autouse=True)
def _reset_policy():
  yield
  keras.mixed_precision.set_global_policy('float32')


@pytest.fixture
def mnist_dir():
  if not os.path.isdir(MNIST_DIR):
    pytest.fail(f'MNIST data not found at {MNIST_DIR}: tests read ../shared/data/mnist')
  return MNIST_DIR


@pytest.fixture
def tiny_trainer(tmp_path):
  """Makes TinyTrainers (tests/tiny.py) on a fresh workdir; dotted-key overrides."""
  def make(**overrides):
    return TinyTrainer(tiny_config(**overrides), str(tmp_path / 'work'))
  return make
