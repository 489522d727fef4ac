"""`LossScaleOptimizer`: the Trainer's loss scaling as a Keras 3 optimizer for any loop.

Public as `trainer.mixed_precision.LossScaleOptimizer` (docs/guides/mixed-precision-own-loop.md,
docs/guides/mixed-precision-fit.md). It wraps another Keras optimizer with the API of
`keras.mixed_precision.LossScaleOptimizer` (it subclasses it, so `model.compile` under
mixed_float16 does not wrap it again) and of tf-keras 2.x's (`get_scaled_loss`,
`get_unscaled_gradients`, `loss_scale`, `dynamic_counter`), and decides each step exactly as the
Trainer does (trainer/step/apply_or_skip.py, one implementation):

  per replica     gradients unscaled (unless `get_unscaled_gradients` already did), this
                  replica's non-finite flag;
  merge_call      into cross-replica context, where the flag is summed over EVERY replica
                  (Keras 3.15.1's own checks replica 0 only) and the inner optimizer's apply or
                  the skip is chosen by one tf.cond there (a cond around an apply inside
                  `strategy.run` fails with merge_call); a skip runs no optimizer op: weights,
                  slots and `iterations` stay bit-identical;
  then            the scale moves by trainer/step/loss_scale.py's rules (floor, cap, growth,
                  hysteresis) and `skipped_steps` counts the skip.
The scale, the good-step counter, the hysteresis budget and the skip count are variables of the
optimizer: tf.train.Checkpoint and `model.save` keep them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import threading

import keras
import tensorflow as tf
from absl import logging

from trainer.errors import UserError
from trainer.step import apply_or_skip as shared
from trainer.distribute.strategy import state_variable
from trainer.step.loss_scale import LossScaler, update_scalers

_SCALED = '_trainer_loss_scaled'  # set on a loss `scale_loss` returned
_UNSCALED = '_trainer_unscaled'  # set on a gradient `get_unscaled_gradients` returned


class _Group(NamedTuple):
  """The one update group of `update_scalers`."""

  optimizer: Any
  loss_scaler: LossScaler


@keras.saving.register_keras_serializable(package='trainer')
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
  """Wraps `inner_optimizer`; scales the loss, unscales the gradients, applies them when every
  gradient on every replica is finite, else skips the step; moves the scale.

  Keras 3's arguments: `inner_optimizer`, `initial_scale` (`2**15`), `dynamic_growth_steps`
  (2000: finite steps in a row before the scale grows). Ours: `dynamic` (False: the scale stays
  `initial_scale`, non-finite steps are still skipped), `growth_factor`, `backoff_factor`,
  `min_scale` (the floor, 1), `max_scale` (the cap, `2**24`), `hysteresis` (non-finite steps in a
  row before a back-off). Create it under the model's `strategy.scope()`.

  Unscaling multiplies each gradient by 1/S in float32, as PyTorch's GradScaler does; Keras's
  own divides by S. With a power-of-two scale (every scale the defaults reach) the two are
  bit-identical; with a scale such as `initial_scale=400` some values differ in the last bit
  (docs/guides/loss-scaler-cases.md, case K3').
  """

  def __init__(
    self,
    inner_optimizer: keras.optimizers.Optimizer,
    initial_scale: float | None = 2.0**15,
    dynamic_growth_steps: int | None = 2000,
    name: str | None = None,
    *,
    dynamic: bool = True,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    min_scale: float = 1.0,
    max_scale: float = 2.0**24,
    hysteresis: int = 1,
  ) -> None:
    _check_inner(inner_optimizer, initial_scale)
    # Keras's LossScaleOptimizer.__init__ is skipped: its scale is not ours.
    keras.optimizers.Optimizer.__init__(self, learning_rate=0.0, name=name)
    self.inner_optimizer = inner_optimizer
    """The wrapped optimizer: it applies the unscaled gradients of a finite step."""
    _reset_loss_scale_factor(inner_optimizer)
    self._config: dict[str, Any] = dict(
      initial_scale=2.0**15 if initial_scale is None else float(initial_scale),
      dynamic_growth_steps=2000 if dynamic_growth_steps is None else int(dynamic_growth_steps),
      dynamic=bool(dynamic),
      growth_factor=growth_factor,
      backoff_factor=backoff_factor,
      min_scale=min_scale,
      max_scale=max_scale,
      hysteresis=hysteresis,
    )
    self.loss_scaler = LossScaler(
      mode='dynamic' if dynamic else 'static',
      initial_scale=self._config['initial_scale'],
      growth_interval=self._config['dynamic_growth_steps'],
      growth_factor=growth_factor,
      backoff_factor=backoff_factor,
      min_scale=min_scale,
      max_scale=max_scale,
      hysteresis=hysteresis,
    )
    """The scale and its rules (trainer/step/loss_scale.py), the Trainer's own."""
    self.skipped_steps = state_variable(0, tf.int64, 'skipped_steps')
    """Steps skipped because a gradient was not finite (int64, checkpointed)."""
    self._pending = threading.local()  # per replica: get_unscaled_gradients ran

  # ---- Keras 3's API ------------------------------------------------------------------------
  @property
  def initial_scale(self) -> float:
    """The scale the first step uses."""
    return self._config['initial_scale']

  @property
  def dynamic_growth_steps(self) -> int:
    """Finite steps in a row before the scale grows by `growth_factor`."""
    return self._config['dynamic_growth_steps']

  @property
  def dynamic(self) -> bool:
    """Whether the scale moves (False: it stays `initial_scale`; skips still happen)."""
    return self._config['dynamic']

  @property
  def dynamic_scale(self) -> tf.Variable:
    """The scale variable (Keras 3's name)."""
    return self.loss_scaler.scale

  @property
  def step_counter(self) -> tf.Variable:
    """Finite steps since the scale last changed (Keras 3's name; tf-keras: dynamic_counter)."""
    return self.loss_scaler.good_steps

  @property
  def variables(self) -> list:
    """The inner optimizer's variables, then the scale's state and the skip count."""
    scaler = self.loss_scaler
    own = [scaler.scale, scaler.good_steps, scaler.hysteresis_left, self.skipped_steps]
    return self._variables + self.inner_optimizer.variables + own

  def build(self, var_list: Sequence[Any]) -> None:
    """Builds the inner optimizer's slots for `var_list` (float16 variables are refused, as is
    a strategy other than the one the optimizer was created in)."""
    _check_variables(self, var_list)
    self.inner_optimizer.build(var_list)
    keras.optimizers.Optimizer.build(self, var_list)

  def scale_loss(self, loss: Any) -> Any:
    """`loss` x the current scale, in the loss's dtype. A loss this returned is refused."""
    if getattr(loss, _SCALED, False):
      raise UserError(
        'LossScaleOptimizer.scale_loss: this loss is already scaled (scale the loss once '
        'per step; Keras fit scales it itself)'
      )
    scaled = self.loss_scaler.scale_loss(tf.convert_to_tensor(loss))
    setattr(scaled, _SCALED, True)
    return scaled

  def apply_gradients(self, grads_and_vars: Any) -> tf.Variable:
    """`apply` on `(gradient, variable)` pairs of scaled gradients; returns `iterations`."""
    grads, variables = zip(*grads_and_vars)
    self.apply(list(grads), list(variables))
    return self.iterations

  def apply(self, grads: Sequence[Any], trainable_variables: Sequence[Any] | None = None) -> None:
    """Replica context (or none): unscale, check every replica, apply or skip, move the scale."""
    variables = list(trainable_variables or self._trainable_variables)
    if not self.built:  # type: ignore[has-type]
      with keras.name_scope(self.name, caller=self):
        self.build(variables)
      self.built = True
    context = tf.distribute.get_replica_context()
    if context is None:
      raise UserError(
        'LossScaleOptimizer.apply_gradients: call it per replica (inside strategy.run), '
        'not in cross-replica context'
      )
    grads = self._unscaled(list(grads), variables)
    counts = shared.nonfinite_counts([grads])
    context.merge_call(self._apply_or_skip, args=(counts, grads, variables))

  def stateless_apply(self, optimizer_variables, grads, trainable_variables):
    """JAX's stateless update: refused in one line (this backend is TensorFlow)."""
    raise UserError('LossScaleOptimizer.stateless_apply: not supported on TensorFlow')

  def get_config(self) -> dict:
    """Keras 3's keys and ours (10 in all): `keras.saving` round-trips the optimizer."""
    return {
      'name': self.name,
      'inner_optimizer': keras.saving.serialize_keras_object(self.inner_optimizer),
      **self._config,
    }

  # ---- tf-keras 2.x's API -------------------------------------------------------------------
  @property
  def loss_scale(self) -> tf.Tensor:
    """The current scale as a float32 tensor."""
    return tf.convert_to_tensor(self.loss_scaler.scale)

  @property
  def dynamic_counter(self) -> tf.Variable | None:
    """Finite steps since the scale last changed; None when the scale is static."""
    return self.loss_scaler.good_steps if self.dynamic else None

  def get_scaled_loss(self, loss: Any) -> Any:
    """`loss` x the scale; a callable loss gives a callable (tf-keras)."""
    if callable(loss):
      return lambda: self.scale_loss(loss())
    return self.scale_loss(loss)

  def get_unscaled_gradients(self, grads: Sequence[Any]) -> list:
    """`grads` x 1/scale, in float32 (None stays None). The next `apply_gradients` of this
    replica then does not divide again (tf-keras), whatever happened to them in between
    (clipping). Gradients this returned are refused (unscaled twice)."""
    if any(getattr(g, _UNSCALED, False) for g in grads):
      raise UserError(
        'LossScaleOptimizer.get_unscaled_gradients: these gradients are already unscaled '
        '(unscale once per step)'
      )
    unscaled = self.loss_scaler.unscale(list(grads), sparse=True)
    for g in unscaled:
      if g is not None:
        setattr(g, _UNSCALED, True)
    self._pending.unscaled = True
    return unscaled

  # ---- the step -----------------------------------------------------------------------------
  def _unscaled(self, grads: list, variables: list) -> list:
    """`grads` unscaled (x 1/scale), unless this replica (thread: MirroredStrategy runs each
    replica in its own) called `get_unscaled_gradients` since its last apply."""
    if getattr(self._pending, 'unscaled', False):
      self._pending.unscaled = False
      return grads
    return self.loss_scaler.unscale(grads, variables, sparse=True)

  def _apply_or_skip(self, strategy, counts, grads, variables) -> None:
    """Cross-replica (merge_call): the Trainer's decision for one group (apply_or_skip.py)."""
    flags = shared.groups_finite(strategy, counts, [self.inner_optimizer])

    def apply_groups(_) -> None:
      strategy.extended.call_for_each_replica(self.inner_optimizer.apply, args=(grads, variables))

    skipped = shared.apply_or_skip(flags, apply_groups, lambda: None)
    self.skipped_steps.assign_add(skipped)
    update_scalers([_Group(self.inner_optimizer, self.loss_scaler)], flags)


def _raw(variable: Any) -> Any:
  """The tf.Variable behind a Keras variable."""
  return getattr(variable, 'value', variable) if isinstance(variable, keras.Variable) else variable


def _reset_loss_scale_factor(inner: keras.optimizers.Optimizer) -> None:
  """The inner optimizer's own `loss_scale_factor` would divide every gradient again: reset
  to None (as Keras's LossScaleOptimizer does), with one warning line."""
  if getattr(inner, 'loss_scale_factor', None) is not None:
    logging.warning(
      'LossScaleOptimizer: %s loss_scale_factor=%g reset to None: the loss is scaled once, here',
      inner.name,
      inner.loss_scale_factor,
    )
    inner.loss_scale_factor = None


def _check_inner(inner: Any, initial_scale: Any) -> None:
  """One line for an inner optimizer that cannot be wrapped."""
  if isinstance(inner, keras.optimizers.LossScaleOptimizer):
    raise UserError(
      f'LossScaleOptimizer(inner_optimizer=...): {type(inner).__name__} is already a loss '
      'scale optimizer; wrap the plain optimizer once'
    )
  if not isinstance(inner, keras.optimizers.Optimizer):
    raise UserError(
      'LossScaleOptimizer(inner_optimizer=...): a Keras 3 optimizer is needed, got '
      f'{type(inner).__module__}.{type(inner).__name__}'
    )
  if isinstance(initial_scale, bool):
    raise UserError(
      'LossScaleOptimizer: the second argument is initial_scale (Keras 3); pass '
      'dynamic=True/False by keyword (tf-keras order)'
    )


def _check_variables(optimizer: LossScaleOptimizer, variables: Sequence[Any]) -> None:
  """One line for float16 variables and for a strategy other than the optimizer's."""
  ours = optimizer._distribution_strategy
  for variable in variables:
    if tf.as_dtype(variable.dtype) == tf.float16:
      raise UserError(
        f'LossScaleOptimizer: variable {variable.name} is float16; keep variables float32 '
        "(keras.mixed_precision.set_dtype_policy('mixed_float16') computes in float16)"
      )
    raw = _raw(variable)
    theirs = getattr(raw, '_distribute_strategy', None)
    if isinstance(raw, tf.distribute.DistributedValues) and theirs is not ours:
      raise UserError(
        'LossScaleOptimizer was created outside the strategy.scope() of the model '
        f'(variable {variable.name}); create it and its inner optimizer in that scope'
      )
  if optimizer.inner_optimizer._distribution_strategy is not ours:
    raise UserError(
      'LossScaleOptimizer: its inner optimizer was created in another strategy.scope(); '
      'create both in the scope of the model'
    )


class LossScaleMonitor(keras.callbacks.Callback):
  """Adds `loss_scale` and `skipped_steps` (cumulative) of the model's LossScaleOptimizer to
  `fit`'s batch and epoch logs, so History and a TensorBoard callback listed after this one
  record them."""

  def _add(self, logs: dict | None) -> None:
    optimizer = self.model.optimizer
    if logs is None or not isinstance(optimizer, LossScaleOptimizer):
      return
    logs['loss_scale'] = float(optimizer.dynamic_scale.numpy())
    logs['skipped_steps'] = int(optimizer.skipped_steps.numpy())

  def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
    """Adds `loss_scale` and `skipped_steps` to the batch's logs."""
    self._add(logs)

  def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
    """Adds `loss_scale` and `skipped_steps` to the epoch's logs (History, TensorBoard)."""
    self._add(logs)
