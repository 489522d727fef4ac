"""What the numerics statistics cost: one probe against the training steps of one interval.

  python benchmarks/numerics_cost.py --models=mnist_cnn,mnist_mlp --policy=mixed_float16

For each model, in one process: the trainer's compiled loop (`run_steps`, steps_per_loop steps a
call) and the statistics probe (`trainer.runner.numerics` at log steps: a forward and backward
pass in the compute dtypes and, under a low-precision policy, one in float32 (the reference for
what is flushed), and the host reads of its results), timed alternately in rounds after a
warm-up. The cost at
interval `every` is probe time / (every x step time): what the statistics add to the training
time when on. Off, the train step is not changed, so the cost is zero by construction.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from absl import app, flags, logging  # noqa: E402

from benchmarks import results as results_page  # noqa: E402  (--results_dir)

from benchmarks import run as bench_run  # noqa: E402  (its flags: --rounds, --data_root, ...)

_POLICY = flags.DEFINE_string('policy', 'mixed_float16', 'Precision policy.')
_EVERY = flags.DEFINE_integer('every', 1000, 'numerics.every whose cost is reported.')
_SPL = flags.DEFINE_integer('steps_per_loop', 100, 'Steps per compiled call.')


def measure(name: str, rounds: int) -> dict:
  import models
  from benchmarks.contenders import Ours
  from trainer.insight.numerics import Probe

  config = bench_run.variant(
    bench_run.model_config(name), policy=_POLICY.value, steps_per_loop=_SPL.value
  )
  ours = Ours(models.get_trainer_class(name), config)
  probe = Probe(ours.trainer)
  probe.measure()  # traces
  ours.timed(_SPL.value)  # warm-up
  step_seconds, probe_seconds = [], []
  for _ in range(rounds):
    wall, _ = ours.timed(_SPL.value)
    step_seconds.append(wall / _SPL.value)
    start = time.perf_counter()
    probe.measure()
    probe_seconds.append(time.perf_counter() - start)
  ours.close()
  step, cost = statistics.median(step_seconds), statistics.median(probe_seconds)
  return {
    'step_ms': 1e3 * step,
    'probe_ms': 1e3 * cost,
    'probe_in_steps': cost / step,
    'cost': cost / (_EVERY.value * step),
  }


def measure_and_print(argv):
  del argv
  logging.set_verbosity(logging.ERROR)
  names = bench_run._MODELS.value or ['mnist_cnn', 'mnist_mlp']
  rounds = bench_run._ROUNDS.value or 5
  print(f'policy {_POLICY.value}, numerics.every={_EVERY.value}, {rounds} rounds (medians)')
  print(f'{"model":16} {"step ms":>8} {"probe ms":>9} {"probe/step":>11} {"cost":>8}')
  for name in names:
    r = measure(name, rounds)
    print(
      f'{name:16} {r["step_ms"]:8.2f} {r["probe_ms"]:9.2f} {r["probe_in_steps"]:11.2f} '
      f'{100 * r["cost"]:7.2f}%'
    )


def main(argv):
  """What it prints is also docs/results/numerics_cost.md (benchmarks/results.py)."""
  with results_page.recording('numerics_cost', markdown=False):
    measure_and_print(argv)


if __name__ == '__main__':
  app.run(main)
