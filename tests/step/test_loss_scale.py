"""The loss-scale rules of trainer/step/loss_scale.py, to the letter."""

import math

import numpy as np
import pytest
import tensorflow as tf

from trainer.step.loss_scale import LossScaler, all_finite


def run(scaler, flags):
  """Feeds finite (True) / non-finite (False) steps; returns [(scale, good_steps, left)]."""
  out = []
  for finite in flags:
    scaler.update(tf.constant(finite))
    out.append(
      (
        float(scaler.scale.numpy()),
        int(scaler.good_steps.numpy()),
        int(scaler.hysteresis_left.numpy()),
      )
    )
  return out


def test_dynamic_sequence_exact():
  s = LossScaler(
    mode='dynamic',
    initial_scale=8.0,
    growth_interval=3,
    growth_factor=2.0,
    backoff_factor=0.5,
    min_scale=1.0,
    max_scale=1024.0,
  )
  got = run(s, [True, True, True, True, False, True, True, True, False, False])
  assert got == [
    (8.0, 1, 1),
    (8.0, 2, 1),
    (16.0, 0, 1),  # third finite step in a row: grow, reset
    (16.0, 1, 1),
    (8.0, 0, 0),  # non-finite: back off, reset counter, budget spent
    (8.0, 1, 1),
    (8.0, 2, 1),
    (16.0, 0, 1),  # a finite step refilled the budget
    (8.0, 0, 0),
    (4.0, 0, 0),  # every non-finite step backs off (hysteresis 1)
  ]


def test_backoff_floor_is_min_scale():
  s = LossScaler(mode='dynamic', initial_scale=4.0, min_scale=1.5, growth_interval=100)
  assert [g[0] for g in run(s, [False] * 4)] == [2.0, 1.5, 1.5, 1.5]


def test_growth_capped_at_max_scale():
  s = LossScaler(mode='dynamic', initial_scale=96.0, max_scale=128.0, growth_interval=1)
  assert [g[0] for g in run(s, [True] * 3)] == [128.0, 128.0, 128.0]


def test_growth_never_reaches_inf():
  big = float(np.finfo(np.float32).max) / 1.5
  s = LossScaler(mode='dynamic', initial_scale=big, max_scale=math.inf, growth_interval=1)
  scales = [g[0] for g in run(s, [True] * 3)]
  assert all(math.isfinite(x) for x in scales)
  assert scales[0] == pytest.approx(big, rel=1e-6)


def test_hysteresis_budget():
  s = LossScaler(mode='dynamic', initial_scale=64.0, hysteresis=3, growth_interval=100)
  got = run(s, [False, False, False, False, True, False])
  assert got == [
    (64.0, 0, 2),
    (64.0, 0, 1),  # the first N-1 only skip
    (32.0, 0, 0),
    (16.0, 0, 0),  # the N-th and every further one back off
    (16.0, 1, 3),  # a finite step refills the budget
    (16.0, 0, 2),
  ]


@pytest.mark.parametrize('mode', ['static', 'none'])
def test_static_and_none_never_move(mode):
  s = LossScaler(mode=mode, initial_scale=128.0)
  expected = 128.0 if mode == 'static' else 1.0
  assert [g[0] for g in run(s, [False, True, True, False])] == [expected] * 4
  loss = tf.constant(2.0)
  assert float(s.scale_loss(loss)) == 2.0 * expected
  grads = s.unscale([tf.constant([expected * 3.0], tf.float16), None])
  assert grads[1] is None and grads[0].dtype == tf.float32
  assert float(grads[0][0]) == 3.0


def test_all_finite():
  assert bool(all_finite([tf.ones(3), None]))
  assert not bool(all_finite([tf.ones(3), tf.constant([1.0, np.inf])]))
  assert not bool(all_finite([tf.constant([np.nan])]))


def test_all_finite_is_exact_where_the_fast_sum_is_not():
  """The fast path sums; a sum that overflows float32 must not make a finite step skip, and
  infinities that cancel to NaN (or to anything) must still skip it."""
  huge = tf.constant([3e38, 3e38, -1e38])  # every element finite, the sum overflows
  assert bool(all_finite([huge, tf.ones(2)]))
  assert bool(tf.function(all_finite)([huge, tf.ones(2)]))  # compiled, as in the step
  assert not bool(all_finite([tf.constant([np.inf]), tf.constant([-np.inf])]))
  assert not bool(all_finite([tf.constant([1.0, np.inf, -np.inf, 2.0])]))
  assert not bool(all_finite([tf.constant([1.0], tf.bfloat16), tf.constant([np.nan], tf.float16)]))
  sparse = tf.IndexedSlices(tf.constant([[1.0, np.inf]]), tf.constant([2]), tf.constant([4, 2]))
  assert not bool(all_finite([sparse]))
  assert bool(
    all_finite([tf.IndexedSlices(tf.ones([1, 2]), tf.constant([2]), tf.constant([4, 2]))])
  )


