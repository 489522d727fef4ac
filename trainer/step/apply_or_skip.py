"""Apply or skip: a loss-scaled update's decision, shared by the Trainer's step (train_step.py)
and the public optimizer (loss_scale_optimizer.py, `trainer.mixed_precision.LossScaleOptimizer`).

Per step, for update groups (an optimizer, its variables, its loss scaler):
  1. per replica, `nonfinite_counts`: 0 or 1 per group, whether any of this replica's gradients
     of that group has a non-finite element;
  2. cross-replica, `groups_finite`: the counts summed over EVERY replica, one flag per group,
     False when any replica counted one or the group's learning rate is not finite;
  3. cross-replica, `apply_or_skip`: one `tf.cond` on all flags: the apply (which enters replica
     context itself, by `strategy.run` or `call_for_each_replica`) or the skip; a skipped group
     runs no optimizer op, so its weights, slots and `iterations` are bit-identical;
  4. cross-replica, `loss_scale.update_scalers`: each loss scaler moves once, by its flags.
The branch lives in cross-replica context because a `tf.cond` whose branch calls `merge_call`
(every Keras optimizer's apply does) fails inside `strategy.run`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from trainer.step.loss_scale import all_finite

SUM = tf.distribute.ReduceOp.SUM
SKIP_SCOPE = 'skipped_step_only'  # name scope of the skip branch (benchmarks/run.py looks for it)


def nonfinite_counts(parts: Sequence[Sequence[Any]]) -> tf.Tensor:
  """Per replica: [groups] int32, 1 where a gradient of that group (one list per group in
  `parts`) has a non-finite element on this replica, else 0."""
  return tf.stack([tf.cast(tf.logical_not(all_finite(part)), tf.int32) for part in parts])


def groups_finite(strategy: tf.distribute.Strategy, counts: Any, optimizers: Sequence[Any]):
  """Cross-replica: one flag per group (per optimizer of `optimizers`), True when no replica
  counted a non-finite gradient of that group (`counts`: the PerReplica `nonfinite_counts`)
  and the optimizer's learning rate for this step is finite (so nothing applied after the
  check can be non-finite)."""
  nonfinite = tf.reshape(strategy.reduce(SUM, counts, axis=None), [-1])
  flags = []
  for index, optimizer in enumerate(optimizers):
    rate = tf.cast(optimizer.learning_rate, tf.float32)  # the rate this update uses
    flags.append(tf.logical_and(tf.equal(nonfinite[index], 0), tf.math.is_finite(rate)))
  return flags


def apply_or_skip(
  flags: Sequence[tf.Tensor],
  apply_groups: Callable[[Sequence[int]], None],
  on_skip: Callable[[], None],
) -> tf.Tensor:
  """Cross-replica: `apply_groups(range(len(flags)))` when every flag is set; else the groups
  whose flag is set still apply (each under its own cond, traced only with several groups) and
  `on_skip()` runs in the `SKIP_SCOPE` name scope. Returns 1 when any group skipped, else 0
  (int64)."""
  flags = list(flags)

  def applied(indices: Sequence[int]) -> tf.Tensor:
    apply_groups(indices)
    return tf.constant(0, tf.int64)

  def skip() -> tf.Tensor:
    # A finite step pays the one cond below whatever the number of groups; with one group
    # nothing is traced here but the skip itself.
    partial = enumerate(flags) if len(flags) > 1 else ()
    for index, flag in partial:
      tf.cond(flag, lambda i=index: applied([i]), lambda: tf.constant(1, tf.int64))
    with tf.name_scope(SKIP_SCOPE):  # ops here run on skipped steps only
      on_skip()
      return tf.constant(1, tf.int64)

  every = range(len(flags))
  return tf.cond(tf.reduce_all(tf.stack(flags)), lambda: applied(every), skip)
