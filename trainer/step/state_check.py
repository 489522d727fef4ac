"""After each applied update: the state it wrote is finite, or the loop stops at that step.

A step is skipped when a gradient or the learning rate is not finite (trainer/step/
train_step.py); that alone does not keep the state finite. A finite gradient above about 1.8e19
squares to inf in Adam's second moment (the weights stay finite: the update divides by that
inf), and a finite learning rate times a finite step can overflow a weight; a NaN planted in a
weight behind a ReLU trains on with a finite loss and finite gradients. Such a state cannot be
put back without a copy of every weight and slot (a second optimizer state in memory), so the
step is not skipped: after its update, the weights and the floating optimizer variables of the
groups it applied are checked finite, and when one is not the loop stops right after that step
(`stopped`, read by trainer/step/loop.py) and the host raises NonFiniteError naming the step and
the variables (`check`). The runner treats that like a collapse: with `train.recover_tries` it
restores the last healthy checkpoint (trainer/run/recovery.py), else the run stops in one line.

Cost: the check of trainer/step/loss_scale.py's `all_finite`, one float32 sum per variable (a
finite total proves every element finite; only a non-finite total checks element by element),
so one read of each weight and slot per applied step (305k floats on the MNIST MLP with Adam,
next to the step's 39M multiply-adds); no copy. Measured there (float32, batch 128, compiled
calls of 100 steps, with and without the check, interleaved, on 2 cores at load 9-12): the
ratio of median call times was 1.08 in one run and 0.81 in another, i.e. below what this
loaded machine resolves. A jit-compiled check was no faster.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from trainer.errors import NonFiniteError
from trainer.step.loss_scale import all_finite, state_variable

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
  """Create it under the strategy's scope. `after_apply` runs in cross-replica context on the
  apply branch of the step; `stopped` in the loop; `check` on the host between calls."""

  def __init__(self):
    super().__init__(name='state_check')
    # The global step of the first applied step that left the state non-finite; -1: none.
    self.bad_step = state_variable(-1, tf.int64, 'nonfinite_state_step')
    self._checked: list = []  # what the traced checks read (names for `check`)

  def after_apply(self, groups, step) -> None:
    """Cross-replica, right after `groups` applied their update at global step `step`."""
    variables = checked_variables(groups)
    self._checked.extend(v for v in variables if all(v is not w for w in self._checked))
    finite = all_finite([tf.convert_to_tensor(v) for v in variables])
    first = tf.logical_and(tf.logical_not(finite), self.bad_step < 0)
    self.bad_step.assign(tf.where(first, tf.cast(step, tf.int64), self.bad_step))

  def stopped(self) -> tf.Tensor:
    """A bool tensor: a checked update left the state non-finite (the loop stops)."""
    return self.bad_step >= 0

  def check(self, *, checkpoint: str | None, healthy: str | None = None) -> None:
    """Host side: raises NonFiniteError when an update left the state non-finite, naming the
    step and the first variables; resets the flag first (a recovery goes on)."""
    step = int(self.bad_step.numpy())
    if step < 0:
      return
    self.bad_step.assign(-1)
    bad = [_name(v) for v in self._checked if not np.isfinite(v.numpy()).all()]
    kept = (
      f'the newest checkpoint, {checkpoint}, is finite (checked when saved)'
      if checkpoint
      else 'no checkpoint was written yet'
    ) + (f'; {healthy}' if healthy else '')
    raise NonFiniteError(
      f'step {step}: the training state is not finite after its update (inf or NaN in '
      f'{len(bad)} variable(s), first: {", ".join(bad[:SHOWN])}), though its gradients and '
      f'learning rate were finite. Stopped at that step; {kept}. Lower '
      'config.optimizer.learning_rate, clip the gradients (config.optimizer.clip_norm) or '
      'check the input data and the weights'
    )


def _name(v) -> str:
  return getattr(v, 'path', None) or v.name
