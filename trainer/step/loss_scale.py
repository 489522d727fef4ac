"""Loss scaling: static or dynamic, written here rather than borrowed from Keras.

Why: float16 has 5 exponent bits; gradients below about 6e-8 flush to zero. So the loss is
multiplied by a scale S before backprop, shifting every gradient up by S, and the float32
gradients are divided by S before the optimizer sees them. Too large an S overflows to inf/NaN,
so the scale adapts as training runs. bfloat16 (float32's exponent range) and float32 need none.

Each step (see `trainer/step/train_step.py`):
  1. loss x S  -> gradients  -> x (1/S) in float32 (`unscale`; exact when S is a power of 2,
     as the default dynamic scales are; otherwise within one rounding of a divide);
  2. every gradient on every replica is checked finite (`all_finite`: a sum per gradient, and
     an element-wise check only when a sum is not finite);
  3. non-finite: the optimizer is not applied (weights and slots untouched) and the step counts
     as skipped; finite: the optimizer applies the (optionally clipped) unscaled gradients;
  4. `update(finite)` moves the scale by the rules below, once per step, in cross-replica context.

Modes:
  'none'    S = 1 and nothing is multiplied; non-finite steps are still skipped.
  'static'  S is fixed; non-finite steps are skipped, S never changes.
  'dynamic' the rules below.

Dynamic rules, exactly (state: `scale`, `good_steps`, `hysteresis_left`; tf.Variables, saved):
  start      scale = initial_scale, good_steps = 0, hysteresis_left = hysteresis.
  finite     good_steps += 1 and hysteresis_left = hysteresis (the budget refills).
             If good_steps == growth_interval: good_steps = 0 and scale = min(scale *
             growth_factor, max_scale), unless that product is not finite (then scale stays).
  non-finite good_steps = 0 and hysteresis_left = max(hysteresis_left - 1, 0).
             If hysteresis_left == 0: scale = max(scale * backoff_factor, min_scale).
             So with hysteresis = 1 (the default) every non-finite step backs off; with N > 1 the
             first N-1 non-finite steps in a row only skip, the N-th and every further one in the
             same run back off, and one finite step refills the budget to N.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import ml_collections
import tensorflow as tf

from trainer import config
from trainer.distribute.strategy import state_variable

MODES = config.LOSS_SCALE_MODES


def overwritten(variables: Iterable[tf.Variable]) -> list[bool]:
  """Per variable: whether the optimizer assigns its "gradient" as its new value instead of
  stepping it (Keras's `overwrite_with_gradient`, set on float8 layers' scale and amax-history
  variables)."""
  return [bool(getattr(v, 'overwrite_with_gradient', False)) for v in variables]


def all_finite(grads: Sequence[tf.Tensor]) -> tf.Tensor:
  """A scalar bool: every element of every gradient is finite (None gradients are ignored).

  Fast path, every step: one float32 sum per gradient (reading each once; the element check
  writes and rereads a boolean tensor the gradient's size). An inf or NaN element makes the sum
  non-finite, so a finite total proves the step finite; a non-finite one may be an overflow of
  huge finite elements, so only then are the elements checked one by one.
  """
  grads = [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads if g is not None]
  if not grads:
    return tf.constant(True)
  total = tf.add_n([tf.reduce_sum(tf.cast(g, tf.float32)) for g in grads])

  def elementwise() -> tf.Tensor:
    return tf.reduce_all(tf.stack([tf.reduce_all(tf.math.is_finite(g)) for g in grads]))

  return tf.cond(tf.math.is_finite(total), lambda: tf.constant(True), elementwise)


def _times(grad: Any, factor: tf.Tensor) -> Any:
  """`grad` x `factor`; an IndexedSlices (an embedding's gradient) keeps its indices."""
  if isinstance(grad, tf.IndexedSlices):
    return tf.IndexedSlices(grad.values * factor, grad.indices, grad.dense_shape)
  return grad * factor


class LossScaler(tf.Module):
  """The loss scale and its state. Create it under the strategy's scope.

  `scale_loss` and `unscale` run per replica; `update` runs once per step in cross-replica
  context with the all-replica finite flag, so every replica holds the same state.
  """

  def __init__(
    self,
    *,
    mode: str = 'dynamic',
    initial_scale: float = 2.0**15,
    growth_interval: int = 2000,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
    hysteresis: int = 1,
  ) -> None:
    super().__init__(name='loss_scaler')
    if mode not in MODES:
      raise ValueError(f'loss scale mode must be one of {MODES}, got {mode!r}')
    if not initial_scale > 0:
      raise ValueError(f'initial_scale must be > 0, got {initial_scale}')
    if growth_interval < 1 or hysteresis < 1:
      raise ValueError('growth_interval and hysteresis must be >= 1')
    if not 0 < min_scale <= max_scale:
      raise ValueError(f'need 0 < min_scale <= max_scale, got {min_scale}, {max_scale}')
    self.mode = mode
    self.growth_interval = int(growth_interval)
    self.growth_factor = float(growth_factor)
    self.backoff_factor = float(backoff_factor)
    self.min_scale = float(min_scale)
    self.max_scale = float(max_scale)
    self.hysteresis = int(hysteresis)
    first = 1.0 if mode == 'none' else float(initial_scale)
    self.scale = state_variable(first, tf.float32, 'scale')
    self.good_steps = state_variable(0, tf.int64, 'good_steps')
    self.hysteresis_left = state_variable(self.hysteresis, tf.int64, 'hysteresis_left')

  @classmethod
  def from_config(cls, precision: ml_collections.ConfigDict, policy: str) -> LossScaler:
    """From `config.precision` and the resolved policy name ('auto' is dynamic only under
    mixed_float16)."""
    text = precision.loss_scale
    if text == 'auto':
      text = 'dynamic' if policy == 'mixed_float16' else 'none'
    if text in ('none', 'dynamic'):
      mode, initial = text, precision.initial_scale
    else:
      mode, initial = 'static', float(text)
    return cls(
      mode=mode,
      initial_scale=initial,
      growth_interval=precision.growth_interval,
      growth_factor=precision.growth_factor,
      backoff_factor=precision.backoff_factor,
      min_scale=precision.min_scale,
      max_scale=precision.max_scale,
      hysteresis=config.value(precision, 'precision.hysteresis'),
    )

  def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
    if self.mode == 'none':
      return loss
    return loss * tf.cast(self.scale, loss.dtype)

  def unscale(
    self,
    grads: Sequence[tf.Tensor | None],
    variables: Sequence[tf.Variable] | None = None,
    sparse: bool = False,
  ) -> list[tf.Tensor | None]:
    """Gradients in float32, divided by the scale. Given the `variables` they belong to, the
    values of variables marked `overwrite_with_gradient` (Keras float8 layers' scales and amax
    histories: new values, not gradients) are left as they are. An IndexedSlices (an
    embedding's gradient) stays one when `sparse` (the public LossScaleOptimizer); otherwise the
    product makes it dense (the Trainer's step)."""
    grads = [None if g is None else tf.cast(g, tf.float32) for g in grads]
    if self.mode == 'none':
      return grads
    keep = overwritten(variables) if variables is not None else [False] * len(grads)
    inverse = 1.0 / self.scale  # read once; x (1/S) is exact for a power-of-two S
    times = _times if sparse else (lambda g, f: g * f)
    return [g if g is None or k else times(g, inverse) for g, k in zip(grads, keep)]

  def update(self, finite: tf.Tensor, active: tf.Tensor | bool = True) -> None:
    """Applies the rules in the module docstring for one step. Cross-replica context. When
    `active` is False (the step was skipped for another reason than its gradients, such as a
    non-finite learning rate) the state is left as it is: the scale answers to the gradients'
    range only."""
    if self.mode != 'dynamic':
      return
    finite = tf.convert_to_tensor(finite)

    def on_finite() -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
      good = self.good_steps + 1
      grow = good >= self.growth_interval
      grown = self.scale * self.growth_factor
      grown = tf.where(tf.math.is_finite(grown), tf.minimum(grown, self.max_scale), self.scale)
      return (
        tf.where(grow, grown, self.scale),
        tf.where(grow, tf.zeros_like(good), good),
        tf.constant(self.hysteresis, tf.int64),
      )

    def on_nonfinite() -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
      left = tf.maximum(self.hysteresis_left - 1, 0)
      backed = tf.maximum(self.scale * self.backoff_factor, self.min_scale)
      return (tf.where(left == 0, backed, self.scale), tf.zeros_like(self.good_steps), left)

    # Both outcomes are a few scalar ops: select with tf.where rather than branch with tf.cond
    # (a cond per step costs more than the arithmetic on CPU).
    state = (self.scale, self.good_steps, self.hysteresis_left)
    new = [tf.where(finite, x, y) for x, y in zip(on_finite(), on_nonfinite())]
    if active is not True:
      active = tf.convert_to_tensor(active)
      new = [tf.where(active, value, old) for value, old in zip(new, state)]
    for variable, value in zip(state, new):
      variable.assign(value)


def update_scalers(groups: Sequence[Any], flags: Sequence[tf.Tensor]) -> None:
  """Cross-replica, once per step: each distinct loss scaler of `groups` (update groups: each
  has .optimizer and .loss_scaler) updates once, with the AND of its groups' finite `flags`, and
  only when each of those groups' learning rates is finite: a non-finite rate skips the update,
  but the scale answers to the gradients' range alone, so it neither backs off nor grows."""
  scalers: dict[int, tuple] = {}
  for group, flag in zip(groups, flags):
    rate = tf.math.is_finite(tf.cast(group.optimizer.learning_rate, tf.float32))
    scaler, before, active = scalers.get(id(group.loss_scaler), (group.loss_scaler, True, True))
    scalers[id(group.loss_scaler)] = (
      scaler,
      tf.logical_and(before, flag),
      tf.logical_and(active, rate),
    )
  for scaler, flag, active in scalers.values():
    scaler.update(flag, active)
