"""After each compiled call: the state its updates wrote is finite, or the run stops there.

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
20 small ops on the MNIST MLP with Adam, which once per step cost about 3 % of its 3 ms step
(benchmarks/ablate_step.py, contender `no_state_check`).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from trainer.errors import NonFiniteError
from trainer.distribute.strategy import state_variable
from trainer.step.loss_scale import all_finite

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


class StateCheck(tf.Module):
  """Create it under the strategy's scope. `after_call` runs in cross-replica context at the end
  of the compiled loop; `check` on the host between calls."""

  def __init__(self):
    super().__init__(name='state_check')
    # The first and last global step of the first call whose updates left the state
    # non-finite; -1: none.
    self.bad_steps = state_variable([-1, -1], tf.int64, 'nonfinite_state_steps', shape=[2])
    self._checked: list = []  # what the traced check reads (names for `check`)

  def after_call(self, groups, first_step, end_step, applied) -> None:
    """Cross-replica, after the call's steps `first_step` .. `end_step` - 1 (global steps);
    `applied`: a bool tensor, True when a step of the call applied its update. A call whose
    every step skipped wrote nothing: a non-finite state then came from elsewhere (a write
    between calls, a broken kernel) and is the skips' and the divergence check's to report."""
    variables = checked_variables(groups)
    self._checked = variables
    finite = all_finite([tf.convert_to_tensor(v) for v in variables])
    first = tf.logical_and(tf.logical_and(applied, tf.logical_not(finite)), self.bad_steps[0] < 0)
    steps = tf.cast(tf.stack([first_step, end_step - 1]), tf.int64)
    self.bad_steps.assign(tf.where(first, steps, self.bad_steps))

  def check(self, *, checkpoint: str | None, healthy: str | None = None) -> None:
    """Host side: raises NonFiniteError when a call's updates left the state non-finite,
    naming its steps and the first variables; resets the record first (a recovery goes on)."""
    first, last = (int(s) for s in self.bad_steps.numpy())
    if first < 0:
      return
    self.bad_steps.assign([-1, -1])
    bad = [_name(v) for v in self._checked if not np.isfinite(v.numpy()).all()]
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


def _name(v) -> str:
  return getattr(v, 'path', None) or v.name
