"""trainer.mixed_precision.LossScaleOptimizer in a plain loop, one replica (issue 36): the
Trainer's rules and bit-identical skips through Keras 3's and tf-keras's APIs, checkpoints, and
the one-line errors. Two replicas: tests/step/test_loss_scale_optimizer_mirrored.py."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer import mixed_precision
from trainer.errors import UserError

OPTIMIZERS = {
  'sgd_momentum': lambda: keras.optimizers.SGD(0.1, momentum=0.9),
  'adam': lambda: keras.optimizers.Adam(1e-2),
  'adamw': lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1),
  'rmsprop': lambda: keras.optimizers.RMSprop(1e-2),
}


def tiny_model(seed=0):
  keras.utils.set_random_seed(seed)
  return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])


def batch():
  rng = np.random.default_rng(0)
  return rng.normal(size=(8, 4)).astype('float32'), rng.normal(size=(8, 3)).astype('float32')


def make_step(model, opt, compiled=False, jit=False, jit_step=False):
  """A Keras 3 loop step: scale_loss, tape, apply_gradients (which unscales). `factor`
  multiplies the loss (inf: a non-finite step). `jit`: the forward/backward under XLA;
  `jit_step`: the whole step, apply and skip included (one device)."""

  def grads_of(x, y, factor):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(model(x) - y)) * factor
      scaled = opt.scale_loss(loss)
    return tape.gradient(scaled, model.trainable_variables)

  grads_fn = tf.function(grads_of, jit_compile=True) if jit else grads_of

  def step(x, y, factor):
    opt.apply_gradients(zip(grads_fn(x, y, factor), model.trainable_variables))

  if jit_step:
    return tf.function(step, jit_compile=True)
  return tf.function(step) if compiled else step


def state(model, opt):
  return [v.numpy().copy() for v in [*model.weights, *opt.inner_optimizer.variables]]


def assert_same(before, after):
  assert len(before) == len(after)
  for a, b in zip(before, after):
    np.testing.assert_array_equal(a, b)  # bit-identical, NaN never equal to a number


@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
@pytest.mark.parametrize('mode', ['eager', 'function', 'jit', 'jit_step'])
def test_a_nonfinite_step_is_skipped_bit_identically(name, mode):
  model = tiny_model()
  opt = mixed_precision.LossScaleOptimizer(OPTIMIZERS[name](), initial_scale=8.0)
  step = make_step(
    model, opt, compiled=mode != 'eager', jit=mode == 'jit', jit_step=mode == 'jit_step'
  )
  x, y = batch()
  step(x, y, tf.constant(1.0))
  assert int(opt.iterations.numpy()) == 1 and float(opt.loss_scale) == 8.0
  before = state(model, opt)
  step(x, y, tf.constant(np.inf))
  assert_same(before, state(model, opt))  # weights and every slot
  assert int(opt.iterations.numpy()) == 1
  assert float(opt.loss_scale) == 4.0 and int(opt.skipped_steps.numpy()) == 1
  step(x, y, tf.constant(1.0))
  assert int(opt.iterations.numpy()) == 2 and np.isfinite(model.weights[0].numpy()).all()


@pytest.mark.parametrize('name', sorted(OPTIMIZERS))
def test_a_finite_step_matches_the_inner_optimizer_on_true_gradients(name):
  """Scale 2**10 (a power of two): the unscaled gradients are exact, so the weights equal an
  unwrapped optimizer's on the unscaled loss's gradients, bit for bit."""
  x, y = batch()
  ours, plain = tiny_model(), tiny_model()
  opt = mixed_precision.LossScaleOptimizer(OPTIMIZERS[name](), initial_scale=2.0**10)
  reference = OPTIMIZERS[name]()
  make_step(ours, opt)(x, y, 1.0)
  with tf.GradientTape() as tape:
    loss = tf.reduce_mean(tf.square(plain(x) - y))
  reference.apply_gradients(zip(tape.gradient(loss, plain.trainable_variables), plain.weights))
  assert_same([v.numpy() for v in plain.weights], [v.numpy() for v in ours.weights])


def test_scale_rules_floor_growth_cap_and_hysteresis():
  model = tiny_model()
  opt = mixed_precision.LossScaleOptimizer(
    keras.optimizers.SGD(0.0), initial_scale=4.0, dynamic_growth_steps=2, max_scale=16.0
  )
  step, (x, y) = make_step(model, opt, compiled=True), batch()
  scales = []
  for factor in [np.inf] * 4 + [1.0] * 8:
    step(x, y, tf.constant(factor))
    scales.append(float(opt.loss_scale))
  # Backs off to the floor 1 and stays (Keras 3: 0.25, 0.125...), grows every 2 finite steps,
  # stops at the cap 16.
  assert scales == [2, 1, 1, 1, 1, 2, 2, 4, 4, 8, 8, 16]
  assert int(opt.dynamic_counter.numpy()) == 0 and int(opt.skipped_steps.numpy()) == 4

  lazy = mixed_precision.LossScaleOptimizer(
    keras.optimizers.SGD(0.0), initial_scale=4.0, hysteresis=2
  )
  step = make_step(model, lazy, compiled=True)
  found = []
  for factor in [np.inf, np.inf, np.inf, 1.0, np.inf]:
    step(x, y, tf.constant(factor))
    found.append(float(lazy.loss_scale))
  assert found == [4, 2, 1, 1, 1]  # the 2nd non-finite in a row backs off; one finite refills


def test_static_scale_skips_but_never_moves():
  model = tiny_model()
  opt = mixed_precision.LossScaleOptimizer(
    keras.optimizers.SGD(0.1), initial_scale=128.0, dynamic=False
  )
  step, (x, y) = make_step(model, opt), batch()
  step(x, y, 1.0)
  before = state(model, opt)
  step(x, y, np.inf)
  assert_same(before, state(model, opt))
  assert float(opt.loss_scale) == 128.0 and opt.dynamic_counter is None and not opt.dynamic


def test_tf_keras_loop_api_unscales_once():
  """tf-keras 2.x: get_scaled_loss, get_unscaled_gradients, then apply_gradients, which must
  not divide by the scale again (Keras 3's apply would)."""
  x, y = batch()
  ours, plain = tiny_model(), tiny_model()
  opt = mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**12)
  with tf.GradientTape() as tape:
    loss = tf.reduce_mean(tf.square(ours(x) - y))
    scaled = opt.get_scaled_loss(loss)
  assert float(scaled) == float(loss) * 2.0**12
  grads = opt.get_unscaled_gradients(tape.gradient(scaled, ours.trainable_variables))
  opt.apply_gradients(zip(grads, ours.trainable_variables))
  with tf.GradientTape() as tape:
    loss = tf.reduce_mean(tf.square(plain(x) - y))
  keras.optimizers.SGD(0.1).apply_gradients(
    zip(tape.gradient(loss, plain.trainable_variables), plain.weights)
  )
  assert_same([v.numpy() for v in plain.weights], [v.numpy() for v in ours.weights])
  assert opt.dynamic_growth_steps == 2000 and int(opt.dynamic_counter.numpy()) == 1
  assert float(opt.get_scaled_loss(lambda: tf.constant(2.0))()) == 2.0**13


