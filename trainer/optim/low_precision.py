"""Training below mixed precision: 16-bit master weights and 8-bit Adam state.

`config.precision.master_weights` (mixed_bfloat16, or auto resolving to it; Adam, AdamW, SGD):
  'float32'         the model's variables are float32 (every other policy's behaviour).
  'bfloat16_sr'     variables and optimizer slots are bfloat16; each update is computed in float32
                    and stored with stochastic rounding (trainer/optim/rounding.py): updates far
                    below a weight's bfloat16 spacing (lr x Adam step, about 1e-3 relative)
                    survive on average instead of rounding away.
  'bfloat16_kahan'  bfloat16 weights plus a bfloat16 Kahan compensation buffer each (what
                    rounding dropped is kept for the next update); slots as for bfloat16_sr.
Variables a model keeps float32 (a layer with dtype='float32', such as the logits, or
config.precision.float32_layers) keep float32 weights and the plain update.

`config.optimizer.state_bits=8` (Adam, AdamW; any master_weights): each moment is stored in
rounding.py's 8-bit block codes (1 + 4/256 bytes per element, against 4): m signed, v unsigned
with twice the bins, since the update divides by v. The code variables are named
'..._dynamic_codes', so a checkpoint of the earlier logarithmic code does not restore into them
(a mismatch, not a misread). The update dequantizes, computes in float32 as Keras's Adam does,
and requantizes.

The managed variables are updated together, in compiled calls of up to CALL_ELEMENTS elements
(trainer/optim/low_precision_updates.py), each call's random bits one stateless draw seeded by
(config.seed, the trainer's global step, the call's number; and an update group's index): a
resumed run draws the bits an uninterrupted one does, every replica the same (mirrored copies stay
identical), a skipped step none. Each variable reads its own slice of the draw, each tensor
(weight, m, v, momentum) its own 16-bit chunk. Skipped steps never call the optimizer: weights,
slots, compensations and codes stay bit-identical. Clipping and gradient accumulation happen
before the optimizer on float32 gradients, as with float32 masters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import keras
import ml_collections
import numpy as np
import tensorflow as tf

from trainer.optim import fused_optimizers, low_precision_updates
from trainer.optim.rounding import BLOCK, blocks, random_bits

if TYPE_CHECKING:
  # The mixins' `super()` is the fused Keras optimizer they precede; Keras ships no types: Any.
  from keras.optimizers import Optimizer as _KerasOptimizer
else:
  _KerasOptimizer = object


_tf = fused_optimizers._slot  # the tf.Variable behind a Keras variable (or the variable itself)


def _low(variable: Any) -> bool:
  return variable.dtype == tf.bfloat16


class _LowPrecision(_KerasOptimizer):
  """The update for bfloat16 weights and 8-bit moments, mixed in ahead of a fused optimizer.
  Variables it does not manage (float32 weights with 32-bit state) take the fused update."""

  # The Keras optimizer's (annotations only: no class attributes).
  iterations: tf.Variable
  weight_decay: Any
  _use_weight_decay: Any
  _get_variable_index: Any
  _low_managed: bool  # set by build: some managed variable is bfloat16
  _managed: list[bool]  # set by build: per variable index, whether this class updates it
  _comp_index: dict[int, int]  # variable index -> its Kahan compensation's index
  _compensations: list

  def __init__(
    self,
    *args: Any,
    master_weights: str = 'float32',
    state_bits: int = 32,
    seed: int = 0,
    step: tf.Variable | None = None,
    **kwargs: Any,
  ) -> None:
    super().__init__(*args, **kwargs)
    self.master_weights = master_weights
    self.state_bits = int(state_bits)
    self.seed = int(seed)
    self._step = step  # the trainer's global step (None: this optimizer's iterations)
    # The update group's index (TrainStep.build_optimizers sets it): two groups whose optimizers
    # share config.seed would otherwise round with the same bits. Group 0 folds in nothing.
    self.stream = 0

  def get_config(self) -> dict:
    return {
      **super().get_config(),
      'master_weights': self.master_weights,
      'state_bits': self.state_bits,
      'seed': self.seed,
    }

  def _managed_variable(self, variable: tf.Variable) -> bool:
    raise NotImplementedError

  def _apply_weight_decay(self, variables: list) -> None:
    # The managed variables' decay is part of their float32 update (one rounding, not two).
    super()._apply_weight_decay(
      [v for v in variables if not self._managed[self._get_variable_index(v)]]
    )

  def _weight_decay(self, variable: tf.Variable) -> float:
    """Keras's decoupled decay rate for `variable` (w -= w * wd * lr), or 0.0."""
    if self.weight_decay is None or not self._use_weight_decay(variable):
      return 0.0
    return float(self.weight_decay)

  def _distributed_tf_update_step(
    self, distribution: tf.distribute.Strategy, grads_and_vars: list, learning_rate: tf.Tensor
  ) -> None:
    # Keras updates one variable at a time; the managed ones are updated together, in one
    # compiled call per device (low_precision_updates.py), the others by the fused update.
    managed = [self._managed[self._get_variable_index(v)] for _, v in grads_and_vars]
    super()._distributed_tf_update_step(
      distribution, [gv for gv, k in zip(grads_and_vars, managed) if not k], learning_rate
    )
    mine = [gv for gv, k in zip(grads_and_vars, managed) if k]
    if mine:
      # One update call, keyed to the first variable: on each device it runs with every
      # variable's and gradient's copy for that device.
      distribution.extended.update(
        mine[0][1],
        lambda _, grads, variables, lr: self._update(grads, variables, lr),
        args=([g for g, _ in mine], [v for _, v in mine], learning_rate),
        group=False,
      )

  def update_step(self, gradient: Any, variable: Any, learning_rate: tf.Tensor) -> Any:
    index = self._get_variable_index(variable)
    if not self._managed[index]:
      return super().update_step(gradient, variable, learning_rate)
    return self._update([gradient], [variable], learning_rate, variable_index=index)

  # Elements per compiled call: the random bits (4 or 8 bytes per element) and the new values
  # of one call's variables are live at once, so a large model is updated in several calls.
  CALL_ELEMENTS = 1 << 22

  def _update(
    self, grads: list, variables: list, learning_rate: tf.Tensor, variable_index: int | None = None
  ) -> None:
    """Updates `variables` in compiled calls of at most CALL_ELEMENTS (padded) elements each,
    one after another. Call k draws its bits from (config.seed, step) folded with (0, k); a
    single variable updated by update_step, with (1, its index). A later update group folds in
    its index first."""
    variables = [_tf(v) for v in variables]
    sizes = [blocks(int(np.prod(v.shape))) * BLOCK for v in variables]
    calls: list[list[int]] = [[]]
    total = 0
    for i, size in enumerate(sizes):
      if calls[-1] and total + size > self.CALL_ELEMENTS:
        calls.append([])
        total = 0
      calls[-1].append(i)
      total += size
    step = self.iterations if self._step is None else self._step
    seed = tf.stack([tf.constant(self.seed, tf.int64), tf.cast(step, tf.int64)])
    if self.stream:
      seed = tf.random.experimental.stateless_fold_in(seed, self.stream)
    lr = tf.cast(learning_rate, tf.float32)
    assigns: list = []
    for k, call in enumerate(calls):
      kind, n = (0, k) if variable_index is None else (1, variable_index)
      call_seed = tf.random.experimental.stateless_fold_in(
        tf.random.experimental.stateless_fold_in(seed, kind), n
      )
      with tf.control_dependencies(assigns):  # one call's tensors at a time
        assigns = self._update_call(
          [grads[i] for i in call],
          [variables[i] for i in call],
          lr,
          call_seed,
          sum(sizes[i] for i in call),
        )

  def _update_call(
    self, grads: list, variables: list, lr: tf.Tensor, seed: tf.Tensor, size: int
  ) -> list:
    """Reads every stored tensor of `variables`, draws the random bits, computes the updates in
    one compiled call and assigns the results; returns the assign ops."""
    stores = [self._stores(self._get_variable_index(v), v) for v in variables]
    # (A dense gradient of an embedding can lose its static shape; the kernel needs it.)
    items = tuple(
      (
        tf.ensure_shape(fused_optimizers._dense(g, tf.float32), v.shape),
        tuple(tuple(tf.convert_to_tensor(_tf(p)) for p in part) for part in store),
      )
      for g, v, store in zip(grads, variables, stores)
    )
    rules = tuple(self._weight_decay(v) for v in variables)
    streams = self._streams()
    bits = random_bits(seed, size, len(streams)) if streams else tf.zeros([0], tf.uint32)
    new = self._kernel(items, lr, bits, rules, streams)
    assigns = []
    for store, values in zip(stores, new):
      for part, part_values in zip(store, values):
        for v, value in zip(part, part_values):
          assigns.append(_tf(v).assign(value, read_value=False))
    return assigns

  def _rounds_weights(self) -> bool:
    """Whether some managed bfloat16 weight is stored by stochastic rounding (every mode but
    Kahan's: under float32 masters a layer built in bfloat16 is rounded so too)."""
    return self.master_weights != 'bfloat16_kahan' and self._low_managed

  def _stores(self, index: int, var: tf.Variable) -> tuple:
    """The variable's stored parts, in the kernel's order: ((weight[, compensation]), *state)."""
    weight: tuple = (var,)
    if index in self._comp_index:
      weight += (self._compensations[self._comp_index[index]],)
    return (weight,) + self._state(index)

  def _state(self, index: int) -> tuple:
    raise NotImplementedError

  def _streams(self) -> tuple:
    """The tensors that round stochastically, each reading its own 16-bit chunk of the bits."""
    raise NotImplementedError

  def _kernel(
    self, items: tuple, lr: tf.Tensor, bits: tf.Tensor, rules: tuple, streams: tuple
  ) -> tuple:
    raise NotImplementedError

  def _build_own(self, variables: list) -> None:
    """Which variables this class updates, and the Kahan compensations of the bfloat16 ones."""
    self._managed = [self._managed_variable(v) for v in variables]
    self._low_managed = any(_low(v) for v in variables if self._managed_variable(v))
    self._comp_index = {}
    compensations: list = []
    if self.master_weights == 'bfloat16_kahan':
      for i, v in enumerate(variables):
        if _low(v):
          self._comp_index[i] = len(compensations)
          compensations.append(self.add_variable_from_reference(v, 'compensation'))
    self._compensations = compensations


