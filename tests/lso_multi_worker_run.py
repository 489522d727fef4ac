"""One worker of tests/step/test_loss_scale_optimizer_multi_worker.py (issue 36): two local
processes under MultiWorkerMirroredStrategy, one replica each.

  TF_CONFIG=... python tests/lso_multi_worker_run.py OUT_DIR

Every batch of worker 1 (only) has inputs x 1e30, so its loss and every gradient overflow
float32 to inf there; worker 0's are finite. Cases, each with
trainer.mixed_precision.LossScaleOptimizer, float32:
  fit    model.fit (inner SGD) on a dataset from `distribute_datasets_from_function`, keyed on
         the input pipeline (= worker) index, with LossScaleMonitor;
  loop   a tf.function step with strategy.run and a GradientTape (inner Adam).
Writes OUT_DIR/worker<index>.json.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import tensorflow as tf

STEPS = 3
GLOBAL_BATCH = 16
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
  """This worker's batches: finite on worker 0, x 1e30 (inf loss and gradients) on worker 1."""
  batch = context.get_per_replica_batch_size(GLOBAL_BATCH)
  rng = np.random.default_rng(context.input_pipeline_id)
  x = rng.normal(size=(batch * STEPS, 4)).astype('float32')
  y = rng.normal(size=(batch * STEPS, 3)).astype('float32')
  if context.input_pipeline_id == 1:
    x *= 1e30
  return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def build(strategy, inner: str):
  import keras

  from trainer import mixed_precision

  with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    optimizer = {'sgd': keras.optimizers.SGD(0.1), 'adam': keras.optimizers.Adam(1e-2)}[inner]
    return model, mixed_precision.LossScaleOptimizer(optimizer)


def summary(model, opt, before) -> dict:
  after = [v.numpy() for v in model.weights]
  return {
    'finite': all(bool(np.isfinite(a).all()) for a in after),
    'unchanged': all(np.array_equal(a, b) for a, b in zip(before, after, strict=True)),
    'weights': [a.tolist() for a in after],
    'iterations': int(opt.iterations.numpy()),
    'skipped': int(opt.skipped_steps.numpy()),
    'scale': float(opt.dynamic_scale.numpy()),
  }


def shaped_logs_model():
  import keras

  class ShapedLogs(keras.Model):
    """Logs of shape [1]: Keras 3.15.1 reduces them across workers with a mean over axis 0."""

    def train_step(self, data):
      return {k: tf.reshape(v, [1]) for k, v in super().train_step(data).items()}

  return ShapedLogs


def fit_case(strategy) -> dict:
  """Keras 3.15.1's fit on a model created in a multi-worker scope first reduces the (x, y)
  of one batch across workers and fails (`strategy.reduce` of a tuple; keras-team/keras#20585),
  so the Model object comes from outside the scope (its layers, variables and optimizer are
  the scope's) and fit runs inside it: Keras takes the strategy from the scope. Its reduction
  of the logs across workers (a mean over axis 0) fails on scalars too: `ShapedLogs` gives
  them shape [1]."""
  from trainer import mixed_precision

  built, opt = build(strategy, 'sgd')
  ShapedLogs = shaped_logs_model()
  model = ShapedLogs(built.inputs, built.outputs)  # outside the scope, see above
  with strategy.scope():
    model.compile(optimizer=opt, loss='mse')
  before = [v.numpy().copy() for v in model.weights]
  data = strategy.distribute_datasets_from_function(dataset_fn)
  monitor = mixed_precision.LossScaleMonitor()
  with strategy.scope():
    history = model.fit(data, epochs=1, steps_per_epoch=STEPS, verbose=0, callbacks=[monitor])
  found = summary(model, opt, before)
  found['history'] = {k: [float(v) for v in vs] for k, vs in history.history.items()}
  return found


def loop_case(strategy) -> dict:
  model, opt = build(strategy, 'adam')
  with strategy.scope():
    opt.build(model.trainable_variables)
  before = [v.numpy().copy() for v in model.weights]

  def replica(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.square(model(x) - y)) / GLOBAL_BATCH
      scaled = opt.scale_loss(loss)
    grads = tape.gradient(scaled, model.trainable_variables)
    opt.apply_gradients(zip(grads, model.trainable_variables))

  @tf.function
  def step(batch):
    strategy.run(replica, args=batch)

  for batch in strategy.distribute_datasets_from_function(dataset_fn):
    step(batch)
  return summary(model, opt, before)


def main(out_dir: str) -> None:
  sys.path.insert(0, ROOT)
  strategy = tf.distribute.MultiWorkerMirroredStrategy()
  task = json.loads(os.environ['TF_CONFIG'])['task']
  results = {
    'replicas': strategy.num_replicas_in_sync,
    'fit': fit_case(strategy),
    'loop': loop_case(strategy),
  }
  with open(os.path.join(out_dir, f'worker{task["index"]}.json'), 'w') as f:
    json.dump(results, f)


if __name__ == '__main__':
  main(sys.argv[1])
