"""The collapse guard: counts skipped steps in a row and names the variables that overflowed.

A skipped step (non-finite gradients on any replica; no update applied) is routine under dynamic
loss scaling; step after step of them is not: the weights stop moving. The guard lives inside the
compiled loop:

  * on the skip branch of the step's `tf.cond` only, it checks each gradient for non-finite
    values, keeps the per-variable result and `tf.print`s one line naming the step and, per
    update group skipped (named when the step has several, with the groups applied): the cause
    (non-finite gradients, gradients the debug injection poisoned, or a non-finite learning
    rate), its loss scale and the first non-finite variables; a finite step pays only the reset
    of one scalar counter;
  * only the first skip of a run of skips in a row gets that line; the later ones are counted,
    and the host logs one line for them at its next progress line (`unprinted`): a run that skips
    every step logs one line per log interval, and the first skip's cause stays in the log;
  * it counts bad steps in a row (skipped, or applied with a non-finite loss); at
    `max_consecutive_skips` (> 0) the loop stops early, and `check()` (host side, between
    compiled calls) raises `CollapseError` naming the step, the loss scale and those variables.
    The trainer checks before saving, so the last checkpoint before the storm is left as it was.
"""

from __future__ import annotations

import sys
from typing import Any

import tensorflow as tf

from trainer.errors import CollapseError
from trainer.nn.paths import variable_name
from trainer.step.apply_or_skip import SKIP_SCOPE
from trainer.distribute.strategy import state_variable

SUM = tf.distribute.ReduceOp.SUM
SHOWN = 3  # variables named per line


def _group_text(prefix: str, bad, size: int, scale, injected, injection: str) -> tf.Tensor:
  """One skipped group's part of the skip line: its cause, loss scale and first variables with
  non-finite gradients (`bad`, of `size`). A group skips for non-finite gradients or a
  non-finite learning rate: with every gradient finite, the rate was the cause."""
  found = tf.size(bad)
  cause = tf.where(
    found > 0,
    tf.where(injected, f'non-finite gradients injected by {injection}', 'non-finite gradients'),
    'non-finite learning rate',
  )
  detail = tf.where(
    found > 0,
    tf.strings.join(
      [
        ', non-finite in ',
        tf.strings.as_string(found),
        f' of {size} variables, first: ',
        tf.strings.reduce_join(bad[:SHOWN], separator=', '),
      ]
    ),
    '',
  )
  scale = tf.strings.as_string(scale, shortest=True)
  return tf.strings.join([prefix, cause, ', no update): loss scale ', scale, detail])


def _nonfinite_per_variable(grads):
  """Replica context: int32 [num variables], 1 where that gradient has a non-finite value."""
  return tf.stack(
    [
      tf.constant(0)
      if g is None
      else tf.cast(tf.logical_not(tf.reduce_all(tf.math.is_finite(g))), tf.int32)
      for g in grads
    ]
  )


