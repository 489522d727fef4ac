"""Shared fixtures: the data folder, a small config, a toy Trainer, and policy reset."""
import os

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from trainer import Datasets, Trainer  # noqa: E402
from trainer import config as config_lib  # noqa: E402

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


def small_config(**overrides):
  """The schema defaults with short loops; overrides use dotted keys: {'train.steps': 10}."""
  config = config_lib.defaults()
  config.train.steps = 20
  config.train.steps_per_loop = 5
  config.train.log_every = 5
  config.train.checkpoint_every = 10
  config.precision.policy = 'float32'
  for key, value in overrides.items():
    config_lib._set(config, key, value)
  return config


class ToyTrainer(Trainer):
  """Linear regression on a fixed random problem: fast, and enough to exercise the step."""

  def build_model(self):
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation='relu'),
                             keras.layers.Dense(1, dtype='float32')])

  def build_datasets(self):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype('float32')
    y = (x @ rng.normal(size=(8, 1))).astype('float32')
    batch = self.config.train.batch_size
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    return Datasets(train=ds.repeat().batch(batch, drop_remainder=True),
                    eval=ds.batch(batch), train_examples=len(x))

  def compute_loss(self, batch, *, training):
    x, y = batch
    pred = tf.cast(self.model(x, training=training), tf.float32)
    err = tf.reduce_mean(tf.square(pred - y), axis=-1)
    return err, {'abs_error': tf.reduce_mean(tf.abs(pred - y), axis=-1)}


@pytest.fixture
def toy_trainer(tmp_path):
  def make(**overrides):
    overrides.setdefault('train.batch_size', 32)
    return ToyTrainer(small_config(**overrides), str(tmp_path / 'work'))
  return make
