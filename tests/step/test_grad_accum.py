"""train.grad_accum_steps: k micro-batches make one optimizer step equal to the whole batch's."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer import config as config_lib
from trainer.errors import ConfigError
from trainer import Datasets, Trainer

BATCH = 32


class _AccumTrainer(Trainer):
  """Dense 8 tanh -> Dense 3 with given weights; every train batch is `batch`."""

  def __init__(self, config, workdir, *, weights, batch, optimizer):
    self._weights, self._batch, self._optimizer = weights, batch, optimizer
    super().__init__(config, workdir)

  def build_model(self):
    model = keras.Sequential(
      [keras.Input((6,)), keras.layers.Dense(8, activation='tanh'), keras.layers.Dense(3)]
    )
    model.set_weights(self._weights)
    return model

  def build_datasets(self):
    data = tf.data.Dataset.from_tensors(self._batch)
    return Datasets(train=data.repeat(), eval=data, train_examples=BATCH)

  def build_optimizer(self, learning_rate):
    return keras.optimizers.SGD(0.5) if self._optimizer == 'sgd' else keras.optimizers.Adam(0.01)

  def compute_loss(self, b, *, training):
    x, y = b
    logits = self.model(x, training=training)
    loss = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
    return loss, {'accuracy': tf.cast(tf.argmax(logits, -1, output_type=tf.int32) == y, tf.float32)}


def _step(k, weights, batch, *, mode='none', optimizer='sgd', tmp='/tmp'):
  """One train step on `batch` with k micro-batches; returns (weights, skipped, scale, outputs)."""
  config = config_lib.defaults()
  config.train.batch_size = BATCH
  config.train.grad_accum_steps = k
  config.precision.policy = 'float32'
  config.precision.loss_scale = 'dynamic' if mode == 'dynamic' else 'none'
  config.precision.initial_scale = 1024.0
  trainer = _AccumTrainer(config, tmp, weights=weights, batch=batch, optimizer=optimizer)
  iterator = iter(trainer.datasets.train)
  trainer.runner.train_loop.run(iterator, 1)
  metrics = trainer.runner.train_loop.read_outputs()
  return (
    trainer.model.get_weights(),
    int(trainer.train_step.skipped_steps.numpy()),
    float(trainer.loss_scaler.scale.numpy()),
    metrics,
  )


@pytest.fixture
def setup():
  keras.utils.set_random_seed(0)
  model = keras.Sequential(
    [keras.Input((6,)), keras.layers.Dense(8, activation='tanh'), keras.layers.Dense(3)]
  )
  rng = np.random.default_rng(0)
  batch = (
    rng.normal(size=(BATCH, 6)).astype(np.float32),
    rng.integers(0, 3, size=BATCH).astype(np.int32),
  )
  return model.get_weights(), batch


@pytest.mark.parametrize('k', [2, 4, 8])
@pytest.mark.parametrize('optimizer', ['sgd', 'adam'])
def test_k_micro_batches_equal_one_step_on_the_whole_batch(setup, k, optimizer):
  weights, batch = setup
  whole, _, _, whole_metrics = _step(1, weights, batch, optimizer=optimizer)
  accumulated, skipped, _, metrics = _step(k, weights, batch, optimizer=optimizer)
  assert skipped == 0
  assert not np.allclose(whole[0], weights[0])  # the step did move the weights
  for a, b in zip(accumulated, whole):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)  # float32 summation order only
  assert metrics == pytest.approx(whole_metrics, rel=1e-5)


def test_one_non_finite_micro_batch_skips_the_step_and_backs_off_once(setup):
  weights, (x, y) = setup
  x = x.copy()
  x[BATCH // 4 * 2 + 1, 0] = np.inf  # inside the third of four micro-batches
  after, skipped, scale, _ = _step(4, weights, (x, y), mode='dynamic')
  assert skipped == 1 and scale == 512.0
  for a, b in zip(after, weights):
    np.testing.assert_array_equal(a, b)


def test_batch_must_divide_into_micro_batches():
  config = config_lib.defaults()
  config.train.batch_size, config.train.grad_accum_steps = 100, 3
  with pytest.raises(ConfigError, match='config.train.grad_accum_steps'):
    config_lib.validate(config)
