"""Where our step's time goes: our trainer vs Keras fit vs two stripped-down copies of our step.

  python benchmarks/ablate_step.py --model=mnist_cnn --policy=mixed_bfloat16 --steps_per_loop=10
  python benchmarks/ablate_step.py --model=mnist_mlp --policy=float32 --steps_per_loop=100
  python -m benchmarks.ablate_step --config=nanogpt_cpu --jit --contenders=ours,bare \
      --steps_per_loop=100 --calls=2 --rounds=6   # nanoGPT's shape, XLA as that config has it

Contenders, interleaved in rounds like benchmarks/run.py, reported per wall-clock second and per
CPU-second of the process, each as a ratio to `fit`:
  ours      the Trainer's compiled loop, unchanged;
  no_cond   ours without `tf.cond(finite, apply, skip)`: gradients always applied (the finite
            check, loss scaler, metrics and counters stay), i.e. the cost of the skip guarantee;
  bare      tape, gradients, apply_gradients, global step += 1: the floor of a custom loop;
  no_forensics  ours with numerics.forensics_first = forensics_every = 0: the compiled loop's
            per-step check whether to stop for a forensic replay is gone;
  no_guard  ours with precision.max_consecutive_skips = 0: the collapse guard's per-step check
            is gone;
  no_state_check  ours without the finite check of the state an applied update wrote
            (trainer/step/state_check.py);
  fit       Keras `model.fit`, steps_per_execution = steps_per_loop; with --jit,
            `compile(jit_compile=True)`: its whole train step, the optimizer's update included,
            one XLA program (ours compiles each replica's gradients, not the update: the update
            waits in cross-replica context for every replica's finite flag).
A diagnostic, not a test: every contender but `ours` and `fit` drops something the trainer keeps.
"""

from __future__ import annotations

import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from absl import app, flags, logging  # noqa: E402

from benchmarks import results as results_page  # noqa: E402  (--results_dir)

from benchmarks import run as bench_run  # noqa: E402  (its flags: --rounds, --data_root, ...)

_MODEL = flags.DEFINE_string('model', 'mnist_cnn', 'Module in models/.')
_POLICY = flags.DEFINE_string('policy', 'float32', 'Precision policy.')
_LOSS_SCALE = flags.DEFINE_string(
  'loss_scale', 'auto', "config.precision.loss_scale: 'auto', 'none', 'dynamic' or a number."
)
_CONFIG = flags.DEFINE_string(
  'config', '', "A file in configs/ (e.g. nanogpt_cpu): its model and settings; '' = --model's."
)
_JIT = flags.DEFINE_bool('jit', False, 'config.train.jit_compile=true for every contender.')
_SPL = flags.DEFINE_integer('steps_per_loop', 10, 'Steps per compiled call.')
_CALLS = flags.DEFINE_integer('calls', 4, 'Compiled calls per contender per round.')
_CONTENDERS = flags.DEFINE_list(
  'contenders',
  ['ours', 'no_cond', 'bare', 'no_forensics', 'no_guard', 'no_state_check', 'fit'],
  'Contenders to race (fit is always included: the ratios are to it).',
)


def ablated(trainer_class, keep_checks: bool):
  """`trainer_class` whose step, built on the public TrainStep contract, drops the skip cond
  (keep_checks=True: the finite check, loss scaler and counters stay) or is a bare custom-loop
  step (keep_checks=False: tape, gradients, apply, global step + 1)."""
  import tensorflow as tf
  from trainer import TrainStep

  SUM = tf.distribute.ReduceOp.SUM

  class NoCondStep(TrainStep):
    def step(self, iterator):
      outputs, grads, nonfinite, _ = self.strategy.run(self.replica_step, args=(next(iterator),))
      flags = self.groups_finite(nonfinite)
      outputs = {k: self.strategy.reduce(SUM, v, axis=None) for k, v in outputs.items()}
      self.strategy.run(lambda g: self.apply_group(0, g), args=(grads,))  # always: no cond
      skipped = tf.cast(tf.logical_not(tf.reduce_all(tf.stack(flags))), tf.int64)
      self.skipped_steps.assign_add(skipped)
      self.end_step(flags)
      return self.with_counters(outputs, skipped, tf.math.is_finite(outputs['loss']))

  class BareStep(TrainStep):
    def step(self, iterator):
      def replica(batch):
        with tf.GradientTape() as tape:
          per_example_loss, _ = self.compute_loss(batch, training=True)
          loss = tf.nn.compute_average_loss(
            per_example_loss, global_batch_size=self.global_batch_size
          )
        grads = tape.gradient(loss, self.variables)
        self.optimizer.apply_gradients(zip(grads, self.variables))

      self.strategy.run(replica, args=(next(iterator),))
      self.global_step.assign_add(1)
      return {'steps': tf.constant(1.0)}

  step_class = NoCondStep if keep_checks else BareStep

  class Ablated(trainer_class):
    def build_train_step(self):
      return step_class(self)

  return Ablated


