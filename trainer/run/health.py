"""The health test of a checkpoint, and which one is the last healthy one.

A save is only ever made of a finite state (Runner.save checks it). A finite state can still
be useless: one huge update (a learning rate of 1e38) leaves finite weights that make every
later step non-finite, and a learning rate of 20 leaves a network at chance whose loss never
moves again (its running minimum, from before, looks fine). A checkpoint is *healthy* (DEFINITION)
when, besides finite:

  * the last step before the save applied its update (no skipped step in a row at the save:
    the collapse guard's counter is 0),
  * the training loss of the latest progress line is finite and the divergence monitor
    (trainer/insight/divergence.py, asked at every progress line) did not call it diverged:
    neither far above its best nor back near the loss at the run's first weights after having
    learned (a network that stopped learning), and
  * the latest eval, when there was one, is finite and has not fallen back near the loss at the
    run's first weights: it keeps at least three quarters of its best eval's gain over that loss
    (in log units; `observe_eval`).

The workdir keeps the newest healthy checkpoint out of rotation (trainer/run/workdir.py) and
records it in checkpoints/healthy.json, so that a collapse message can name it and a recovery
(`train.recover_tries`) can restore it.
"""

from __future__ import annotations

import math

from trainer.errors import DivergenceError

DEFINITION = (
  'healthy = finite, its last step applied, and its loss (train and eval) finite, not diverged '
  'and not back near the loss at the first weights'
)


class Health:
  """The losses the progress lines and evals logged: `observe` each, `healthy` at a save."""

  def __init__(self):
    self.loss: float | None = None  # the latest logged training loss
    self.train_bad = False  # the latest logged loss diverged
    self.eval_bad = False  # the latest eval is not finite or lost its gain (observe_eval)
    self.best_eval = math.inf

  @property
  def bad(self) -> bool:
    return self.train_bad or self.eval_bad

  @bad.setter
  def bad(self, value: bool) -> None:  # a recovery restored a healthy checkpoint: False
    self.train_bad = self.eval_bad = bool(value)

  def observe(self, loss: float | None, diverged: bool) -> None:
    """Records a progress line's loss and whether the divergence monitor called it diverged (a
    non-finite loss always is)."""
    if loss is None:
      return
    self.loss = float(loss)
    self.train_bad = bool(diverged) or not math.isfinite(self.loss)

  def observe_eval(self, loss: float, first: float | None) -> None:
    """Records an eval's loss; `first` is the loss at the run's first weights (the divergence
    monitor's `first`; None: only finiteness is judged)."""
    loss = float(loss)
    self.eval_bad = not math.isfinite(loss) or lost_gain(loss, self.best_eval, first)
    if math.isfinite(loss):
      self.best_eval = min(self.best_eval, loss)

  def healthy(self, consecutive_skips: int) -> bool:
    """Whether a save now passes the health test (the module docstring). A step whose outputs
    have no 'loss' (a custom step) is judged by its skips and evals."""
    return consecutive_skips == 0 and not self.bad


def lost_gain(loss: float, best: float, first: float | None) -> bool:
  """Whether `loss` has fallen back near `first`: it keeps less than three quarters of the gain
  `best` made over `first` (log units), and that gain was real (over 5 %). Positive losses only."""
  if first is None or not (0 < best < first) or loss <= 0:
    return False
  gain = math.log(first) - math.log(best)
  return gain > 0.05 and math.log(loss) > math.log(first) - gain / 4


def check_end(monitor, health: Health, final_loss: float, step: int, record: dict | None) -> None:
  """At the end of a finished run: DivergenceError (exit status 3, one line) when it ended
  diverged (the divergence monitor's `verdict`: its latest loss diverged, or it diverged at some
  step and ended no better than its first weights) or its final eval fell back near the loss at
  the first weights (`observe_eval`)."""
  why = monitor.verdict(final_loss)
  if why is None and health.eval_bad and math.isfinite(final_loss):
    why = (
      f'the final eval loss {final_loss:.4g} is back near the loss at the first weights '
      f'{monitor.first:.4g} (best eval {health.best_eval:.4g}): the network stopped learning'
    )
  if why is not None:
    raise DivergenceError(
      f'step {step}: {why}; the checkpoint of step {step} is saved, {describe(record)}; lower '
      'config.optimizer.learning_rate or add warm-up (config.optimizer.warmup_steps)'
    )


def describe(record: dict | None) -> str:
  """'last healthy: ckpt-100, step 100, loss 0.29' (or that there is none)."""
  if not record:
    return 'no healthy checkpoint yet'
  loss = record.get('loss')
  return f'last healthy: {record["checkpoint"]}, step {record["step"]}' + (
    f', loss {loss:.4g}' if loss is not None else ''
  )
