"""Divergence: a training loss that left where it has been, beyond its own noise, in one line.

A learning rate far too large (say 50 for SGD on MNIST) drives the loss to 1e11 while every
gradient stays finite: nothing is skipped, no guard fires, and the run ends at chance accuracy.
`DivergenceMonitor` watches the logged training loss (the mean over a log interval) and names the
step, the loss and the learning rate when it diverged. A logged loss is noisy (at batch 1 logged
every step, one example's: 0.001 for an easy digit, 7 for a misread one), so the rule reads a
smoothed loss and a threshold from the run's own spread, in log units (losses compare by ratios):

  level   the median of the last n logged losses; n grows with the spread until the level's
          noise is about 5 %, from 3 (logged every 100 steps at batch 128) to 512 (one example)
  spread  sigma of one logged log-loss, from the median absolute difference of consecutive
          ones (blind to the downward trend); the level's noise is 1.25 sigma / sqrt(n)
  margin  4 x the level's noise

  diverged when the loss is not finite (no step of the interval had a finite loss), or over
  factor x the loss at the run's first weights (the `start` loss): one logged loss plus 8 of its
  sigmas, or the median of the last 3; or the level is over factor x its best level (the lowest
  level plus its margin then), or over 2 x the first loss (worse than untrained), each plus the
  margin; or the network stopped learning (the level back within a quarter of its best gain of
  the first loss, plus the margin); or, since a divergence, the level has not come back below the
  first loss (by 5 %, or twice the margin). A recovery (`update` at an earlier step) ends that.

The default factor of 10 is far outside a healthy run at any batch size: 0 alarms on MNIST runs
at batch 1, 2 and 4 logged every step (tests/insight/test_divergence.py replays
tests/fixtures/losses/; still 0 with a quarter of the margin or a factor of 3). The level rules
wait for 9 logged losses, and the best level is taken only from windows as long as the spread
asks for. A resumed run (`start(..., resumed=True)`) has no untrained loss: only the non-finite
rule, the best-level rule and one logged loss over factor**6 x the resumed weights' loss, at
least 1 (a blow-up to 1e36). A loss at or below zero (a log-density) is judged only on being
finite; `factor` 0 turns the monitor off. `verdict` says whether a finished run ended diverged.
Pure Python: no TensorFlow, reusable by any loop.
"""

from __future__ import annotations

import math
import statistics

SHORT = 3  # logged losses in the hard rule against the first loss (and the shortest window)
LONGEST = 512  # logged losses in the longest window
LEVEL_NOISE = 0.05  # the window grows until the level's noise is about this (log units)
MARGIN = 4.0  # level noises added to each threshold
SPIKE = 8.0  # one logged loss: sigmas of one value added to its threshold
RESUMED = 6  # a resumed run: one logged loss factor**6 x the resumed weights' loss diverged
SPREAD_FROM = 8  # logged losses before the spread is measured and the level judged
WORSE = math.log(2)  # a level over 2x the loss at the first weights (plus the margin): diverged
MIN_GAIN = 0.05  # the stall rule: the best level was at least this far below the first loss
ADVICE = (
  '; lower config.optimizer.learning_rate, add warm-up (config.optimizer.warmup_steps) or '
  'clipping (config.optimizer.clip_norm)'
)


