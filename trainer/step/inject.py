"""Fault injection for tests and drills (config.debug.inject_nonfinite_*): a step's gradients
made non-finite, on every replica or on one, inside the compiled step."""

from __future__ import annotations

from collections.abc import Collection

import tensorflow as tf


def nonfinite(
  grads: list, step: tf.Tensor, *, every: int = 0, steps: Collection[int] = (), replica: int = -1
) -> list:
  """`grads` with the first non-None gradient multiplied by inf at global `step` when it is a
  positive multiple of `every` or one of `steps`, on replica `replica` only when >= 0 (replica
  context)."""
  hit = tf.constant(False)
  if every:
    hit = tf.logical_or(hit, tf.logical_and(step > 0, step % every == 0))
  if steps:
    hit = tf.logical_or(hit, tf.reduce_any(tf.equal(step, steps)))
  if replica >= 0:
    replica_id = tf.distribute.get_replica_context().replica_id_in_sync_group
    hit = tf.logical_and(hit, tf.equal(replica_id, replica))
  poison = tf.where(hit, float('inf'), 1.0)
  first = next(i for i, g in enumerate(grads) if g is not None)
  return [g * poison if i == first else g for i, g in enumerate(grads)]
