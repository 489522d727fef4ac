"""Runs for tests/step/test_loss_scale_optimizer_mirrored.py on 2 logical CPUs (MirroredStrategy).

The CPU must be split before TensorFlow runs any op, so this runs in a fresh process:
`python tests/lso_mirrored_run.py OUT.json`. Every gradient of replica 1 (only) is inf or NaN:
the loss is multiplied by inf there. Cases:
  loop        our optimizer in a tf.function GradientTape loop inside strategy.run, the
              forward/backward under XLA: one finite step, then one with replica 1 non-finite;
  fit_ours    model.fit with our optimizer, replica 1 non-finite on every step;
  fit_keras   the same fit with keras.mixed_precision.LossScaleOptimizer (checks replica 0 only);
  guide       docs/guides/mixed-precision-own-loop.md's loop under mixed_float16 on 2 replicas
              and on 1, the same MNIST batches.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import tensorflow as tf

STEPS = 3
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MNIST_DIR = os.path.join(ROOT, '..', 'shared', 'data', 'mnist')


def split_cpu() -> None:
  cpu = tf.config.list_physical_devices('CPU')[0]
  tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)


def replica_factor(bad) -> tf.Tensor:
  """inf on replica 1 when `bad`, else 1 (1 too outside replica context: Keras's build)."""
  context = tf.distribute.get_replica_context()
  if context is None:
    return tf.constant(1.0)
  replica = context.replica_id_in_sync_group
  return tf.where(tf.logical_and(bad, tf.equal(replica, 1)), np.inf, 1.0)


def data():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(16 * STEPS, 4)).astype('float32')
  return x, rng.normal(size=(16 * STEPS, 3)).astype('float32')


def loop_case(strategy) -> dict:
  import keras

  from trainer import mixed_precision

  with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    opt = mixed_precision.LossScaleOptimizer(keras.optimizers.Adam(1e-2), initial_scale=8.0)
    opt.build(model.trainable_variables)

  @tf.function(jit_compile=True)
  def grads_of(x, y, factor):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.square(model(x) - y)) / 16.0 * factor
      scaled = opt.scale_loss(loss)
    return tape.gradient(scaled, model.trainable_variables)

  def replica(x, y, bad):
    grads = grads_of(x, y, replica_factor(bad))
    opt.apply_gradients(zip(grads, model.trainable_variables))

  @tf.function
  def step(x, y, bad):
    strategy.run(replica, args=(x, y, bad))

  x, y = data()
  dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
  batches = iter(strategy.experimental_distribute_dataset(dataset))
  step(*next(batches), tf.constant(False))
  before = [v.numpy().copy() for v in [*model.weights, *opt.inner_optimizer.variables]]
  step(*next(batches), tf.constant(True))
  after = [v.numpy() for v in [*model.weights, *opt.inner_optimizer.variables]]
  return {
    'identical': all(np.array_equal(a, b) for a, b in zip(before, after)),
    'iterations': int(opt.iterations.numpy()),
    'scale': float(opt.loss_scale),
    'skipped': int(opt.skipped_steps.numpy()),
  }


def fit_case(strategy, ours: bool) -> dict:
  import keras

  from trainer import mixed_precision

  def loss(y_true, y_pred):
    return tf.reduce_mean(tf.square(y_true - y_pred), axis=-1) * replica_factor(True)

  with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    wrapper = mixed_precision if ours else keras.mixed_precision
    opt = wrapper.LossScaleOptimizer(keras.optimizers.Adam(1e-2))
    model.compile(optimizer=opt, loss=loss)
  before = [v.numpy().copy() for v in model.weights]
  x, y = data()
  callbacks = [mixed_precision.LossScaleMonitor()] if ours else []
  history = model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=callbacks)
  after = [v.numpy() for v in model.weights]
  return {
    'finite': all(bool(np.isfinite(a).all()) for a in after),
    'unchanged': all(np.array_equal(a, b) for a, b in zip(before, after)),
    'iterations': int(opt.iterations.numpy()),
    'scale': float(opt.dynamic_scale.numpy()),
    'history': {k: [float(v) for v in vs] for k, vs in history.history.items()},
  }


def guide_case(strategy) -> dict:
  import importlib.util
  import tempfile

  from docblocks import block
  from trainer.data import mnist as mnist_data

  path = os.path.join(tempfile.mkdtemp(), 'own_loop.py')  # a file: autograph reads the source
  with open(path, 'w') as f:
    f.write(block('runs this block as own_loop.py'))
  spec = importlib.util.spec_from_file_location('own_loop', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  (x, y), _ = mnist_data.load(MNIST_DIR)
  x, y = x[:1024].reshape(1024, 784).astype('float32') / 255, y[:1024].astype('int64')
  runs = {}
  for name, where in [('two', strategy), ('one', None)]:
    tf.keras.utils.set_random_seed(0)
    model, opt = module.train(x, y, strategy=where, epochs=1, batch_size=256)
    runs[name] = ([v.numpy() for v in model.weights], opt)
  (two, opt_two), (one, opt_one) = runs['two'], runs['one']
  return {
    'steps': [int(o.iterations.numpy() + o.skipped_steps.numpy()) for o in (opt_two, opt_one)],
    'skipped': [int(o.skipped_steps.numpy()) for o in (opt_two, opt_one)],
    'scale': [float(o.loss_scale) for o in (opt_two, opt_one)],
    'max_difference': max(float(np.abs(a - b).max()) for a, b in zip(two, one)),
    'finite': all(bool(np.isfinite(a).all()) for a in two),
  }


def main(out: str) -> None:
  split_cpu()
  strategy = tf.distribute.MirroredStrategy(['CPU:0', 'CPU:1'])
  results = {
    'replicas': strategy.num_replicas_in_sync,
    'loop': loop_case(strategy),
    'fit_ours': fit_case(strategy, ours=True),
    'fit_keras': fit_case(strategy, ours=False),
    'guide': guide_case(strategy),
  }
  with open(out, 'w') as f:
    json.dump(results, f)


if __name__ == '__main__':
  main(sys.argv[1])
  from quick_exit import exit_now

  exit_now()  # the results are written; skip TensorFlow's teardown (tests/quick_exit.py)