class _LowPrecisionAdam(_LowPrecision):
  def _managed_variable(self, variable: tf.Variable) -> bool:
    return _low(variable) or self.state_bits == 8

  def build(self, variables: list) -> None:
    if self.built:
      return
    if self.amsgrad:
      raise ValueError('amsgrad is not supported with 16-bit master weights or 8-bit state')
    keras.optimizers.Optimizer.build(self, variables)  # iterations, the variable index
    momentums: list = []
    velocities: list = []
    m_scales: list = []
    v_scales: list = []
    for v in variables:
      if self.state_bits == 8:
        size = int(np.prod(v.shape))
        name = getattr(v, 'path', v.name).replace('/', '_').replace(':', '_')
        for codes, scales, kind in (
          (momentums, m_scales, 'momentum'),
          (velocities, v_scales, 'velocity'),
        ):
          codes.append(
            self.add_variable(
              (blocks(size) * BLOCK,), 'zeros', 'uint8', name=f'{name}_{kind}_dynamic_codes'
            )
          )
          scales.append(
            self.add_variable((blocks(size),), 'zeros', 'float32', name=f'{name}_{kind}_absmax')
          )
      else:  # the variable's own dtype: bfloat16 slots for bfloat16 weights
        momentums.append(self.add_variable_from_reference(v, 'momentum'))
        velocities.append(self.add_variable_from_reference(v, 'velocity'))
    self._momentums, self._velocities = momentums, velocities
    self._momentum_scales, self._velocity_scales = m_scales, v_scales
    self._build_own(variables)

  def _state(self, index: int) -> tuple:
    """Per moment: (codes, absmax) with 8-bit state, else (slot,)."""
    if self.state_bits == 8:
      return (
        (self._momentums[index], self._momentum_scales[index]),
        (self._velocities[index], self._velocity_scales[index]),
      )
    return (self._momentums[index],), (self._velocities[index],)

  def _streams(self) -> tuple:
    return ('weight',) * self._rounds_weights() + ('m', 'v')

  def _kernel(
    self, items: tuple, lr: tf.Tensor, bits: tf.Tensor, rules: tuple, streams: tuple
  ) -> tuple:
    alpha = fused_optimizers.adam_step_size(self, lr, tf.float32)
    return low_precision_updates.adam_updates(
      items,
      lr,
      alpha,
      bits,
      rules,
      streams,
      (float(self.beta_1), float(self.beta_2), float(self.epsilon), self.master_weights),
    )


