"""Grappler on or off: what TensorFlow's graph optimizer costs the train loop's first call, and
what it buys its steps, the figures behind config.train.grappler='auto' (trainer/step/
grappler.py).

  python -m benchmarks.grappler --configs=nanogpt_cpu:float32:300,mnist:float32:300 --rounds=2

Per config file, policy and step count, `--rounds` rounds of one fresh process with
train.grappler=true and one with false, in turn: the Trainer is built as launch.py builds it,
then its train loop (trainer/step/loop.py) is called for 1 step (the first call: tracing,
grappler's passes when on, XLA's compilation or its cache, the runtime's preparation), 20 steps
(warm-up), then the given number of steps, timed (wall and this process's CPU time); then the
process's peak resident memory (VmHWM: the model, the data, the compiled loop's buffers). The XLA
compile cache is the user's (both sides read it; the first process of a config may fill it).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from absl import app, flags, logging  # noqa: E402

from benchmarks import child  # noqa: E402
from benchmarks import results as results_page  # noqa: E402  (--results_dir)

_CONFIGS = flags.DEFINE_list(
  'configs',
  [
    'nanogpt_cpu:float32:300',
    'nanogpt_cpu:mixed_bfloat16:200',
    'mnist:float32:300',
    'shakespeare:mixed_bfloat16:30',
  ],
  'config file (in configs/):policy:timed steps, one measurement each.',
)
_ROUNDS = flags.DEFINE_integer('rounds', 2, 'Rounds of (on, off) per config, in turn.')
_DATA_ROOT = flags.DEFINE_string(
  'data_root',
  os.path.join(ROOT, '..', 'shared', 'data'),
  'Folder holding mnist/ and tinyshakespeare/.',
)
_CHILD = flags.DEFINE_string('child', None, 'Internal: config:policy:steps:on|off to measure.')


def measure(name: str, policy: str, steps: int, grappler: str) -> dict:
  import models

  config = child.config_file(name, policy, _DATA_ROOT.value)
  config.train.grappler = grappler
  with tempfile.TemporaryDirectory() as workdir:
    trainer = models.get_trainer_class(config.model)(config, workdir)
    runner = trainer.runner
    distributed = trainer.strategy.experimental_distribute_dataset(trainer.datasets.train)
    iterator = iter(distributed)
    start = time.perf_counter()
    runner.train_loop.run(iterator, 1)
    first = time.perf_counter() - start
    runner.train_loop.run(iterator, 20)
    start, cpu = time.perf_counter(), time.process_time()
    runner.train_loop.run(iterator, steps)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
  return {
    'peak_rss_mib': _peak_rss_mib(),
    'config': name,
    'policy': policy,
    'grappler': grappler,
    'steps': steps,
    'first_call_s': first,
    'ms_per_step': 1000 * wall / steps,
    'cpu_ms_per_step': 1000 * cpu / steps,
  }


def _peak_rss_mib() -> float:
  """This process's peak resident memory so far (VmHWM), MiB."""
  with open('/proc/self/status') as f:
    line = next(ln for ln in f if ln.startswith('VmHWM:'))
  return int(line.split()[1]) / 1024


def _child(spec: str, grappler: str) -> dict:
  """One measurement in a fresh process (child.run: its last JSON line; one retry on failure)."""
  command = [
    sys.executable,
    os.path.abspath(__file__),
    f'--child={spec}:{grappler}',
    f'--data_root={_DATA_ROOT.value}',
  ]
  return child.run(command)[0]


def _figure(x: float) -> str:
  """`x` to three significant digits, without an exponent (4.42, 46.9, 1178)."""
  return f'{x:.{max(0, 2 - math.floor(math.log10(abs(x))))}f}' if x else '0'


def table(results: list[dict]) -> str:
  """One row per config and setting: the first calls and steady figures of each run, in round
  order, then off / on of the medians."""
  lines = [
    '| config, policy | grappler | first call s | steady ms/step | CPU-ms/step | peak RSS MiB | '
    'off / on: first call, ms/step, CPU-ms/step, peak RSS |',
    '|---|---|---|---|---|---|---|',
  ]
  keys = ('first_call_s', 'ms_per_step', 'cpu_ms_per_step', 'peak_rss_mib')
  by_config: dict = {}
  for r in results:
    by_config.setdefault((r['config'], r['policy'], r['steps']), {}).setdefault(
      r['grappler'], []
    ).append(r)
  for (name, policy, steps), runs in by_config.items():
    medians = {g: {k: statistics.median(r[k] for r in rs) for k in keys} for g, rs in runs.items()}
    for grappler in ('true', 'false'):
      rs = runs.get(grappler, [])
      cells = [', '.join(_figure(r[k]) for r in rs) for k in keys]
      ratio = ''
      if grappler == 'false' and {'true', 'false'} <= set(medians):
        ratio = ', '.join(f'{medians["false"][k] / medians["true"][k]:.2f}' for k in keys)
      lines.append(
        f'| {name}, {policy} ({steps} steps timed) | {grappler} | {" | ".join(cells)} | {ratio} |'
      )
  return '\n'.join(lines)


def main(argv):
  del argv
  logging.set_verbosity(logging.ERROR)
  if _CHILD.value:
    name, policy, steps, grappler = _CHILD.value.split(':')
    print(json.dumps(measure(name, policy, int(steps), grappler)), flush=True)
    results_page.exit_now()
  results = []
  with results_page.recording('grappler', markdown=True):
    for spec in _CONFIGS.value:
      for _ in range(_ROUNDS.value):
        for grappler in ('true', 'false'):
          results.append(_child(spec, grappler))
          r = results[-1]
          print(
            f'{spec} grappler={grappler}: first call {r["first_call_s"]:.2f} s, '
            f'{r["ms_per_step"]:.1f} ms/step',
            file=sys.stderr,
            flush=True,
          )
    print(
      'Each row: the runs of one setting, in round order (one fresh process each, the two '
      'settings in turn). First call: the train loop called for one step (tracing, '
      "grappler's passes when on, XLA's compilation or its compile cache, the first run); "
      'steady: a timed call of the given steps after 20 warm-up steps, wall and CPU time of '
      "the process; peak RSS: the process's peak resident memory after them (VmHWM).\n"
    )
    print(table(results))
  results_page.exit_now()


if __name__ == '__main__':
  app.run(main)
