"""Fault injection for tests and drills (config.debug.inject_nonfinite_*): a step's gradients
made non-finite, on every replica or on one, inside the compiled step.

The injection is not part of the step: `install` wraps the step's `compute_gradients` from
outside (what it returns, the first gradient multiplied by inf at the chosen global steps) and
tells the step's collapse guard, whose skip line then names the injection as the cause.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from trainer.step import user_code
from trainer.steps_text import steps as parse_steps


class Injection:
  """Poisons the first non-None gradient at global `step` when it is a positive multiple of
  `every` or one of `steps`, on replica `replica` only when >= 0."""

  def __init__(self, global_step, *, every: int = 0, steps=(), replica: int = -1, key: str = ''):
    self.global_step = global_step
    self.every, self.steps, self.replica = int(every), tuple(steps), int(replica)
    self.key = key or 'config.debug'  # the config key that asked for it, for the skip line
    self.index: int | None = None  # the gradient it poisons (known once traced)

  @classmethod
  def from_config(cls, debug, global_step) -> Injection | None:
    """The injection config.debug asks for; None when it asks for none."""
    every, steps = int(debug.inject_nonfinite_every), parse_steps(debug.inject_nonfinite_steps)
    if not (every or steps):
      return None
    key = 'config.debug.' + ('inject_nonfinite_every' if every else 'inject_nonfinite_steps')
    return cls(
      global_step, every=every, steps=steps, replica=debug.inject_nonfinite_replica, key=key
    )

  def hit(self, step) -> tf.Tensor:
    """Whether global `step` is one the injection poisons (on some replica); any context."""
    hit = tf.constant(False)
    if self.every:
      hit = tf.logical_or(hit, tf.logical_and(step > 0, step % self.every == 0))
    if self.steps:
      hit = tf.logical_or(hit, tf.reduce_any(tf.equal(step, self.steps)))
    return hit

  def poison(self, grads) -> list:
    """Replica context: `grads` with the first non-None gradient multiplied by inf when this
    replica's step is hit, else unchanged."""
    hit = self.hit(self.global_step.read_value())
    if self.replica >= 0:
      replica_id = tf.distribute.get_replica_context().replica_id_in_sync_group
      hit = tf.logical_and(hit, tf.equal(replica_id, self.replica))
    poison = tf.where(hit, float('inf'), 1.0)
    self.index = next(i for i, g in enumerate(grads) if g is not None)
    return [g * poison if i == self.index else g for i, g in enumerate(grads)]

  def wrap(self, compute_gradients):
    """`compute_gradients` with its gradients poisoned (a result that is not a pair is left to
    the step's contract check, which names what is wrong with it)."""

    def injected(batch):
      result = user_code.converted(compute_gradients)(batch)
      if not (isinstance(result, (tuple, list)) and len(result) == 2):
        return result
      outputs, grads = result
      return outputs, self.poison(list(grads))

    return injected


def install(step: Any, debug) -> Injection | None:
  """Wraps `step.compute_gradients` with config.debug's injection (when it asks for one) and
  tells the step's guard; returns the injection."""
  injection = Injection.from_config(debug, step.global_step)
  if injection is not None:
    step.compute_gradients = injection.wrap(step.compute_gradients)
    step.state.guard.injection = injection
  return injection