class _LowPrecisionSGD(_LowPrecision):
  momentum: float  # Keras SGD's (annotations only)
  momentums: list
  nesterov: bool

  def _managed_variable(self, variable: tf.Variable) -> bool:
    return _low(variable)

  def build(self, variables: list) -> None:
    if self.built:
      return
    super().build(variables)  # momentums in each variable's dtype
    self._build_own(variables)

  def _state(self, index: int) -> tuple:
    return () if self.momentum == 0 else ((self.momentums[index],),)

  def _streams(self) -> tuple:
    return ('weight',) * self._rounds_weights() + ('momentum',) * (self.momentum != 0)

  def _kernel(
    self, items: tuple, lr: tf.Tensor, bits: tf.Tensor, rules: tuple, streams: tuple
  ) -> tuple:
    return low_precision_updates.sgd_updates(
      items,
      lr,
      bits,
      rules,
      streams,
      (float(self.momentum), bool(self.nesterov), self.master_weights),
    )


@keras.saving.register_keras_serializable(package='trainer')
class LowPrecisionAdam(_LowPrecisionAdam, fused_optimizers.FusedAdam):
  """FusedAdam with bfloat16 master weights and/or 8-bit moments (module docstring)."""


@keras.saving.register_keras_serializable(package='trainer')
class LowPrecisionAdamW(_LowPrecisionAdam, fused_optimizers.FusedAdamW):
  """FusedAdamW with bfloat16 master weights and/or 8-bit moments (module docstring)."""