def without_state_check(trainer_class):
  """`trainer_class` whose loop skips StateCheck.after_call (traced: nothing is read)."""

  class NoStateCheck(trainer_class):
    def build_train_step(self):
      step = super().build_train_step()
      step.state_check.after_call = lambda groups, first, end, applied: None
      return step

  return NoStateCheck


def measure_and_print(argv):
  del argv
  logging.set_verbosity(logging.ERROR)
  import models
  from benchmarks import child
  from benchmarks.contenders import KerasFit, Ours

  rounds = bench_run._ROUNDS.value or 6
  if _CONFIG.value:
    base = child.config_file(_CONFIG.value, _POLICY.value, bench_run._DATA_ROOT.value)
  else:
    base = bench_run.model_config(_MODEL.value)
  trainer_class = models.get_trainer_class(base.model)
  spl = _SPL.value
  config = bench_run.variant(
    base, policy=_POLICY.value, loss_scale=_LOSS_SCALE.value, steps_per_loop=spl, jit=_JIT.value
  )
  no_forensics = config.copy_and_resolve_references()
  no_forensics.numerics.forensics_first = no_forensics.numerics.forensics_every = 0
  no_guard = config.copy_and_resolve_references()
  no_guard.precision.max_consecutive_skips = 0
  contenders = {
    'ours': (trainer_class, config),
    'no_cond': (ablated(trainer_class, keep_checks=True), config),
    'bare': (ablated(trainer_class, keep_checks=False), config),
    'no_forensics': (trainer_class, no_forensics),
    'no_guard': (trainer_class, no_guard),
    'no_state_check': (without_state_check(trainer_class), config),
    'fit': (trainer_class, config),
  }
  contenders = {k: v for k, v in contenders.items() if k in _CONTENDERS.value or k == 'fit'}
  built = {}
  for name, (cls, cfg) in contenders.items():
    contender = (KerasFit if name == 'fit' else Ours)(cls, cfg)
    contender.timed(spl)
    contender.timed(spl * _CALLS.value)
    built[name] = contender
  wall = {k: [] for k in built}
  cpu = {k: [] for k in built}
  steps = spl * _CALLS.value
  for r in range(rounds):
    for name, contender in bench_run.in_round_order(list(built.items()), r):
      w, c = contender.timed(steps)
      wall[name].append(steps / w)
      cpu[name].append(steps / c)
  print(
    f'{_CONFIG.value or config.model} {_POLICY.value} steps_per_loop={spl}, XLA '
    f'{"on" if _JIT.value else "off"}, {rounds} rounds; '
    'median (min-max) of per-round ratios to fit'
  )
  print(f'{"":12} {"steps/s":>8} {"/ fit (wall)":>20} {"steps/CPU-s":>12} {"/ fit (CPU)":>20}')
  for name in built:
    row = [name, f'{statistics.median(wall[name]):8.1f}']
    for rates in (wall, cpu):
      ratios = [a / b for a, b in zip(rates[name], rates['fit'])]
      text = f'{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})'
      if rates is cpu:
        row.append(f'{statistics.median(cpu[name]):12.1f}')
      row.append(f'{text:>20}')
    print(f'{row[0]:12} {row[1]} {row[2]} {row[3]} {row[4]}')
  for contender in built.values():
    contender.close()


def main(argv):
  """What it prints is also docs/results/ablate_step.md (benchmarks/results.py)."""
  with results_page.recording('ablate_step', markdown=False):
    measure_and_print(argv)
  results_page.exit_now()  # the page is written


if __name__ == '__main__':
  app.run(main)
