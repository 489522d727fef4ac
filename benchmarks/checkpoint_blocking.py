"""How long a checkpoint save blocks the step loop: synchronous vs train.async_checkpoint.

  python benchmarks/checkpoint_blocking.py --data_dir=../shared/data/tinyshakespeare \
      [--rounds=5] [--steps_between=10] [--set=model_config.d_model=256]

Method. One Transformer LM trainer (configs/shakespeare.py, with --set overrides) is built, its
run folder opened, its step compiled and one save of each mode made (tracing). Then --rounds
interleaved rounds; each round trains --steps_between steps and saves synchronously, then
trains --steps_between steps and saves with train.async_checkpoint (the same trainer, the key
switched), the two in alternating order. "Blocked" is
the time `runner.save()` takes in the step loop: the finite check, waiting for the previous
background write (none left after --steps_between steps unless the write is slower than them),
and the copy of the variables (async) or the whole write (sync). After the last round the
pending background write is waited for. Reported: the median blocked time per save of each mode
and their ratio (the target of issue 23: async <= 20 % of sync), and the checkpoint size. The
machine may be shared: the modes alternate round by round so they share its load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
  from benchmarks import results as results_page

  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    '--data_dir', default=os.path.join(ROOT, '..', 'shared', 'data', 'tinyshakespeare')
  )
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--steps_between', type=int, default=10)
  parser.add_argument('--set', action='append', default=[], help='key=value config override')
  parser.add_argument(
    '--results_dir', default=results_page.DEFAULT_DIR, help="results page folder; '' = none"
  )
  args = parser.parse_args()
  # What it prints is also the results page docs/results/checkpoint_blocking.md.
  with results_page.recording('checkpoint_blocking', markdown=False, results_dir=args.results_dir):
    measure_and_print(args)


def measure_and_print(args) -> None:
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  import ast

  from absl import logging

  logging.set_verbosity(logging.WARNING)
  import models
  from trainer import config as config_lib

  config = config_lib.load_file(os.path.join(ROOT, 'configs', 'shakespeare.py'))
  config.data.dir = args.data_dir
  config.train.steps = 10**6
  config.train.steps_per_loop = args.steps_between
  config.train.log_every = args.steps_between
  config.train.checkpoint_every = args.steps_between * 10**5
  config.train.max_to_keep = 2
  config.optimizer.warmup_steps = 0
  for item in args.set:
    key, value = item.split('=', 1)
    try:
      value = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      pass
    config_lib.set_dotted(config, key, value)
  workdir = tempfile.mkdtemp(prefix='checkpoint_blocking-')
  trainer = models.get_trainer_class(config.model)(config, workdir)
  runner = trainer.runner
  runner.restore()
  iterator = iter(trainer.strategy.experimental_distribute_dataset(trainer.datasets.train))
  runner.run_steps(iterator, args.steps_between)  # compiles
  for asynchronous in (False, True):  # the first save of each mode traces its functions
    trainer.config.train.async_checkpoint = asynchronous
    runner.run_steps(iterator, args.steps_between)
    runner.save()
  blocked = {False: [], True: []}
  for r in range(args.rounds):
    for asynchronous in (False, True) if r % 2 == 0 else (True, False):
      trainer.config.train.async_checkpoint = asynchronous  # the Workdir reads the same config
      runner.run_steps(iterator, args.steps_between)
      start = time.perf_counter()
      runner.save()
      blocked[asynchronous].append(time.perf_counter() - start)
  runner.workdir.sync()
  size = sum(
    os.path.getsize(os.path.join(runner.workdir.checkpoint_dir, f))
    for f in os.listdir(runner.workdir.checkpoint_dir)
    if f.startswith(os.path.basename(runner.workdir.latest_checkpoint) + '.')
  )
  sync_ms = statistics.median(blocked[False]) * 1e3
  async_ms = statistics.median(blocked[True]) * 1e3
  params = sum(int(v.numpy().size) for v in trainer.model.weights)
  print(
    f'Transformer LM, {params:,} parameters, checkpoint {size / 2**20:.1f} MiB, '
    f'{args.rounds} rounds, {args.steps_between} steps between saves'
  )
  print(
    f'blocked per save: sync median {sync_ms:.1f} ms '
    f'({", ".join(f"{t * 1e3:.0f}" for t in blocked[False])}); '
    f'async median {async_ms:.1f} ms ({", ".join(f"{t * 1e3:.0f}" for t in blocked[True])})'
  )
  print(f'async / sync: {async_ms / sync_ms:.0%}')
  runner.workdir.close()


if __name__ == '__main__':
  main()
