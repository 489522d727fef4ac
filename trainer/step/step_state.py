"""The step's state across steps, one object: the skip counter, the collapse guard (trainer/step/
skip_guard.py) and the check of the state the updates wrote (trainer/step/state_check.py).

The train step owns it (`TrainStep.state`) and writes it on every step. The compiled loop
(trainer/step/loop.py) reads it in the graph: `begin_call`, `collapsed` after each step,
`end_call` (the state check, then the counters the call returns). The runner reads it on the
host: `check` after each call (the errors), `skipped`, the guard's lines. The checkpoint reads
`checkpoint_items()`: a tf.train.Checkpoint keys a variable by the item's name, not by the object
holding it, so 'skipped_steps' and 'consecutive_skips' restore from checkpoints written before
this object existed (tests/fixtures/legacy_tiny_run).
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import tensorflow as tf

from trainer.distribute.strategy import state_variable
from trainer.step.skip_guard import SkipGuard
from trainer.step.state_check import StateCheck


def group_names(groups) -> list[str]:
  """Each group's name: its own, or its index ('0', '1', ...)."""
  return [group.name or str(index) for index, group in enumerate(groups)]


class StepState:
  """Create it under the strategy's scope (it owns variables). `global_step`: the trainer's (read
  here, advanced by the step); `groups()`: the step's update groups, whose weights and optimizer
  variables the state check reads."""

  def __init__(
    self, *, strategy, global_step, variables, groups: Callable[[], list], max_consecutive_skips
  ):
    self.global_step = global_step
    self._groups = groups
    self.skipped_steps = state_variable(0, tf.int64, 'skipped_steps')  # cumulative
    names = group_names(groups())
    self.guard = SkipGuard(
      strategy=strategy,
      variables=variables,
      max_consecutive_skips=max_consecutive_skips,
      groups=[(name, len(group.variables)) for name, group in zip(names, groups())],
    )
    self.state_check = StateCheck()  # the loop checks the state its updates wrote, per call
    # Callables traced into the skip branch only (no cost on a finite step): the compiled loop
    # adds forensics' batch keeping here (trainer/step/loop.py).
    self.on_skip: list[Callable[[], Any]] = []

  def checkpoint_items(self) -> dict[str, tf.Variable]:
    """What every checkpoint holds of it, under the names checkpoints have always used."""
    return {'skipped_steps': self.skipped_steps, 'consecutive_skips': self.guard.consecutive}

  # ---- in the compiled loop ------------------------------------------------------------------
  def begin_call(self) -> tuple[tf.Tensor, tf.Tensor]:
    """At the start of a compiled call: (the global step, the skipped steps)."""
    return self.global_step.read_value(), self.skipped_steps.read_value()

  def collapsed(self):
    """After each step: a bool tensor for the loop to stop on (Python False: the guard is off)."""
    return self.guard.collapsed()

  def end_call(self, begin) -> tf.Tensor:
    """At the end of a compiled call (`begin`: what `begin_call` returned): the state check of
    what its updates wrote, then the int64 counters the host reads (loop.Counters' order)."""
    first_step, first_skipped = begin
    end_step, skipped = self.global_step.read_value(), self.skipped_steps.read_value()
    applied = (end_step - first_step) - (skipped - first_skipped)
    self.state_check.after_call(self._groups(), first_step, end_step, applied > 0)
    consecutive = self.guard.consecutive.read_value()
    return tf.stack([first_step, end_step, skipped, consecutive, self.state_check.bad_steps[0]])

  # ---- on the host ---------------------------------------------------------------------------
  def skipped(self) -> int:
    """The skipped steps so far (cumulative, checkpointed)."""
    return int(self.skipped_steps.numpy())

  def check(self, counters, *, scaler, kept: Callable[[], tuple[str | None, str | None]]) -> None:
    """After a compiled call (`counters`: what it returned): NonFiniteError when its updates
    left the state non-finite, CollapseError when the guard's limit was reached. `kept()`: the
    newest checkpoint and the last healthy one in words, read only for an error."""
    if counters.nonfinite_state_step >= 0:
      checkpoint, healthy = kept()
      self.state_check.check(checkpoint=checkpoint, healthy=healthy)
    if counters.consecutive >= self.guard.max_consecutive_skips > 0:
      checkpoint, healthy = kept()
      self.guard.check(
        step=counters.global_step, scaler=scaler, checkpoint=checkpoint, healthy=healthy
      )