class SkipGuard(tf.Module):
  """Create it under the strategy's scope. `record` and `count` run in cross-replica context
  inside the compiled step; `check` runs on the host between calls. `groups`: the step's update
  groups as (name, number of variables), in the order of `variables`."""

  def __init__(
    self,
    *,
    strategy: tf.distribute.Strategy,
    variables,
    max_consecutive_skips: int = 0,
    groups: list[tuple[str, int]] | None = None,
  ):
    super().__init__(name='skip_guard')
    self.strategy = strategy
    self.names = [variable_name(v) for v in variables]
    self.groups = list(groups or [('0', len(self.names))])
    self.max_consecutive_skips = int(max_consecutive_skips)
    self.consecutive = state_variable(0, tf.int64, 'consecutive_skips')
    # Replicas on which each variable's gradient was non-finite, at the last skipped step.
    self.nonfinite = state_variable(
      tf.zeros([len(self.names)], tf.int32), tf.int32, 'nonfinite_per_variable'
    )
    self.last_scale = state_variable(0.0, tf.float32, 'scale_at_last_skip')  # for forensics
    # The step of the last skip (a skip right after it gets no line of its own), and the skips
    # without a line since the host last read them: [count, first step, last step].
    self.last_skip = state_variable(tf.constant(-2, tf.int64), tf.int64, 'last_skipped_step')
    self.unprinted_skips = state_variable(tf.zeros([3], tf.int64), tf.int64, 'unprinted_skips')
    # config.debug.inject_nonfinite_*, when on (trainer/step/inject.py sets it): the skip line
    # names an injected skip as such.
    self.injection: Any = None

  def record(self, grads, step, flags, scales) -> None:
    """Skip branch only: which gradients are non-finite, kept, and the skip line printed.
    `flags`: each group's finite flag (False: skipped); `scales`: each group's loss scale."""
    per_replica = self.strategy.run(_nonfinite_per_variable, args=(grads,))
    counts = self.strategy.reduce(SUM, per_replica, axis=None)
    self.nonfinite.assign(counts)
    skipped = tf.logical_not(tf.stack(flags))
    scales = tf.stack([tf.cast(s, tf.float32) for s in scales])
    first = tf.argmax(tf.cast(skipped, tf.int32))  # the first skipped group: the replay's scale
    self.last_scale.assign(tf.gather(scales, first))
    step = tf.cast(step, tf.int64)
    after_skip = tf.equal(step, self.last_skip + 1)  # read before the assign (program order)
    self.last_skip.assign(step)
    tf.cond(
      after_skip,
      lambda: self._count_unprinted(step),
      lambda: self._print(self._line(step, counts, skipped, scales)),
    )

  @staticmethod
  def _print(line) -> tf.Tensor:
    # Its own branch function: the scope again keeps the print a skip-only op by name
    # (benchmarks/run.py checks that no host op runs on a finite step).
    with tf.name_scope(SKIP_SCOPE):
      tf.print(line, output_stream=sys.stderr)
    return tf.constant(True)

  def _count_unprinted(self, step) -> tf.Tensor:
    count, first = self.unprinted_skips[0], self.unprinted_skips[1]
    self.unprinted_skips.assign(tf.stack([count + 1, tf.where(count > 0, first, step), step]))
    return tf.constant(True)

  def unprinted(self) -> str | None:
    """Host side, at a progress line: one line for the skips printed without their own line
    since the last call (each came right after a skip, whose line was printed), or None; they
    are counted from zero again."""
    count, first, last = (int(v) for v in self.unprinted_skips.numpy())
    if count == 0:
      return None
    self.unprinted_skips.assign(tf.zeros([3], tf.int64))
    runs = 'in a row' if count == last - first + 1 else 'each right after another skip'
    return (
      f'steps {first}-{last}: {count} more skipped steps {runs}, without a line each (the '
      'first skip of a run has its line above); loss scale '
      f'{float(self.last_scale.numpy()):g} at the last skip'
    )

  def _line(self, step, counts, skipped, scales) -> tf.Tensor:
    """'skipped step N (<cause>, no update): loss scale S, non-finite in K of M variables,
    first: ...'; with several groups, that part per skipped group ('group <name> (...') and the
    groups applied. The cause: non-finite gradients (or injected ones), or, when the group's
    gradients were all finite, its non-finite learning rate."""
    several = len(self.groups) > 1
    injected = self._injected(step)
    by = getattr(self.injection, 'key', 'config.debug')
    parts, start = [], 0
    for index, (name, size) in enumerate(self.groups):
      names = tf.constant(self.names[start : start + size], tf.string, shape=[size])
      bad = tf.boolean_mask(names, counts[start : start + size] > 0)
      start += size
      prefix = f'group {name} (' if several else '('
      parts.append(_group_text(prefix, bad, size, scales[index], injected[index], by))
    body = tf.strings.reduce_join(tf.boolean_mask(tf.stack(parts), skipped), separator='; ')
    applied = tf.constant('')
    if several:
      names = tf.boolean_mask(tf.constant([n for n, _ in self.groups]), tf.logical_not(skipped))
      applied = tf.where(
        tf.size(names) > 0,
        tf.strings.join(['; applied: group ', tf.strings.reduce_join(names, separator=', ')]),
        '',
      )
    where = ', ' if several else ' '
    return tf.strings.join(['skipped step ', tf.strings.as_string(step), where, body, applied])

  def _injected(self, step) -> list:
    """Per group, whether the debug injection poisoned its gradients at `step` (it poisons the
    first gradient: trainer/step/inject.py)."""
    if self.injection is None:
      return [tf.constant(False)] * len(self.groups)
    hit, variable, start, found = self.injection.hit(step), self.injection.index or 0, 0, []
    for _, size in self.groups:
      found.append(tf.logical_and(hit, start <= variable < start + size))
      start += size
    return found

  def count(self, good) -> None:
    """Every step: the number of bad steps in a row (skipped, or with a non-finite loss)."""
    self.consecutive.assign(tf.where(good, tf.zeros_like(self.consecutive), self.consecutive + 1))

  def collapsed(self):
    """A bool tensor for the loop to stop on (Python False when the guard is off)."""
    if self.max_consecutive_skips <= 0:
      return False
    return self.consecutive >= self.max_consecutive_skips

  def nonfinite_names(self) -> list[str]:
    """Host side: the variables whose gradients were non-finite at the last skipped step."""
    return [n for n, c in zip(self.names, self.nonfinite.numpy()) if c > 0]

  def check(self, *, step: int, scaler, checkpoint: str | None, healthy: str | None = None) -> None:
    """Host side, between compiled calls: raises CollapseError once the limit is reached.
    `scaler` (the LossScaler) is read only then; `healthy` names the last healthy checkpoint
    ('last healthy: ckpt-100, step 100, loss 0.29')."""
    limit = self.max_consecutive_skips
    if limit <= 0:
      return
    run = int(self.consecutive.numpy())
    if run < limit:
      return
    bad = self.nonfinite_names()
    shown = ', '.join(bad[:SHOWN]) + (f' and {len(bad) - SHOWN} more' if len(bad) > SHOWN else '')
    where = (
      f'first non-finite gradients in: {shown}'
      if shown
      else 'the gradients were finite but the loss was not'
    )
    kept = (
      f'The newest checkpoint, {checkpoint}, is finite (checked when saved)'
      if checkpoint
      else 'No checkpoint was written yet'
    ) + (f'; {healthy}' if healthy else '')
    # From step 0 no update was ever applied: the learning rate cannot be the cause. A static
    # scale multiplies every gradient; one too large overflows them from the first step.
    value = float(scaler.scale.numpy())
    too_large = scaler.mode == 'static' and value > 1 and bool(shown)  # gradients overflowed
    scaled = (
      f'the static loss scale {value:g} (config.precision.loss_scale) overflows the '
      "gradients (lower it, or set it to 'dynamic'), or "
      if too_large
      else ''
    )
    advice = (
      f'No update was ever applied, so the learning rate is not the cause: {scaled}the '
      'model or the data is non-finite from the start; the forensic lines above (or '
      '--mode=diagnose) name the layer or the batch, and --advise suggests float32 layers'
      if step == run
      else 'Lower config.optimizer.learning_rate, check the input data'
      + (
        f', lower the static loss scale {value:g} (config.precision.loss_scale)'
        if too_large
        else ''
      )
    )
    raise CollapseError(
      f'training collapsed at step {step}: {run} steps in a row (steps {step - run} to '
      f'{step - 1}) were skipped for non-finite gradients or had a non-finite loss; loss scale '
      f'{value:g}; {where}. {kept}. {advice}, or raise '
      f'config.precision.max_consecutive_skips (now {limit}; 0 turns the guard off).'
    )
