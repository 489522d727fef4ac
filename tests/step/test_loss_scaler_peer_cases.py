"""The peers' own loss-scaler tests, ported to trainer.mixed_precision.LossScaleOptimizer.

K*: keras/src/optimizers/loss_scale_optimizer_test.py (Keras 3.15.1); P*: PyTorch's GradScaler
tests (test/test_cuda.py, test_grad_scaling_*). docs/guides/loss-scaler-cases.md lists every
case, theirs vs ours, same or different and why. Tiny float32 tensors, eager.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer import mixed_precision
from trainer.errors import UserError

LSO = mixed_precision.LossScaleOptimizer
GRADS = [1.0, 6.0, 7.0, 2.0]
AFTER = [0.5, -1.0, -0.5, 3.0]  # [1, 2, 3, 4] - 0.5 * GRADS


def variable():
  return keras.Variable([1.0, 2.0, 3.0, 4.0])


def test_k1_config_round_trip():
  inner = keras.optimizers.SGD(learning_rate=0.5, momentum=0.06, nesterov=True, weight_decay=0.004)
  opt = LSO(inner, initial_scale=3.0, dynamic_growth_steps=2, name='test_opt', hysteresis=2)
  config = opt.get_config()
  again = LSO.from_config(dict(config))  # from_config pops the inner optimizer (as Keras)
  assert again.get_config() == config and again.name == 'test_opt'
  assert again.inner_optimizer.get_config() == inner.get_config()
  assert config['initial_scale'] == 3.0 and config['dynamic_growth_steps'] == 2
  assert config['hysteresis'] == 2  # different: our extra rules travel in the config too


@pytest.mark.parametrize('with_variables', [True, False])
def test_k2_k3_finite_step(with_variables):
  opt, v = LSO(keras.optimizers.SGD(0.5)), variable()
  grads = [tf.constant(GRADS) * opt.initial_scale]
  if with_variables:
    opt.apply(grads, [v])
  else:  # K2: apply with no variables after build
    opt.build([v])
    opt.apply(grads)
  np.testing.assert_allclose(v.numpy(), AFTER, rtol=1e-6)


@pytest.mark.parametrize('scale', [400.0, 2.0**15])
def test_k3_prime_unscaling_multiplies_by_the_reciprocal(scale):
  """Ours is g x (1/S) (PyTorch's inv_scale), Keras's g / S: one ulp apart in some values at a
  scale that is not a power of two, bit-identical at one that is."""
  grads = np.random.default_rng(0).normal(size=1000).astype(np.float32) * np.float32(scale)
  opt = LSO(keras.optimizers.SGD(0.5), initial_scale=scale)
  (ours,) = opt.get_unscaled_gradients([tf.constant(grads)])
  s = np.float32(scale)
  np.testing.assert_array_equal(ours.numpy(), grads * (np.float32(1) / s))
  divided = grads / s
  apart = np.abs(ours.numpy() - divided) / np.spacing(np.abs(divided))
  assert apart.max() <= 1.0
  assert (apart > 0).sum() > 100 if scale == 400.0 else (apart > 0).sum() == 0


def test_k4_the_inner_optimizers_loss_scale_factor_is_reset():
  opt, v = LSO(keras.optimizers.SGD(0.5, loss_scale_factor=100)), variable()
  assert opt.inner_optimizer.loss_scale_factor is None
  opt.apply([tf.constant(GRADS) * opt.initial_scale], [v])
  np.testing.assert_allclose(v.numpy(), AFTER, rtol=1e-6)


def test_k5_infinite_step_leaves_the_variable():
  opt, v = LSO(keras.optimizers.SGD(0.5)), variable()
  opt.apply([tf.constant([np.inf] * 4)], [v])
  np.testing.assert_array_equal(v.numpy(), [1.0, 2.0, 3.0, 4.0])


def test_k6_overwrite_with_gradient_is_neither_unscaled_nor_stepped():
  opt, v = LSO(keras.optimizers.SGD(0.5)), variable()
  v.overwrite_with_gradient = True
  opt.apply([tf.constant(GRADS)], [v])
  np.testing.assert_array_equal(v.numpy(), GRADS)


def test_k7_downscaling_and_k8_upscaling():
  opt, v = LSO(keras.optimizers.SGD(0.5), initial_scale=400.0), variable()
  for _ in range(4):
    opt.apply([tf.constant([np.inf] * 4)], [v])
  assert float(opt.scale_loss(1.0)) == 25.0
  opt = LSO(keras.optimizers.SGD(0.5), initial_scale=2.0, dynamic_growth_steps=2)
  for _ in range(8):
    opt.apply([tf.constant(GRADS)], [v])
  assert float(opt.scale_loss(1.0)) == 32.0


def test_k9_iterations_count_applied_steps_only():
  opt, v = LSO(keras.optimizers.SGD(0.5)), variable()
  opt.build([v])
  assert int(opt.iterations.numpy()) == 0
  for i in range(3):
    opt.apply([tf.constant(GRADS)], [v])
    assert int(opt.iterations.numpy()) == i + 1
  opt.apply([tf.constant([np.nan] * 4)], [v])  # different from Keras's test: a skip too
  assert int(opt.iterations.numpy()) == 3


def test_k11_k12_arguments():
  static = LSO(keras.optimizers.SGD(), initial_scale=8.0, dynamic=False)  # Keras: refused
  assert not static.dynamic and float(static.loss_scale) == 8.0
  with pytest.raises(TypeError, match='foo'):
    LSO(keras.optimizers.SGD(), foo=1)
  with pytest.raises(TypeError, match='weight_decay'):
    LSO(keras.optimizers.SGD(), weight_decay=0.1)


def test_p1_update_scale():
  opt, v = LSO(keras.optimizers.SGD(0.0), 4.0, 2, backoff_factor=0.25), variable()
  seen = []
  for grad in [GRADS, GRADS, [np.inf] * 4]:
    opt.apply([tf.constant(grad)], [v])
    seen.append((int(opt.dynamic_counter.numpy()), float(opt.loss_scale)))
  assert seen == [(1, 4.0), (0, 8.0), (0, 2.0)]


def test_p2_sparse_gradients():
  """IndexedSlices (an embedding's gradient): unscaled values, an inf or NaN value found."""
  v = keras.Variable(tf.zeros([2, 3]))
  for bad, skipped in [(16.0, 0), (np.inf, 1), (np.nan, 1)]:
    opt = LSO(keras.optimizers.SGD(1.0), initial_scale=4.0)
    grad = tf.IndexedSlices(tf.constant([[16.0, 32.0, bad]]), tf.constant([1]), tf.constant([2, 3]))
    unscaled = opt.get_unscaled_gradients([grad])[0]
    assert isinstance(unscaled, tf.IndexedSlices)
    if not skipped:
      np.testing.assert_array_equal(unscaled.values.numpy(), [[4.0, 8.0, 4.0]])
    opt.apply([unscaled], [v])
    assert int(opt.skipped_steps.numpy()) == skipped


def test_p3_state_round_trip():
  s0 = LSO(keras.optimizers.SGD(), 3.0, 2, growth_factor=4.0, backoff_factor=0.5)
  s1 = LSO(keras.optimizers.SGD(), 6.0, 1, growth_factor=7.0, backoff_factor=0.8)
  s1.loss_scaler.good_steps.assign(7)
  s1.loss_scaler.scale.assign(s0.loss_scaler.scale)  # our state: variables, not a dict
  s1.loss_scaler.good_steps.assign(s0.loss_scaler.good_steps)
  assert float(s1.loss_scale) == 3.0 and int(s1.dynamic_counter.numpy()) == 0
  copy = LSO.from_config(s0.get_config())  # the rules: the config
  assert copy.loss_scaler.growth_factor == 4.0 and copy.loss_scaler.backoff_factor == 0.5
  assert copy.dynamic_growth_steps == 2


@pytest.mark.parametrize('make', [lambda: keras.optimizers.SGD(0.1), keras.optimizers.Adam])
@pytest.mark.parametrize('enabled', [True, False])
def test_p4_scaled_run_matches_an_unscaled_run_that_skips_the_same_step(make, enabled):
  """PyTorch's _run_scaling_case: 4 steps, an inf injected into one gradient at step 2;
  growth_interval 1, scale 128. The control applies plain gradients and skips step 2."""
  keras.utils.set_random_seed(0)
  data = [tf.random.normal([4, 3]) for _ in range(4)]
  control, scaled = keras.Variable(tf.ones([3, 2])), keras.Variable(tf.ones([3, 2]))
  args = dict(initial_scale=128.0, dynamic_growth_steps=1)
  opt = LSO(make(), **(args if enabled else dict(initial_scale=1.0, dynamic=False)))
  plain = make()
  for i, x in enumerate(data):
    with tf.GradientTape(persistent=True) as tape:
      loss_c = tf.reduce_sum(tf.square(x @ control))
      loss_s = opt.scale_loss(tf.reduce_sum(tf.square(x @ scaled)))
    if i != 2:
      plain.apply([tape.gradient(loss_c, control)], [control])
    grad = tape.gradient(loss_s, scaled)
    opt.apply([grad * np.inf if i == 2 else grad], [scaled])
  np.testing.assert_allclose(scaled.numpy(), control.numpy(), rtol=1e-6)
  assert float(opt.loss_scale) == (128.0 * 2**3 * 0.5 if enabled else 1.0)


def test_p5_an_inf_in_any_one_gradient_is_found():
  variables = [keras.Variable(tf.ones([n])) for n in (1, 7, 100, 1000)]
  for index in range(-1, len(variables)):
    opt = LSO(keras.optimizers.SGD(1.0), initial_scale=1.0)
    grads = [tf.ones([n]) for n in (1, 7, 100, 1000)]
    if index >= 0:
      grads[index] = tf.tensor_scatter_nd_update(grads[index], [[0]], [np.inf])
    opt.apply(grads, variables)
    assert int(opt.skipped_steps.numpy()) == (index >= 0)


def test_p6_the_scale_never_overflows():
  opt, v = LSO(keras.optimizers.Adam(), 1e38, 1, growth_factor=2.0**4, max_scale=3e38), variable()
  opt.apply([tf.constant(GRADS) * 1e-30], [v])
  assert np.isfinite(float(opt.loss_scale)) and float(opt.loss_scale) == pytest.approx(1e38)


def test_p7_unscaling_twice_is_refused():
  opt = LSO(keras.optimizers.SGD())
  once = opt.get_unscaled_gradients([tf.constant(GRADS)])
  with pytest.raises(UserError, match='already unscaled'):
    opt.get_unscaled_gradients(once)


def test_p8_clip_between_unscale_and_apply():
  """tf-keras / PyTorch pattern: unscale, clip the true gradients, apply (no second unscale)."""
  opt, v = LSO(keras.optimizers.SGD(1.0), initial_scale=2.0**10), variable()
  grads = opt.get_unscaled_gradients([tf.constant(GRADS) * 2.0**10])
  clipped, norm = tf.clip_by_global_norm(grads, 1.0)
  opt.apply_gradients(zip(clipped, [v]))
  assert float(norm) == pytest.approx(np.linalg.norm(GRADS))
  step = np.array([1.0, 2.0, 3.0, 4.0]) - v.numpy()
  assert np.linalg.norm(step) == pytest.approx(1.0, rel=1e-6)
