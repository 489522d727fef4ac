"""Training below mixed precision: 16-bit master weights and 8-bit Adam state.

`config.precision.master_weights` (mixed_bfloat16 only; Adam, AdamW, SGD):
  'float32'         the model's variables are float32 (every other policy's behaviour).
  'bfloat16_sr'     the model's variables and the optimizer's slots are bfloat16. Each update is
                    computed in float32 from the stored values and stored with stochastic
                    rounding (trainer/step/rounding.py): updates far below a weight's bfloat16
                    spacing (lr x Adam step, about 1e-3 relative) survive on average instead of
                    rounding away.
  'bfloat16_kahan'  bfloat16 weights plus a bfloat16 compensation buffer per weight (Kahan
                    summation: what rounding the weight dropped is kept for the next update).
                    The slots (moments, momentum) are bfloat16 with stochastic rounding.
Variables a model keeps float32 under these modes (a layer with dtype='float32', such as the
logits, or config.precision.float32_layers) keep float32 weights and the plain update.

`config.optimizer.state_bits=8` (Adam, AdamW; any master_weights): each moment is stored in
rounding.py's 8-bit block codes (1 + 4/256 bytes per element, against 4): m signed, v unsigned
with the finer code, since v is what the update divides by. The update dequantizes, computes in
float32 exactly as Keras's Adam, and requantizes.

The random bits of an update come from one stateless draw seeded by (config.seed, the trainer's
global step): a resumed run draws the same bits as an uninterrupted one, every replica draws the
same bits (mirrored copies stay identical), and a skipped step draws none. Each variable reads
its own slice of the draw, and each tensor (weight, m, v, momentum) its own 16-bit chunk.

Skipped steps never call the optimizer (trainer/step/train_step.py): weights, slots, compensation
buffers and codes stay bit-identical. Clipping and gradient accumulation happen before the
optimizer on float32 gradients, as with float32 masters.
"""
from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from trainer.step import fused_optimizers
from trainer.step.rounding import (BLOCK, blocks, dequantize, kahan_add, noise, quantize,
                                   random_bits, stochastic_round)


def _tf(variable) -> tf.Variable:
  """The tf.Variable behind a Keras variable (or the variable itself)."""
  return variable.value if isinstance(variable, keras.Variable) else variable


def _low(variable) -> bool:
  return variable.dtype == tf.bfloat16


