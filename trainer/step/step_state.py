"""The step's state across steps, one object (`StepState`, the train step's `state`): the skip
counter, the collapse guard (trainer/step/skip_guard.py) and the check below. The compiled loop
(trainer/step/loop.py) reads it in the graph (`begin_call`, `collapsed`, `end_call`), the runner on
the host (`check`, `skipped`), the checkpoint through `checkpoint_items()`: a tf.train.Checkpoint
keys a variable by its item's name, not by the object holding it, so checkpoints written before
this object existed restore.

After each compiled call: the state its updates wrote is finite, or the run stops there.

A step is skipped when a gradient or the learning rate is not finite (trainer/step/
train_step.py); that alone does not keep the state finite. A finite gradient above about 1.8e19
squares to inf in Adam's second moment (the weights stay finite: the update divides by that
inf), and a finite learning rate times a finite step can overflow a weight; a NaN planted in a
weight behind a ReLU trains on with a finite loss and finite gradients. Such a state cannot be
put back without a copy of every weight and slot (a second optimizer state in memory), so the
step is not skipped: at the end of each compiled call (trainer/step/loop.py) the weights and the
floating optimizer variables of every group are checked finite, and when one is not the call's
steps are recorded (`bad_steps`) and the host raises NonFiniteError naming them and the
variables (`check`). The runner treats that like a collapse: with `train.recover_tries` it
restores the last healthy checkpoint (trainer/run/recovery.py), else the run stops in one line.

Once per call, not once per step: a non-finite weight or slot stays non-finite through every
later update (NaN and inf absorb the additions, decays and products an optimizer applies, and a
step whose gradients they make non-finite is skipped), so a check at the call's end misses
nothing a check after each step would find. A call whose every step skipped applied nothing and
is not blamed: a state made non-finite between calls (a bad write) shows as non-finite losses,
the skips' and the divergence check's to report. What it gives up is the step: the error names the
call's steps (`train.steps_per_loop` of them; one step when that is 1), and the steps after the
bad update run on the non-finite state until the call ends (their skips are logged as such;
a recovery or the stop discards them). What it saves: the check is one float32 sum per variable
(trainer/step/loss_scale.py's `all_finite`: a finite total proves every element finite), about
20 small ops on the MNIST MLP with Adam, which once per step were a measurable share of its short
step (docs/results/ablate_step.md, contender `no_state_check`).
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from trainer.errors import NonFiniteError
from trainer.nn.paths import variable_name
from trainer.distribute.strategy import state_variable
from trainer.step.loss_scale import all_finite
from trainer.step.skip_guard import SkipGuard

SHOWN = 3  # variables named in the error line


def checked_variables(groups) -> list:
  """The variables an update writes, each once: the groups' weights and every floating
  variable of their optimizers (slots, masters, block scales; the learning rate's)."""
  seen: set = set()
  found = []
  for group in groups:
    for v in [*group.variables, *getattr(group.optimizer, 'variables', [])]:
      if id(v) not in seen and tf.as_dtype(v.dtype).is_floating:
        seen.add(id(v))
        found.append(v)
  return found


def group_names(groups) -> list[str]:
  """Each group's name: its own, or its index ('0', '1', ...)."""
  return [group.name or str(index) for index, group in enumerate(groups)]


class StepState:
  """Create it under the strategy's scope (it owns variables). `global_step`: the trainer's;
  `groups()`: the step's update groups (the check reads their variables)."""

  def __init__(self, *, strategy, global_step, variables, groups, max_consecutive_skips):
    self.global_step, self._groups = global_step, groups
    self.skipped_steps = state_variable(0, tf.int64, 'skipped_steps')  # cumulative
    named = zip(group_names(groups()), groups())
    self.guard = SkipGuard(
      strategy=strategy,
      variables=variables,
      max_consecutive_skips=max_consecutive_skips,
      groups=[(name, len(group.variables)) for name, group in named],
    )
    # The first and last global step of the first call whose updates left the state
    # non-finite; -1: none.
    self.bad_steps = state_variable([-1, -1], tf.int64, 'nonfinite_state_steps', shape=[2])
    self._checked: list = []  # what the traced check reads (names for `check`)
    # Callables traced into the skip branch only (no cost on a finite step): the compiled loop
    # adds forensics' batch keeping here (trainer/step/loop.py).
    self.on_skip: list[Callable[[], Any]] = []

  def checkpoint_items(self) -> dict[str, tf.Variable]:
    return {'skipped_steps': self.skipped_steps, 'consecutive_skips': self.guard.consecutive}

  def begin_call(self) -> tuple[tf.Tensor, tf.Tensor]:
    """In the compiled loop, first: (the global step, the skipped steps)."""
    return self.global_step.read_value(), self.skipped_steps.read_value()

  def collapsed(self):
    """After each step: a bool tensor for the loop to stop on (Python False: the guard is off)."""
    return self.guard.collapsed()

  def end_call(self, begin) -> tf.Tensor:
    """In the compiled loop, last (`begin`: `begin_call`'s): the check of the state the call's
    updates wrote (none when every step skipped), then the int64 counters the host reads (in
    loop.Counters' order)."""
    first_step, first_skipped = begin
    end_step, skipped = self.global_step.read_value(), self.skipped_steps.read_value()
    applied = (end_step - first_step) - (skipped - first_skipped) > 0
    self._checked = checked_variables(self._groups())
    finite = all_finite([tf.convert_to_tensor(v) for v in self._checked])
    first = tf.logical_and(tf.logical_and(applied, tf.logical_not(finite)), self.bad_steps[0] < 0)
    steps = tf.cast(tf.stack([first_step, end_step - 1]), tf.int64)
    self.bad_steps.assign(tf.where(first, steps, self.bad_steps))
    consecutive = self.guard.consecutive.read_value()
    return tf.stack([first_step, end_step, skipped, consecutive, self.bad_steps[0]])

  def updated(self) -> set[str]:
    """The names of the variables the check after each call reads (trainer/nn/paths.py)."""
    return {variable_name(v) for v in checked_variables(self._groups())}

  def skipped(self) -> int:
    """Host side: the skipped steps so far."""
    return int(self.skipped_steps.numpy())

  def check(self, counters, *, scaler, kept: Callable[[], tuple[str | None, str | None]]) -> None:
    """Host side, after a compiled call (`counters`: what it returned): NonFiniteError when its
    updates left the state non-finite, CollapseError when the guard's limit was reached.
    `kept()`: the newest checkpoint and the last healthy one in words, read for an error only."""
    if counters.nonfinite_state_step >= 0:
      self._nonfinite(*kept())
    if counters.consecutive >= self.guard.max_consecutive_skips > 0:
      checkpoint, healthy = kept()
      self.guard.check(
        step=counters.global_step, scaler=scaler, checkpoint=checkpoint, healthy=healthy
      )

  def _nonfinite(self, checkpoint: str | None, healthy: str | None) -> None:
    """NonFiniteError naming the call's steps and the first variables; resets the record first
    (a recovery goes on)."""
    first, last = (int(s) for s in self.bad_steps.numpy())
    self.bad_steps.assign([-1, -1])
    bad = [variable_name(v) for v in self._checked if not np.isfinite(v.numpy()).all()]
    kept = (
      f'the newest checkpoint, {checkpoint}, is finite (checked when saved)'
      if checkpoint
      else 'no checkpoint was written yet'
    ) + (f'; {healthy}' if healthy else '')
    steps, after = (
      (f'step {first}', 'its update')
      if first == last
      else (f'steps {first}-{last}', 'the updates of these steps (checked once per compiled call)')
    )
    raise NonFiniteError(
      f'{steps}: the training state is not finite after {after} (inf or NaN in '
      f'{len(bad)} variable(s), first: {", ".join(bad[:SHOWN])}), though the gradients and '
      f'learning rate applied were finite. Stopped there; {kept}. Lower '
      'config.optimizer.learning_rate, clip the gradients (config.optimizer.clip_norm) or '
      'check the input data and the weights'
    )
