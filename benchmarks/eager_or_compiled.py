"""Eager or compiled: what the numerics probe and the checkpoint's finite check cost each way,
the figures behind their limits in trainer/step/eager_then_compiled.py.

  python benchmarks/eager_or_compiled.py --configs=nanogpt_cpu:mixed_bfloat16,mnist:mixed_float16

Per config file and policy, in one fresh process each (first calls are what is measured): the
probe (trainer/insight/numerics.py) run eagerly `--eager_calls` times, then compiled (its first
call traces and optimizes it) and twice more; the finite check over the model's and optimizer's
floating variables (trainer/run/checkpoints.py) the same way. "Break-even" is the number of
calls after which compiling would have been cheaper: 1 + (compiled first - eager first) /
(eager later - compiled later); "never" when eager calls are not slower than compiled ones.
"""

from __future__ import annotations

import json
import os
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
    'nanogpt_cpu:mixed_bfloat16',
    'mnist:mixed_float16',
    'mnist_mlp:float32',
    'shakespeare:mixed_bfloat16',
  ],
  'config file (in configs/):policy pairs.',
)
_DATA_ROOT = flags.DEFINE_string(
  'data_root',
  os.path.join(ROOT, '..', 'shared', 'data'),
  'Folder holding mnist/ and tinyshakespeare/.',
)
_EAGER_CALLS = flags.DEFINE_integer('eager_calls', 4, 'Eager calls timed per function.')
_CHILD = flags.DEFINE_string('child', None, 'Internal: the config:policy this process measures.')


def _timed(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def _costs(eager, compiled, calls: int) -> dict:
  eager_times = [_timed(eager) for _ in range(calls)]
  compiled_first = _timed(compiled)
  compiled_later = min(_timed(compiled) for _ in range(2))
  eager_later = sum(eager_times[1:]) / max(1, calls - 1)
  saved = eager_later - compiled_later
  return {
    'eager_first': eager_times[0],
    'eager_later': eager_later,
    'compiled_first': compiled_first,
    'compiled_later': compiled_later,
    'break_even': (1 + (compiled_first - eager_times[0]) / saved) if saved > 0 else None,
  }


def measure(name: str, policy: str) -> dict:
  import models
  from trainer import config as config_lib
  from trainer.insight import numerics
  from trainer.run import checkpoints

  config = config_lib.validate(child.config_file(name, policy, _DATA_ROOT.value))
  with tempfile.TemporaryDirectory() as workdir:
    trainer = models.get_trainer_class(config.model)(config, workdir)
    probe = numerics.Probe(trainer)
    batch = probe.next_batch()
    probe_costs = _costs(
      lambda: probe._fn.fn(batch)[0].numpy(),
      lambda: probe._fn.compiled(batch)[0].numpy(),
      _EAGER_CALLS.value,
    )
    variables = [
      v
      for v in checkpoints.variables({'model': trainer.model, 'optimizer': trainer.optimizer})
      if v.dtype.is_floating
    ]
    check = checkpoints._all_finite
    check_costs = _costs(
      lambda: bool(check.fn(variables)), lambda: bool(check.compiled(variables)), _EAGER_CALLS.value
    )
  return {
    'config': name,
    'policy': policy,
    'variables': len(variables),
    'probe': probe_costs,
    'check': check_costs,
  }


def _row(r: dict) -> str:
  def cell(c, unit=1.0, digits=3):
    even = 'never' if c['break_even'] is None else f'{c["break_even"]:.1f}'
    return (
      f'{c["eager_first"] * unit:.{digits}f} / {c["eager_later"] * unit:.{digits}f} | '
      f'{c["compiled_first"] * unit:.{digits}f} / {c["compiled_later"] * unit:.{digits}f} | '
      f'{even}'
    )

  return (
    f'| {r["config"]}, {r["policy"]} | {cell(r["probe"])} | {r["variables"]} | '
    f'{cell(r["check"], 1000, 1)} |'
  )


def measure_and_print(argv):
  del argv
  logging.set_verbosity(logging.ERROR)
  if _CHILD.value:
    print(json.dumps(measure(*_CHILD.value.split(':'))))
    return
  print(
    '| config, policy | probe eager s, first / later | probe compiled s, first / later | '
    'break-even calls | variables | check eager ms, first / later | check compiled ms, '
    'first / later | break-even calls |'
  )
  print('|---|---|---|---|---|---|---|---|')
  for pair in _CONFIGS.value:
    command = [
      sys.executable,
      os.path.abspath(__file__),
      f'--child={pair}',
      f'--data_root={_DATA_ROOT.value}',
      f'--eager_calls={_EAGER_CALLS.value}',
    ]
    result, _, _ = child.run(command)  # its last JSON line; one retry on failure
    print(_row(result), flush=True)


def main(argv):
  """What it prints is also docs/results/eager_or_compiled.md (benchmarks/results.py)."""
  if _CHILD.value:  # one config's measurement, printed for the parent
    measure_and_print(argv)
  else:
    with results_page.recording('eager_or_compiled', markdown=True):
      measure_and_print(argv)
  results_page.exit_now()  # the child's line is printed, the parent's page written


if __name__ == '__main__':
  app.run(main)