class _LowPrecision:
  """The update for bfloat16 weights and 8-bit moments, mixed in ahead of a fused optimizer.
  Variables it does not manage (float32 weights with 32-bit state) take the fused update."""

  # The Keras optimizer's (annotations only: no class attributes).
  iterations: tf.Variable
  weight_decay: Any
  _use_weight_decay: Any

  def __init__(self, *args, master_weights: str = 'float32', state_bits: int = 32,
               seed: int = 0, step=None, **kwargs):
    super().__init__(*args, **kwargs)
    self.master_weights = master_weights
    self.state_bits = int(state_bits)
    self.seed = int(seed)
    self._step = step  # the trainer's global step (None: this optimizer's iterations)

  def get_config(self):
    return {**super().get_config(), 'master_weights': self.master_weights,
            'state_bits': self.state_bits, 'seed': self.seed}

  def _managed_variable(self, variable) -> bool:
    raise NotImplementedError

  def _apply_weight_decay(self, variables):
    # The managed variables' decay is part of their float32 update (one rounding, not two).
    super()._apply_weight_decay([v for v in variables if not self._managed[
        self._get_variable_index(v)]])

  def _weight_decay(self, variable) -> float:
    """Keras's decoupled decay rate for `variable` (w -= w * wd * lr), or 0.0."""
    if self.weight_decay is None or not self._use_weight_decay(variable):
      return 0.0
    return float(self.weight_decay)

  def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
    # Keras updates one variable at a time; the managed ones are updated together, in one
    # compiled call per device (see the comment above _adam_updates), the others by the fused
    # update.
    managed = [self._managed[self._get_variable_index(v)] for _, v in grads_and_vars]
    super()._distributed_tf_update_step(
        distribution, [gv for gv, k in zip(grads_and_vars, managed) if not k], learning_rate)
    mine = [gv for gv, k in zip(grads_and_vars, managed) if k]
    if mine:
      # One update call, keyed to the first variable: on each device it runs with every
      # variable's and gradient's copy for that device.
      distribution.extended.update(
          mine[0][1], lambda _, grads, variables, lr: self._update(grads, variables, lr),
          args=([g for g, _ in mine], [v for _, v in mine], learning_rate), group=False)

  def update_step(self, gradient, variable, learning_rate):
    if not self._managed[self._get_variable_index(variable)]:
      return super().update_step(gradient, variable, learning_rate)
    return self._update([gradient], [variable], learning_rate)

  def _update(self, grads, variables, learning_rate):
    """Reads every stored tensor of `variables`, draws the random bits, computes the updates in
    one compiled call and assigns the results."""
    variables = [_tf(v) for v in variables]
    stores = [self._stores(self._get_variable_index(v), v) for v in variables]
    # (A dense gradient of an embedding can lose its static shape; the kernel needs it.)
    items = tuple((tf.ensure_shape(fused_optimizers._dense(g, tf.float32), v.shape),
                   tuple(tuple(tf.convert_to_tensor(_tf(p)) for p in part) for part in store))
                  for g, v, store in zip(grads, variables, stores))
    rules = tuple(self._weight_decay(v) for v in variables)
    sizes = [blocks(int(np.prod(v.shape))) * BLOCK for v in variables]
    step = self.iterations if self._step is None else self._step
    seed = tf.stack([tf.constant(self.seed, tf.int64), tf.cast(step, tf.int64)])
    streams = self._streams()
    bits = (random_bits(seed, sum(sizes), len(streams)) if streams
            else tf.zeros([0], tf.uint32))
    new = self._kernel(items, tf.cast(learning_rate, tf.float32), bits, rules, streams)
    for store, values in zip(stores, new):
      for part, part_values in zip(store, values):
        for v, value in zip(part, part_values):
          _tf(v).assign(value)

  def _stores(self, index, var):
    """The variable's stored parts, in the kernel's order: ((weight[, compensation]), *state)."""
    weight = (var,)
    if index in self._comp_index:
      weight += (self._compensations[self._comp_index[index]],)
    return (weight,) + self._state(index)

  def _state(self, index) -> tuple:
    raise NotImplementedError

  def _streams(self) -> tuple:
    """The tensors that round stochastically, each reading its own 16-bit chunk of the bits."""
    raise NotImplementedError

  def _kernel(self, items, lr, bits, rules, streams):
    raise NotImplementedError

  def _build_compensations(self, variables):
    self._comp_index = {}
    compensations = []
    if self.master_weights == 'bfloat16_kahan':
      for i, v in enumerate(variables):
        if _low(v):
          self._comp_index[i] = len(compensations)
          compensations.append(self.add_variable_from_reference(v, 'compensation'))
    self._compensations = compensations


class _LowPrecisionAdam(_LowPrecision):

  def _managed_variable(self, variable) -> bool:
    return _low(variable) or self.state_bits == 8

  def build(self, variables):
    if self.built:
      return
    if self.amsgrad:
      raise ValueError('amsgrad is not supported with 16-bit master weights or 8-bit state')
    keras.optimizers.Optimizer.build(self, variables)  # iterations, the variable index
    self._managed = [self._managed_variable(v) for v in variables]
    momentums, velocities, m_scales, v_scales = [], [], [], []
    for v in variables:
      if self.state_bits == 8:
        size = int(np.prod(v.shape))
        name = getattr(v, 'path', v.name).replace('/', '_').replace(':', '_')
        for codes, scales, kind in ((momentums, m_scales, 'momentum'),
                                    (velocities, v_scales, 'velocity')):
          codes.append(self.add_variable((blocks(size) * BLOCK,), 'zeros', 'uint8',
                                         name=f'{name}_{kind}_codes'))
          scales.append(self.add_variable((blocks(size),), 'zeros', 'float32',
                                          name=f'{name}_{kind}_absmax'))
      else:  # the variable's own dtype: bfloat16 slots for bfloat16 weights
        momentums.append(self.add_variable_from_reference(v, 'momentum'))
        velocities.append(self.add_variable_from_reference(v, 'velocity'))
    self._momentums, self._velocities = momentums, velocities
    self._momentum_scales, self._velocity_scales = m_scales, v_scales
    self._build_compensations(variables)

  def _state(self, index) -> tuple:
    """Per moment: (codes, absmax) with 8-bit state, else (slot,)."""
    if self.state_bits == 8:
      return ((self._momentums[index], self._momentum_scales[index]),
              (self._velocities[index], self._velocity_scales[index]))
    return (self._momentums[index],), (self._velocities[index],)

  def _streams(self) -> tuple:
    return ('weight',) * (self.master_weights == 'bfloat16_sr') + ('m', 'v')

  def _kernel(self, items, lr, bits, rules, streams):
    step = tf.cast(self.iterations + 1, tf.float32)
    alpha = lr * tf.sqrt(1 - tf.pow(tf.cast(self.beta_2, tf.float32), step)) / (
        1 - tf.pow(tf.cast(self.beta_1, tf.float32), step))
    return _adam_updates(items, lr, alpha, bits, rules, streams, (
        float(self.beta_1), float(self.beta_2), float(self.epsilon), self.master_weights))


