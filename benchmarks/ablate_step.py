"""Where our step's time goes: our trainer vs Keras fit vs two stripped-down copies of our step.

  python benchmarks/ablate_step.py --model=mnist_cnn --policy=mixed_bfloat16 --steps_per_loop=10
  python benchmarks/ablate_step.py --model=mnist_mlp --policy=float32 --steps_per_loop=100

Contenders, interleaved in rounds like benchmarks/run.py, reported per wall-clock second and per
CPU-second of the process, each as a ratio to `fit`:
  ours      the Trainer's compiled loop, unchanged;
  no_cond   ours without `tf.cond(finite, apply, skip)`: gradients always applied (the finite
            check, loss scaler, metrics and counters stay), i.e. the cost of the skip guarantee;
  bare      tape, gradients, apply_gradients, global step += 1: the floor of a custom loop;
  fit       Keras `model.fit`, steps_per_execution = steps_per_loop.
A diagnostic, not a test: `no_cond` and `bare` drop guarantees the trainer keeps.
"""
from __future__ import annotations

import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from absl import app, flags, logging  # noqa: E402

from benchmarks import run as bench_run  # noqa: E402  (its flags: --rounds, --data_root, ...)

_MODEL = flags.DEFINE_string('model', 'mnist_cnn', 'Module in models/.')
_POLICY = flags.DEFINE_string('policy', 'float32', 'Precision policy.')
_SPL = flags.DEFINE_integer('steps_per_loop', 10, 'Steps per compiled call.')
_CALLS = flags.DEFINE_integer('calls', 4, 'Compiled calls per contender per round.')


def strip(train_step, keep_checks: bool) -> None:
  """Replaces the step of `train_step` (a TrainStep) by one without the skip cond
  (keep_checks=True) or by a bare custom-loop step (keep_checks=False)."""
  import tensorflow as tf
  ts = train_step
  SUM = tf.distribute.ReduceOp.SUM

  def no_cond_step(iterator):
    loss, metrics, grads, nonfinite = ts.strategy.run(ts._replica_grads_fn,
                                                      args=(next(iterator),))
    finite = tf.equal(ts.strategy.reduce(SUM, nonfinite, axis=None), 0)
    loss = ts.strategy.reduce(SUM, loss, axis=None)
    metrics = {k: ts.strategy.reduce(SUM, v, axis=None) for k, v in metrics.items()}
    ts.strategy.run(ts._apply, args=(grads,))
    ts.skipped_steps.assign_add(tf.cast(tf.logical_not(finite), tf.int64))
    ts.loss_scaler.update(finite)
    ts.global_step.assign_add(1)
    values = tf.stack([loss, *(metrics[k] for k in ts._metric_names[1:]), 1.0])
    return tf.where(tf.math.is_finite(loss), values, tf.zeros_like(values))

  def bare_step(iterator):
    def replica(batch):
      with tf.GradientTape() as tape:
        per_example_loss, _ = ts.compute_loss(batch, training=True)
        loss = tf.nn.compute_average_loss(per_example_loss,
                                          global_batch_size=ts.global_batch_size)
      grads = tape.gradient(loss, ts.model.trainable_variables)
      ts.optimizer.apply_gradients(zip(grads, ts.model.trainable_variables))
    ts.strategy.run(replica, args=(next(iterator),))
    ts.global_step.assign_add(1)
    return tf.zeros_like(ts._totals)

  ts._step = no_cond_step if keep_checks else bare_step
  ts.train_loop = tf.function(ts._train_loop)


def main(argv):
  del argv
  logging.set_verbosity(logging.ERROR)
  import models
  from benchmarks.contenders import KerasFit, Ours
  model_config, variant = bench_run.model_config, bench_run.variant
  rounds = bench_run._ROUNDS.value or 6
  trainer_class = models.get_trainer_class(_MODEL.value)
  spl = _SPL.value
  config = variant(model_config(_MODEL.value), policy=_POLICY.value, steps_per_loop=spl)
  built = {}
  for name in ('ours', 'no_cond', 'bare', 'fit'):
    contender = (KerasFit if name == 'fit' else Ours)(trainer_class, config)
    if name in ('no_cond', 'bare'):
      strip(contender.trainer.train_step, keep_checks=name == 'no_cond')
    contender.timed(spl)
    contender.timed(spl * _CALLS.value)
    built[name] = contender
  wall = {k: [] for k in built}
  cpu = {k: [] for k in built}
  steps = spl * _CALLS.value
  for _ in range(rounds):
    for name, contender in built.items():
      w, c = contender.timed(steps)
      wall[name].append(steps / w)
      cpu[name].append(steps / c)
  print(f'{_MODEL.value} {_POLICY.value} steps_per_loop={spl}, {rounds} rounds; '
        'median (min-max) of per-round ratios to fit')
  print(f'{"":8} {"steps/s":>8} {"/ fit (wall)":>20} {"steps/CPU-s":>12} {"/ fit (CPU)":>20}')
  for name in built:
    row = [name, f'{statistics.median(wall[name]):8.1f}']
    for rates in (wall, cpu):
      ratios = [a / b for a, b in zip(rates[name], rates['fit'])]
      text = f'{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})'
      if rates is cpu:
        row.append(f'{statistics.median(cpu[name]):12.1f}')
      row.append(f'{text:>20}')
    print(f'{row[0]:8} {row[1]} {row[2]} {row[3]} {row[4]}')
  for contender in built.values():
    contender.close()


if __name__ == '__main__':
  app.run(main)