def test_from_config_auto():
  from trainer import config as config_lib

  p = config_lib.defaults().precision
  assert LossScaler.from_config(p, 'mixed_float16').mode == 'dynamic'
  assert LossScaler.from_config(p, 'mixed_bfloat16').mode == 'none'
  p.loss_scale = '128'
  static = LossScaler.from_config(p, 'float32')
  assert static.mode == 'static' and float(static.scale.numpy()) == 128.0


# ---- the step around the scaler: what may and may not move the scale --------------------------


def _one_batch_iterator(trainer, batch):
  dataset = tf.data.Dataset.from_tensors(batch).repeat()
  return iter(trainer.strategy.experimental_distribute_dataset(dataset))


def test_a_non_finite_learning_rate_skips_the_step_but_leaves_the_scale(tmp_path):
  import keras
  from tiny import TinyTrainer, tiny_config

  class InfRate(TinyTrainer):
    def build_optimizer(self, learning_rate):
      return keras.optimizers.SGD(
        learning_rate=lambda: tf.where(tf.equal(self.global_step, 1), float('inf'), 0.1)
      )

  trainer = InfRate(tiny_config(**{'precision.policy': 'mixed_float16'}), str(tmp_path / 'w'))
  batch = next(iter(trainer.datasets.train))
  iterator = _one_batch_iterator(trainer, batch)
  trainer.runner.train_loop.run(iterator, 1)
  before = [v.numpy().copy() for v in trainer.model.trainable_variables]
  trainer.runner.train_loop.run(iterator, 1)  # step 1: rate inf
  assert int(trainer.train_step.skipped_steps.numpy()) == 1
  for a, v in zip(before, trainer.model.trainable_variables):
    np.testing.assert_array_equal(a, v.numpy())
  assert float(trainer.loss_scaler.scale.numpy()) == 32768.0  # not backed off to 16384
  assert int(trainer.loss_scaler.good_steps.numpy()) == 1  # nor counted as a good step
  trainer.runner.train_loop.run(iterator, 1)
  assert int(trainer.loss_scaler.good_steps.numpy()) == 2


def test_an_optimizers_own_loss_scale_factor_is_reset(tmp_path, caplog):
  """SGD(0.5, loss_scale_factor=100) would divide every gradient by 100 on top of the trainer's
  unscaling: the update must be a plain float32 SGD step, w - 0.5 g."""
  import keras
  from tiny import TinyTrainer, tiny_config

  class Factor(TinyTrainer):
    def build_optimizer(self, learning_rate):
      return keras.optimizers.SGD(0.5, loss_scale_factor=100.0)

  with caplog.at_level('WARNING'):
    trainer = Factor(tiny_config(**{'precision.loss_scale': 'dynamic'}), str(tmp_path / 'w'))
  assert any('loss_scale_factor=100 reset to None' in r.getMessage() for r in caplog.records)
  assert trainer.optimizer.loss_scale_factor is None
  batch = next(iter(trainer.datasets.train))
  x, y = (t.numpy() for t in batch)
  weights = [v.numpy().astype(np.float64) for v in trainer.model.trainable_variables]
  # NumPy float64: Dense(relu) -> Dense logits, mean softmax cross-entropy, its gradients.
  w1, b1, w2, b2 = weights
  pre = x @ w1 + b1
  h = np.maximum(pre, 0)
  z = h @ w2 + b2
  p = np.exp(z - z.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  p[np.arange(len(y)), y] -= 1
  dz = p / len(y)
  dh = (dz @ w2.T) * (pre > 0)
  grads = [x.T @ dh, dh.sum(0), h.T @ dz, dz.sum(0)]
  trainer.runner.train_loop.run(_one_batch_iterator(trainer, batch), 1)
  for w, g, v in zip(weights, grads, trainer.model.trainable_variables):
    np.testing.assert_allclose(v.numpy(), w - 0.5 * g, rtol=1e-5, atol=1e-6)
