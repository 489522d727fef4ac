"""Does mixed precision pay for this model? `--race` trains the user's own config for N steps under
float32 and each mixed policy, XLA off and on, and prints per setting its steps/s, step working
memory and loss, and which to use.

Every setting is the config with `precision.policy` and `train.jit_compile` set, built as a
Trainer of its own (in a temporary folder, removed after) in this process, from the same seed, so
all see the same batches. The first call of each (a fifth of the N steps) traces and compiles and
is not timed; then the settings take turns, one call each per round, so that a load on the
machine falls on all of them alike; steps/s is the median of a setting's rounds. Step working
memory is what a step needs beyond the weights and the optimizer state (activations, gradients,
workspace): the peak of TensorFlow's CPU allocator during the setting's first timed call over
what it held just before (`working_mib`).
The loss is the mean train loss of the last call's steps, as the progress line shows it.
"""

from __future__ import annotations

import functools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ml_collections
import tensorflow as tf
from absl import logging

from trainer.errors import UserError
from trainer.insight import files
from trainer.run import progress

POLICIES = ('float32', 'mixed_bfloat16', 'mixed_float16')
# A setting whose loss is further than this from float32's is not recommended, however fast.
LOSS_TOLERANCE = 0.05  # relative


@dataclass
class Row:
  policy: str
  xla: bool
  steps_per_sec: float = 0.0
  memory_mib: float | None = None
  loss: float = float('nan')
  error: str = ''

  @property
  def label(self) -> str:
    return f'{self.policy}, XLA {"on" if self.xla else "off"}'


def _setting(config, policy: str, xla: bool, call: int) -> ml_collections.ConfigDict:
  """The config under `policy` and XLA, logging every `call` steps; its length (so its learning
  rate schedule) as the user's run has it: the race trains the run's first N steps."""
  c = ml_collections.ConfigDict(config.to_dict())
  c.precision.policy, c.train.jit_compile = policy, 'true' if xla else 'false'
  c.train.steps_per_loop = c.train.log_every = call
  c.numerics.every = c.numerics.forensics_first = c.numerics.forensics_every = 0
  return c


def working_mib(call: Callable[[], Any]) -> float | None:
  """Runs `call()`; returns the step working memory it needed in MiB: the peak of the tensor
  bytes TensorFlow's CPU allocator held during it over what it held just before (the weights,
  the optimizer state and every other live tensor), or None where the allocator keeps no
  statistics (its BFC allocator does, the default with oneDNN's kernels on)."""
  try:
    tf.config.experimental.reset_memory_stats('CPU:0')
    before = tf.config.experimental.get_memory_info('CPU:0')['current']
  except ValueError:
    call()
    return None
  call()
  return (tf.config.experimental.get_memory_info('CPU:0')['peak'] - before) / 2**20


def race(trainer_class, config, steps: int = 50, rounds: int = 4) -> list[Row]:
  """Trains each setting `steps` steps as the module docstring says; one Row per setting."""
  if steps < 2:  # else the timed call would trace and compile
    raise UserError(f'--race={steps}: race at least 2 steps (the first call is untimed)')
  first = max(1, steps // 5)
  rounds = max(1, min(rounds, steps - first))
  call = max(1, (steps - first) // rounds)
  first = steps - call * rounds  # the untimed call takes the remainder
  rows: list[Row] = []
  runs: list[tuple[Row, Any, list[float], list[float]]] = []
  folder = tempfile.mkdtemp(prefix='mpt-race-')
  try:
    for policy in POLICIES:
      for xla in (False, True):
        row = Row(policy, xla)
        rows.append(row)
        c = _setting(config, policy, xla, call)
        try:
          trainer = trainer_class(c, os.path.join(folder, f'{policy}-xla{int(xla)}'))
          losses: list[float] = []
          trainer.runner.actions.append(
            lambda e, losses=losses: e.kind == 'log' and losses.append(e.metrics['loss'])
          )
          trainer.runner.train_steps(first)  # traced and compiled: not timed
          runs.append((row, trainer, losses, []))
        except Exception as e:  # pylint: disable=broad-except  (say it in the row, race on)
          if not runs:  # float32 without XLA failed: the config's own mistake, said once
            raise
          row.error = f'{type(e).__name__}: {(str(e).splitlines() or [""])[0][:160]}'
    for r in range(rounds):
      for row, trainer, losses, rates in runs:
        start = time.perf_counter()
        if r == 0:
          row.memory_mib = working_mib(functools.partial(trainer.runner.train_steps, call))
        else:
          trainer.runner.train_steps(call)
        rates.append(call / (time.perf_counter() - start))
    for row, _, losses, rates in runs:
      row.steps_per_sec, row.loss = statistics.median(rates), losses[-1]
  finally:
    shutil.rmtree(folder, ignore_errors=True)
  return rows


def choice(rows: list[Row]) -> Row | None:
  """The fastest setting whose loss is within LOSS_TOLERANCE of float32's (XLA off)."""
  base = rows[0].loss
  fine = [
    r for r in rows if not r.error and abs(r.loss - base) <= LOSS_TOLERANCE * max(abs(base), 1e-12)
  ]
  return max(fine, key=lambda r: r.steps_per_sec, default=None)


def markdown(rows: list[Row], steps: int) -> str:
  base = rows[0]
  lines = [
    f'# race: {steps} steps per setting (steps/s: the median of the timed rounds; memory: '
    'the step working memory beyond weights and optimizer state; loss: the last logged)',
    '',
    '| setting | steps/s | x float32 | step memory MiB | x float32 | loss |',
    '|---|---|---|---|---|---|',
  ]
  for r in rows:
    if r.error:
      lines.append(f'| {r.label} | {r.error} | | | | |')
      continue
    speed = r.steps_per_sec / base.steps_per_sec if base.steps_per_sec else float('nan')
    mem = f'{r.memory_mib:.0f}' if r.memory_mib is not None else 'n/a'
    mem_x = (
      f'{r.memory_mib / base.memory_mib:.2f}'
      if r.memory_mib is not None and base.memory_mib
      else 'n/a'
    )
    lines.append(
      f'| {r.label} | {progress.rate_text(r.steps_per_sec)} | {speed:.2f} | {mem} | '
      f'{mem_x} | {r.loss:.4f} |'
    )
  best = choice(rows)
  lines.append('')
  if best is None:
    lines.append('Use: nothing measured (every setting failed or float32 did).')
  else:
    lines.append(
      f'Use: --config.precision.policy={best.policy} --config.train.jit_compile='
      f'{"true" if best.xla else "false"} (the fastest whose loss is within '
      f"{LOSS_TOLERANCE:.0%} of float32's; {best.steps_per_sec / base.steps_per_sec:.2f}x "
      "float32's steps/s). One run's timing: a machine under load skews it; race again "
      'where you will train.'
    )
  return '\n'.join(lines) + '\n'


def report(trainer_class, config, workdir: str, *, steps: int = 50) -> str:
  """`race` as markdown, also written to <workdir>/race.md."""
  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.WARNING)  # the settings' own progress lines would interleave
  try:
    rows = race(trainer_class, config, steps)
  finally:
    logging.set_verbosity(verbosity)
  text = markdown(rows, steps)
  files.folder(os.path.dirname(os.path.abspath(workdir)), workdir, '--race')
  files.write(os.path.join(workdir, 'race.md'), text, '--race')  # never through a link
  return text