class _LowPrecisionSGD(_LowPrecision):
  momentum: float  # Keras SGD's (annotations only)
  momentums: list
  nesterov: bool

  def _managed_variable(self, variable) -> bool:
    return _low(variable)

  def build(self, variables):
    if self.built:
      return
    super().build(variables)  # momentums in each variable's dtype
    self._managed = [self._managed_variable(v) for v in variables]
    self._build_compensations(variables)

  def _state(self, index) -> tuple:
    return () if self.momentum == 0 else ((self.momentums[index],),)

  def _streams(self) -> tuple:
    return (('weight',) * (self.master_weights == 'bfloat16_sr')
            + ('momentum',) * (self.momentum != 0))

  def _kernel(self, items, lr, bits, rules, streams):
    return _sgd_updates(items, lr, bits, rules, streams, (
        float(self.momentum), bool(self.nesterov), self.master_weights))


# The updates are pure functions of the stored tensors, compiled by XLA: one call for every
# managed variable of the model. Unfused, each element-wise op of an update (casts, bit masks; a
# log and gathers per 8-bit moment) is its own pass over memory, and with one compiled call per
# variable the launches would cost more than the math (most variables are small). The random
# bits are drawn before the call (rounding.py says why). The optimizer reads the variables
# before and assigns them after, so a trace depends only on the shapes and the static rules
# (decay rates, hyperparameters).


def _slices(bits, items, streams):
  """Per item, {stream: its 16-bit noise}, each [blocks * BLOCK] (the variable's slice of the
  draw, padded to whole blocks as the 8-bit codes are)."""
  if not streams:
    return [{} for _ in items]
  offset, out = 0, []
  for grad, _ in items:
    size = blocks(int(np.prod(grad.shape))) * BLOCK
    piece = bits[offset:offset + size]
    out.append({name: noise(piece, j) for j, name in enumerate(streams)})
    offset += size
  return out


def _shaped(noise16, like):
  """The first elements of a padded noise slice, in `like`'s shape."""
  return tf.reshape(noise16[:int(np.prod(like.shape))], like.shape)


def _weight32(weight_parts) -> tf.Tensor:
  """The weight in float32: with Kahan compensation, the true weight w + c."""
  weight = tf.cast(weight_parts[0], tf.float32)
  return weight if len(weight_parts) == 1 else weight + tf.cast(weight_parts[1], tf.float32)


def _weight_out(weight_parts, update, noise16, master_weights: str) -> tuple:
  """The new bfloat16 weight parts from the stored ones and a float32 `update`: Kahan's sum, or
  stochastic rounding."""
  if master_weights == 'bfloat16_kahan':
    return kahan_add(weight_parts[0], weight_parts[1], update)
  weight = weight_parts[0]
  return (stochastic_round(tf.cast(weight, tf.float32) + update, _shaped(noise16, weight)),)


def _slot_out(value, like, noise16) -> tf.Tensor:
  """A 32-bit-state slot: float32 as is, bfloat16 rounded stochastically."""
  if like.dtype == tf.bfloat16:
    return stochastic_round(value, _shaped(noise16, like))
  return tf.cast(value, like.dtype)