def test_scale_state_and_skips_are_saved_in_checkpoints(tmp_path):
  model = tiny_model()
  opt = mixed_precision.LossScaleOptimizer(keras.optimizers.Adam(), initial_scale=8.0)
  step, (x, y) = make_step(model, opt), batch()
  for factor in [1.0, np.inf, 1.0]:
    step(x, y, factor)
  path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / 'ckpt'))
  fresh_model = tiny_model(seed=1)
  fresh = mixed_precision.LossScaleOptimizer(keras.optimizers.Adam(), initial_scale=8.0)
  fresh.build(fresh_model.trainable_variables)
  tf.train.Checkpoint(model=fresh_model, optimizer=fresh).restore(path).assert_consumed()
  assert float(fresh.loss_scale) == 4.0
  assert int(fresh.dynamic_counter.numpy()) == 1 and int(fresh.skipped_steps.numpy()) == 1
  assert int(fresh.iterations.numpy()) == 2
  names = [v.name.split(':')[0] for v in opt.variables]
  assert {'scale', 'good_steps', 'hysteresis_left', 'skipped_steps'} <= set(names)


def test_mixed_float16_compile_keeps_ours_and_loss_is_scaled_once():
  keras.mixed_precision.set_global_policy('mixed_float16')
  model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
  opt = mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.1))
  model.compile(optimizer=opt, loss='mse')
  assert model.optimizer is opt  # Keras wraps only an optimizer not already a loss scaler
  with pytest.raises(UserError, match='already scaled'):
    opt.scale_loss(opt.scale_loss(tf.constant(1.0)))


def test_errors_are_one_line():
  inner = keras.optimizers.SGD()
  for wrapped in [
    mixed_precision.LossScaleOptimizer(keras.optimizers.SGD()),
    keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD()),
  ]:
    with pytest.raises(UserError, match='already a loss scale optimizer'):
      mixed_precision.LossScaleOptimizer(wrapped)
  with pytest.raises(UserError, match='dynamic=True/False by keyword'):
    mixed_precision.LossScaleOptimizer(inner, False)
  half = tf.Variable(tf.zeros([2], tf.float16))
  with pytest.raises(UserError, match='is float16'):
    mixed_precision.LossScaleOptimizer(inner).build([half])
  strategy = tf.distribute.MirroredStrategy(['CPU:0'])
  with strategy.scope():
    variable = tf.Variable(tf.zeros([2]))
  with pytest.raises(UserError, match='outside the strategy.scope'):
    mixed_precision.LossScaleOptimizer(keras.optimizers.SGD()).build([variable])
  opt = mixed_precision.LossScaleOptimizer(keras.optimizers.SGD())
  with pytest.raises(UserError, match='already unscaled'):
    opt.get_unscaled_gradients(opt.get_unscaled_gradients([tf.ones([2])]))


def test_fit_logs_scale_and_skips_and_model_save_keeps_them(tmp_path):
  """One replica: a batch whose targets are inf is skipped by fit; LossScaleMonitor puts the
  scale and the skip count into History; model.save / load_model keep them."""
  model = tiny_model()
  opt = mixed_precision.LossScaleOptimizer(keras.optimizers.Adam(1e-2), initial_scale=8.0)
  model.compile(optimizer=opt, loss='mse')
  x, y = batch()
  y[4:] = np.inf  # the second batch of 4
  monitor = mixed_precision.LossScaleMonitor()
  history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[monitor])
  assert history.history['skipped_steps'] == [1, 2]
  assert history.history['loss_scale'] == [4.0, 2.0]
  assert int(opt.iterations.numpy()) == 2 and np.isfinite(model.weights[0].numpy()).all()
  model.save(tmp_path / 'm.keras')
  loaded = keras.models.load_model(tmp_path / 'm.keras')  # registered: no custom_objects
  assert isinstance(loaded.optimizer, mixed_precision.LossScaleOptimizer)
  assert float(loaded.optimizer.loss_scale) == 2.0
  assert int(loaded.optimizer.skipped_steps.numpy()) == 2
