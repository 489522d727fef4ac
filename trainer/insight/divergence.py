"""Divergence: a training loss far above where it has been, said in one line.

A learning rate far too large (say 50 for SGD on MNIST) drives the loss to 1e11 while every
gradient stays finite: no step is skipped, no guard fires, and the run ends at chance accuracy
with exit 0. `DivergenceMonitor` watches the logged training loss (the mean over a log interval)
and names the step, the loss and the learning rate when it leaves its running minimum far
behind:

  diverged when  loss > factor x max(running minimum, floor),  or the loss is not finite,

where the running minimum is over the losses seen so far (the `start` loss included: the loss at
the run's first weights) and `floor` = `start` loss / factor, so a loss that has become tiny
(0.001 on an easy task) does not make an ordinary 0.01 look like divergence: with the default
factor of 10 and a classifier starting near ln(10) = 2.3, the loss must pass 2.3 (chance) and
10x its best. No shipped config comes near (their logged losses only fall after the first
log). A loss that can be zero or negative (a log-density) is never called divergent by this
ratio; `factor` 0 turns it off. Pure Python: no TensorFlow, reusable by any loop.
"""

from __future__ import annotations

import math


class DivergenceMonitor:
  """`update(step, loss, learning_rate)` -> a warning line when the loss diverged, else None."""

  def __init__(self, factor: float = 10.0):
    self.factor = float(factor)
    self.minimum = math.inf
    self.floor = 0.0

  def start(self, loss: float) -> None:
    """The loss at the run's first weights (before any step of this run): the first minimum."""
    if math.isfinite(loss):
      self.minimum = min(self.minimum, loss)
      self.floor = max(loss, 0.0) / self.factor if self.factor > 0 else 0.0

  def reference(self) -> float:
    return max(self.minimum, self.floor)

  def update(self, step: int, loss: float, learning_rate: float | None = None) -> str | None:
    """One logged loss (a NaN mean: no step of the interval had a finite loss)."""
    if self.factor <= 0:
      return None
    rate = f', learning rate {learning_rate:.4g}' if learning_rate is not None else ''
    advice = (
      '; lower config.optimizer.learning_rate, add warm-up (config.optimizer.'
      'warmup_steps) or clipping (config.optimizer.clip_norm)'
    )
    if not math.isfinite(loss):
      return f'divergence at step {step}: loss {loss}{rate}' + advice
    if not math.isfinite(self.minimum):  # the first loss seen: nothing to compare with yet
      self.start(loss)
      return None
    reference, minimum = self.reference(), self.minimum
    self.minimum = min(self.minimum, loss)
    if minimum <= 0 or loss <= self.factor * reference:  # a ratio means nothing at or below 0
      return None
    what = (
      f'its running minimum {reference:.4g}'
      if reference == minimum
      else f'{reference:.4g} (1/{self.factor:g} of its first loss; running minimum {minimum:.4g})'
    )
    return (
      f'divergence at step {step}: loss {loss:.4g} is {loss / reference:.3g}x {what}{rate}'
      + advice
      + f'; config.numerics.divergence_factor sets the threshold (now '
      f'{self.factor:g}; 0 = off)'
    )
