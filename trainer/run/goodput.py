"""Goodput: the share of a run's wall time spent in train steps that counted.

`Clock` splits the wall time from the Trainer's construction to the end of `train()` into
start-up (model, datasets, restoring, until the first compiled call starts), compilation (the
first call's time beyond what its steps take at the later calls' rate; a process that made one
call only counts it all as train steps, and its line says so), train steps, evals, checkpoint
saves, work redone (steps run again after a recovery restored an earlier checkpoint, at the
measured step rate), steps skipped for non-finite gradients (at that rate too) and the rest
(progress lines, TensorBoard, forensics outside the compiled call). The end of a run logs one
line (`line`) and writes `goodput/<kind>` TensorBoard scalars (shares of the wall time). Steps a
restarted process redoes (after its newest checkpoint) happened in the previous process: unseen.
"""

from __future__ import annotations

import contextlib
import time

KINDS = ('train', 'startup', 'compile', 'eval', 'checkpoint', 'redone', 'skipped', 'other')


class Clock:
  def __init__(self, started: float | None = None):
    self.started = time.perf_counter() if started is None else started
    self.spent = dict.fromkeys(KINDS, 0.0)
    self.first_call: tuple[float, int] | None = None  # (seconds, steps) of the first call
    self.later = [0.0, 0]  # seconds, steps of the later calls
    self.redone_steps = 0
    self.skipped_steps = 0  # this process's steps skipped for non-finite gradients
    self.skipped_from: int | None = None  # the run's skip counter when this process began
    self._first_start: float | None = None

  @contextlib.contextmanager
  def timing(self, kind: str):
    start = time.perf_counter()
    try:
      yield
    finally:
      self.spent[kind] += time.perf_counter() - start

  def steps(self, seconds: float, n: int, start: float) -> None:
    """A compiled call of `n` steps that took `seconds` and began at `start`."""
    if self.first_call is None:
      self.first_call = (seconds, n)
      self._first_start = start
    else:
      self.later[0] += seconds
      self.later[1] += n

  def count_skipped(self, total: int) -> None:
    """The run's skip counter now (`skipped_from` holds it at this process's start; a recovery
    to an older checkpoint can set the counter back below it: then no skips are counted)."""
    self.skipped_steps = max(0, total - (total if self.skipped_from is None else self.skipped_from))

  def redone(self, n: int) -> None:
    self.redone_steps += max(0, int(n))

  def shares(self) -> dict[str, float]:
    """{kind: share of the wall time so far}, summing to 1."""
    wall = max(time.perf_counter() - self.started, 1e-9)
    spent = dict(self.spent)
    if self.first_call is not None:
      spent['startup'] += (self._first_start or self.started) - self.started
      first, n = self.first_call
      rate = self.later[0] / self.later[1] if self.later[1] else None
      compile_time = max(0.0, first - n * rate) if rate is not None else 0.0
      spent['compile'] += compile_time
      train = first - compile_time + self.later[0]
      per_step = rate if rate is not None else first / max(n, 1)
      redone = min(train, self.redone_steps * per_step)
      skipped = min(train - redone, self.skipped_steps * per_step)
      spent['redone'] += redone
      spent['skipped'] += skipped
      spent['train'] += train - redone - skipped
    else:
      spent['startup'] += wall - sum(spent.values())
    spent['other'] = max(0.0, wall - sum(v for k, v in spent.items() if k != 'other'))
    return {k: v / wall for k, v in spent.items()}

  @property
  def one_call(self) -> bool:
    """Whether this process made one compiled call only: with no later call to give the step
    rate, its compilation cannot be told apart from its steps and is counted in 'train'."""
    return self.first_call is not None and not self.later[1]

  def line(self, shares: dict[str, float]) -> str:
    kinds = [k for k in KINDS[1:] if not (k == 'compile' and self.one_call)]
    rest = ', '.join(f'{k} {shares[k]:.0%}' for k in kinds)
    train = 'in train steps' + (
      ' and their compilation (one compiled call: no later one to tell them apart)'
      if self.one_call
      else ''
    )
    return f'goodput {shares["train"]:.0%} of the wall time {train}; {rest}'