class DivergenceMonitor:
  """`update(step, loss, learning_rate)` -> a warning line when the loss diverged, else None."""

  def __init__(self, factor: float = 10.0):
    self.factor = float(factor)
    self.first: float | None = None  # the loss at the run's first weights
    self.logs: list[float] = []  # the logged log-losses (finite, positive), newest last
    self.steps: list[int] = []  # their steps
    self.best = math.inf  # the lowest level plus its margin so far (log units)
    self.positive = True  # every loss so far > 0: the ratio rules apply
    self.resumed = False  # no untrained loss (start): only the rules against the best level
    self.start_loss: float | None = None  # the loss at the first weights, trained or not
    self.diverged_at: int | None = None  # the step of the first divergence line
    self.since: int | None = None  # the step of a divergence not recovered from (level_rule)
    self.line: str | None = None  # the latest update's line

  def start(self, loss: float, resumed: bool = False) -> None:
    """The loss at the run's first weights (before any step of this run). `resumed`: they are
    trained weights (a resumed run, a warm start), whose loss on one batch is no untrained
    loss (at batch 1 one example's: 1e-6 to 7 on the recorded CNN run): the rules against an
    untrained loss are off, one logged loss factor**RESUMED x above it (at least 1) still
    diverged, and the rules against the run's best level stay."""
    self.resumed = self.resumed or resumed
    if math.isfinite(loss):
      self.start_loss = loss
      self.first = None if self.resumed else loss
      self.positive = self.positive and loss > 0

  def update(self, step: int, loss: float, learning_rate: float | None = None) -> str | None:
    """One logged loss (a NaN mean: no step of the interval had a finite loss). A step at or
    before the latest one means the run went back to a (healthy) checkpoint, a recovery: the
    losses logged from that step on are forgotten, and so is the divergence."""
    if self.factor <= 0:
      return None
    rate = f', learning rate {learning_rate:.4g}' if learning_rate is not None else ''
    if self.steps and self.steps[-1] >= step:
      while self.steps and self.steps[-1] >= step:
        self.steps.pop(), self.logs.pop()
      self.since = None
    if not math.isfinite(loss):
      return self._said(step, f'loss {loss}{rate}')
    if self.first is None and not self.resumed:  # no `start`: the first loss stands for it
      self.start(loss)
    if loss <= 0 or not self.positive:  # a ratio means nothing at or below 0
      self.positive = False
      return self._said(step, None)
    self.logs = (self.logs + [math.log(loss)])[-2 * LONGEST :]
    self.steps = (self.steps + [step])[-2 * LONGEST :]
    sigma = spread(self.logs[:-1][-LONGEST:])  # the newest loss is not its own yardstick
    what = (self.spike(sigma) if self.start_loss else None) or self.level_rule(sigma)
    joint = ' ' if what and what.startswith('is ') else '; '  # about this loss, or the level
    return self._said(step, what and f'loss {loss:.4g}{joint}{what}{rate}')

  def spike(self, sigma: float) -> str | None:
    """The rules against the first loss that need no level: one logged loss, or 3."""
    assert self.start_loss is not None
    # Resumed: at least 1, for a loss of one example at trained weights can be 1e-6 (a mean
    # loss, or a sum, is rarely below 1 where its blow-up matters).
    start = max(self.start_loss, 1.0) if self.resumed else self.start_loss
    first, factor = math.log(start), math.log(self.factor)
    weights = 'resumed' if self.resumed else 'first'
    times = RESUMED if self.resumed else 1
    if self.logs[-1] > first + times * factor + SPIKE * sigma:
      noise = f' (the threshold: {self.factor**times:g}x, times {math.exp(SPIKE * sigma):.3g}'
      noise += ' for its noise)'
      return (
        f'is {math.exp(self.logs[-1] - first):.3g}x the loss at the {weights} weights '
        f'{start:.4g}' + (noise if sigma or self.resumed else '')
      )
    if self.resumed:
      return None
    short = statistics.median(self.logs[-SHORT:])
    if short > first + factor:
      return (
        f'the median of the last {min(SHORT, len(self.logs))} logged, {math.exp(short):.4g}, '
        f'is {math.exp(short - first):.3g}x the loss at the first weights {self.first:.4g}'
      )
    return None

  def level_rule(self, sigma: float) -> str | None:
    """The rules on the level (the module docstring), said, or None."""
    level, n, noise, full = self.level(sigma)
    margin, factor = MARGIN * noise, math.log(self.factor)
    first = math.log(self.first) if self.first else math.inf  # resumed: no rule against it
    best = min(self.best, first)
    smoothed = f'the median of the last {n} logged, {math.exp(level):.4g},'
    if len(self.logs) > SPREAD_FROM:  # before, no spread (of the earlier losses), no judgement
      if full:  # a window shorter than the spread asks for is no best (nor its low)
        self.best = min(self.best, level + margin)
      if level > best + factor + margin:
        return (
          f'{smoothed} is {math.exp(level - best):.3g}x its best {math.exp(best):.4g} (the '
          f'threshold: {self.factor:g}x, times {math.exp(margin):.3g} for its own noise)'
        )
      if level > first + WORSE + margin:
        return (
          f'{smoothed} is {math.exp(level - first):.3g}x the loss at the first weights '
          f'{self.first:.4g}: worse than the untrained network'
        )
      gain = first - best
      if gain > max(2 * margin, MIN_GAIN) and level > first - gain / 4 + margin:
        return (
          f'{smoothed} is back near the loss at the first weights {self.first:.4g} after '
          f'reaching {math.exp(best):.4g}: the network stopped learning'
        )
    if self.since is not None and level > first - max(MIN_GAIN, 2 * margin):
      return (
        f'{smoothed} has not come back below the loss at the first weights {self.first:.4g} '
        f'since the divergence at step {self.since}: the network has not learned again'
      )
    self.since = None
    return None

  def level(self, sigma: float) -> tuple[float, int, float, bool]:
    """(the level, its window's length, its noise, whether the window is as long as the spread
    asks) for a spread `sigma`: the module docstring."""
    wanted = min(max(math.ceil((1.25 * sigma / LEVEL_NOISE) ** 2), SHORT), LONGEST)
    n = min(wanted, len(self.logs))
    return statistics.median(self.logs[-n:]), n, 1.25 * sigma / math.sqrt(n), n == wanted

  def _said(self, step: int, what: str | None) -> str | None:
    if what is None:
      self.line = None
      return None
    self.diverged_at = step if self.diverged_at is None else self.diverged_at
    self.since = step if self.since is None else self.since
    self.line = (
      f'divergence at step {step}: {what}'
      + ADVICE
      + f'; config.numerics.divergence_factor sets the threshold (now {self.factor:g}; 0 = off)'
    )
    return self.line

  def verdict(self, final_loss: float | None = None) -> str | None:
    """At the end of a run: why it ended diverged (its latest logged loss broke the rule, or it
    diverged at some step and `final_loss`, the final eval's, is not clearly below the loss at
    the first weights: it ended at chance), or None."""
    if self.line is not None:
      return f'the run ended diverged ({self.line.split(ADVICE)[0]})'
    if self.diverged_at is None or self.first is None or final_loss is None:
      return None
    if not self.positive or final_loss < 0.9 * self.first:
      return None
    return (
      f'the run diverged at step {self.diverged_at} and ended no better than its first weights '
      f'(final eval loss {final_loss:.4g}, {self.first:.4g} at the first weights)'
    )


def spread(logs: list[float]) -> float:
  """sigma of one value of `logs` from the median absolute difference of consecutive values
  (a trend adds little to a difference); 0 before SPREAD_FROM values."""
  if len(logs) < SPREAD_FROM:
    return 0.0
  differences = [abs(b - a) for a, b in zip(logs, logs[1:])]
  return 1.4826 * statistics.median(differences) / math.sqrt(2)
