"""The health test of a checkpoint, and which one is the last healthy one.

A save is only ever made of a finite state (Runner.check_finite_state). A finite state can still
be useless: one huge update (a learning rate of 1e38) leaves finite weights that make every
later step non-finite, and the saves after it keep those weights. A checkpoint is *healthy*
when, besides finite, the run was well at its step:

  * the last step before the save applied its update (no skipped step in a row at the save:
    the collapse guard's counter is 0), and
  * the training loss of the latest progress line is finite and has not diverged (the one rule
    of divergence: trainer/insight/divergence.py's DivergenceMonitor, which the runner asks at
    every progress line).

The workdir keeps the
newest healthy checkpoint out of rotation (trainer/run/workdir.py) and records it in
checkpoints/healthy.json, so that a collapse message can name it and a recovery
(`train.recover_tries`) can restore it.
"""

from __future__ import annotations

import math


class Health:
  """The losses the progress lines logged: `observe` each, `healthy` at a save."""

  def __init__(self):
    self.loss: float | None = None  # the latest logged training loss
    self.bad = False  # the latest logged loss diverged

  def observe(self, loss: float | None, diverged: bool) -> None:
    """Records a progress line's loss and whether the divergence monitor called it diverged (a
    non-finite loss always is)."""
    if loss is None:
      return
    self.loss = float(loss)
    self.bad = bool(diverged) or not math.isfinite(self.loss)

  def healthy(self, consecutive_skips: int) -> bool:
    """Whether a save now passes the health test (the module docstring). A step whose outputs
    have no 'loss' (a custom step) is judged by its skips alone."""
    return consecutive_skips == 0 and not self.bad


def describe(record: dict | None) -> str:
  """'last healthy: ckpt-100, step 100, loss 0.29' (or that there is none)."""
  if not record:
    return 'no healthy checkpoint yet'
  loss = record.get('loss')
  return f'last healthy: {record["checkpoint"]}, step {record["step"]}' + (
    f', loss {loss:.4g}' if loss is not None else ''
  )