@tf.function(jit_compile=True, autograph=False)
def _adam_updates(items, lr, alpha, bits, rules, streams, hyper):
  """Adam/AdamW (Keras's formula, term for term, in float32) for each (gradient, (weight parts,
  m parts, v parts)) of `items`: m and v are (codes, absmax) with 8-bit state, else (slot,).
  Returns the new parts in the same structure, without the gradient."""
  beta_1, beta_2, epsilon, master_weights = hyper
  out = []
  for (grad, (weight_parts, m_in, v_in)), weight_decay, rand in zip(
      items, rules, _slices(bits, items, streams)):
    shape = weight_parts[0].shape
    if len(m_in) == 2:
      m = dequantize(*m_in, shape, signed=True)
      v = dequantize(*v_in, shape, signed=False)
    else:
      m, v = tf.cast(m_in[0], tf.float32), tf.cast(v_in[0], tf.float32)
    m = m + (grad - m) * (1 - beta_1)
    v = v + (tf.square(grad) - v) * (1 - beta_2)
    w32 = _weight32(weight_parts)
    decay = -(w32 * weight_decay) * lr if weight_decay else 0.0
    adam = (m * alpha) / (tf.sqrt(v) + epsilon)
    if weight_parts[0].dtype == tf.float32:  # Keras's order: decay first, then the Adam step
      new_weight = ((w32 + decay) - adam,)
    else:
      new_weight = _weight_out(weight_parts, decay - adam, rand.get('weight'), master_weights)
    if len(m_in) == 2:
      moments = (quantize(m, rand['m'], signed=True), quantize(v, rand['v'], signed=False))
    else:
      moments = ((_slot_out(m, m_in[0], rand['m']),), (_slot_out(v, v_in[0], rand['v']),))
    out.append((new_weight,) + moments)
  return tuple(out)


@tf.function(jit_compile=True, autograph=False)
def _sgd_updates(items, lr, bits, rules, streams, hyper):
  """SGD (Keras's formula, in float32) for each (gradient, (weight parts[, (momentum,)])) of
  `items` (bfloat16 weights). Returns the new parts in the same structure."""
  momentum_rate, nesterov, master_weights = hyper
  out = []
  for (grad, parts), weight_decay, rand in zip(
      items, rules, _slices(bits, items, streams)):
    weight_parts = parts[0]
    w32 = _weight32(weight_parts)
    update = -(w32 * weight_decay) * lr if weight_decay else 0.0
    state = ()
    if len(parts) == 1:
      update -= lr * grad
    else:  # Keras: m = -g * lr + m * momentum; w += m (nesterov: w += -g * lr + m * momentum)
      slot = parts[1][0]
      m = -grad * lr + tf.cast(slot, tf.float32) * momentum_rate
      update += (-grad * lr + m * momentum_rate) if nesterov else m
      state = ((_slot_out(m, slot, rand['momentum']),),)
    out.append((_weight_out(weight_parts, update, rand.get('weight'), master_weights),) + state)
  return tuple(out)


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


def requested(config) -> bool:
  """Whether the config asks for 16-bit master weights or 8-bit state."""
  return config.precision.master_weights != 'float32' or config.optimizer.state_bits != 32


def state_bytes(optimizer) -> int:
  """Bytes of the optimizer's per-variable state (every variable but its scalar counters)."""
  return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in optimizer.variables
             if len(v.shape))


def weight_bytes(variables) -> int:
  return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in variables)


def check_optimizer(optimizer, config) -> None:
  """ConfigError when the config asks for 16-bit masters or 8-bit state and `optimizer` (from
  Trainer.build_optimizer) cannot provide them."""
  from trainer.errors import ConfigError  # pylint: disable=import-outside-toplevel
  if requested(config) and not isinstance(optimizer, _LowPrecision):
    raise ConfigError(
        f'config.precision.master_weights={config.precision.master_weights!r} / '
        f'config.optimizer.state_bits={config.optimizer.state_bits} need the optimizer '
        f'Trainer.build_optimizer makes by default; build_optimizer returned '
        f'{type(optimizer).__name__}.')