@keras.saving.register_keras_serializable(package='trainer')
class LowPrecisionSGD(_LowPrecisionSGD, fused_optimizers.FusedSGD):
  """FusedSGD with bfloat16 master weights (module docstring)."""


CLASSES = {'adam': LowPrecisionAdam, 'adamw': LowPrecisionAdamW, 'sgd': LowPrecisionSGD}


def requested(config: ml_collections.ConfigDict) -> bool:
  """Whether the config asks for 16-bit master weights or 8-bit state."""
  return config.precision.master_weights != 'float32' or config.optimizer.state_bits != 32


def state_bytes(optimizer: keras.optimizers.Optimizer) -> int:
  """Bytes of the optimizer's per-variable state (every variable but its scalar counters)."""
  return sum(
    int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in optimizer.variables if len(v.shape)
  )


def check_optimizer(
  optimizer: keras.optimizers.Optimizer, config: ml_collections.ConfigDict, group: int | None = None
) -> None:
  """ConfigError when the config asks for 16-bit masters or 8-bit state and `optimizer` (from
  Trainer.build_optimizer, or update group `group`'s: TrainStep.build_optimizers checks each)
  cannot provide them: a Keras optimizer would compute a bfloat16 weight's update in bfloat16,
  where most updates round to nothing."""
  from trainer.errors import ConfigError  # pylint: disable=import-outside-toplevel

  if requested(config) and not isinstance(optimizer, _LowPrecision):
    source = 'build_optimizer returned' if group is None else f"update group {group}'s optimizer is"
    raise ConfigError(
      f'config.precision.master_weights={config.precision.master_weights!r} / '
      f'config.optimizer.state_bits={config.optimizer.state_bits} need the optimizer '
      f'Trainer.build_optimizer makes by default; {source} {type(optimizer).__name__} (make '
      'each optimizer with trainer.build_optimizer(learning_rate)).'
    )
