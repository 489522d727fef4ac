"""Training below mixed precision: 16-bit master weights and 8-bit Adam state.

`config.precision.master_weights` (mixed_bfloat16 only; Adam, AdamW, SGD):
  'float32'         the model's variables are float32 (every other policy's behaviour).
  'bfloat16_sr'     the model's variables and the optimizer's slots are bfloat16. Each update is
                    computed in float32 from the stored values and rounded to bfloat16
                    stochastically: uniform random bits below bfloat16's mantissa (the low 16 bits
                    of the float32 pattern) are added to the float32 bit pattern, which is then
                    truncated. A value between two bfloat16 neighbours rounds to the upper one
                    with probability equal to its distance from the lower one over their gap, so
                    the expected stored value is the float32 value: updates far below a weight's
                    bfloat16 spacing (lr x Adam step, about 1e-3 relative) survive on average
                    instead of rounding away.
  'bfloat16_kahan'  bfloat16 weights plus a bfloat16 compensation buffer per weight: the float32
                    sum s = w + (c + update) is rounded to nearest for w, and the remainder
                    s - w (what rounding dropped) is kept in c for the next update. The slots
                    (moments, momentum) are bfloat16 with stochastic rounding as above.
The random bits come from a stateless RNG seeded by (config.seed, the trainer's global step, the
variable's index, which tensor), so a resumed run draws the same bits as an uninterrupted one,
every replica draws the same bits (mirrored copies stay identical), and a skipped step draws none.
Variables a model keeps float32 under these modes (a layer with dtype='float32', such as the
logits, or config.precision.float32_layers) keep float32 weights and the plain update.

`config.optimizer.state_bits=8` (Adam, AdamW; any master_weights): each moment is stored as one
byte per element in blocks of 256 elements with a float32 absmax scale per block (1 + 4/256
bytes per element, against 4). The code of both moments is logarithmic (a dynamic code: constant
relative precision over the range, as bitsandbytes' dynamic code; a linear code's absolute step
absmax/127 flushes every element below it to zero, and v spans many decades within a block):
  m  signed: a sign bit and 127 magnitudes 2^(-k/4) x absmax, k = 0..126, plus zero
     (relative step 19 %, range 2^-31.5);
  v  unsigned: 255 magnitudes 2^(-k/8) x absmax, k = 0..254, plus zero
     (relative step 9 %, range 2^-31.75); v is what the update divides by, so it gets the finer
     code; a non-zero v below the range rounds up to the smallest code, never to zero (a zero v
     would make the update m / epsilon).
Each value is rounded stochastically between its two neighbouring codes (probability by linear
distance, so the expected dequantized value is the float32 value; with round-to-nearest, v's
per-step change of (1 - beta_2) = 0.1 % is far below a code step and v would never decay).
The update dequantizes, computes in float32 exactly as Keras's Adam, and requantizes.

Skipped steps never call the optimizer (trainer/step/train_step.py): weights, slots, compensation
buffers and codes stay bit-identical. Clipping and gradient accumulation happen before the
optimizer on float32 gradients, as with float32 masters.
"""
from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from trainer.step import fused_optimizers

BLOCK = 256  # elements per quantization block
M_LEVELS, V_LEVELS = 127, 255  # non-zero magnitudes of each code
M_RATIO, V_RATIO = 4, 8  # magnitudes 2^(-k / ratio)
# Streams of the RNG per variable (folded into the seed with the variable's index).
_WEIGHT, _M, _V, _MOMENTUM = 0, 1, 2, 3


def codebook(levels: int, ratio: int, signed: bool) -> np.ndarray:
  """The float32 value of each byte (absmax 1): unsigned byte k < levels is 2^(-k/ratio), byte
  `levels` is 0; signed: bit 7 is the sign of the unsigned 7-bit code."""
  magnitudes = np.append(2.0 ** (-np.arange(levels) / ratio), 0.0).astype(np.float32)
  if not signed:
    return magnitudes
  return np.concatenate([magnitudes, -magnitudes]).astype(np.float32)


M_CODE = codebook(M_LEVELS, M_RATIO, signed=True)  # 256 values
V_CODE = codebook(V_LEVELS, V_RATIO, signed=False)  # 256 values


def stochastic_round(x: tf.Tensor, seed: tf.Tensor) -> tf.Tensor:
  """float32 -> bfloat16, rounded up in magnitude with probability (x - down) / (up - down).

  Uniform random integers in [0, 2^16) are added to the float32 bit pattern and the low 16 bits
  are cleared; the result is exactly representable in bfloat16. Finite inputs only (the step
  never applies a non-finite update)."""
  bits = tf.bitcast(tf.cast(x, tf.float32), tf.int32)
  noise = tf.random.stateless_uniform(tf.shape(bits), seed, minval=0, maxval=1 << 16,
                                      dtype=tf.int32)
  return tf.cast(tf.bitcast(tf.bitwise.bitwise_and(bits + noise, -65536), tf.float32),
                 tf.bfloat16)


def kahan_add(weight: tf.Tensor, compensation: tf.Tensor, update: tf.Tensor):
  """(new weight, new compensation), both bfloat16: s = w + (c + update) in float32, w' = s
  rounded to nearest, c' = s - w' rounded to nearest."""
  total = tf.cast(weight, tf.float32) + (tf.cast(compensation, tf.float32) + update)
  new = tf.cast(total, tf.bfloat16)
  return new, tf.cast(total - tf.cast(new, tf.float32), tf.bfloat16)


def blocks(size: int) -> int:
  return -(-size // BLOCK)


def quantize(x: tf.Tensor, seed: tf.Tensor, signed: bool):
  """float32 tensor -> (uint8 codes [blocks * 256], float32 absmax [blocks]), rounded
  stochastically between neighbouring codes (unbiased). Unsigned: x >= 0, and a non-zero value
  below the smallest code rounds up to it."""
  levels, ratio = (M_LEVELS, M_RATIO) if signed else (V_LEVELS, V_RATIO)
  table = tf.constant(codebook(levels, ratio, signed=False))  # magnitudes, then 0
  flat = tf.reshape(tf.cast(x, tf.float32), [-1])
  n = tf.size(flat)
  nb = (n + BLOCK - 1) // BLOCK
  flat = tf.reshape(tf.pad(flat, [[0, nb * BLOCK - n]]), [nb, BLOCK])
  absmax = tf.reduce_max(tf.abs(flat), axis=1)
  r = tf.math.divide_no_nan(tf.abs(flat), absmax[:, None])  # in [0, 1]
  # The code above r (larger magnitude): k = floor(-ratio * log2 r), clipped to the range.
  t = -ratio * tf.math.log(tf.maximum(r, 1e-38)) / np.log(2.0)
  k = tf.cast(tf.clip_by_value(tf.floor(t), 0.0, levels - 1.0), tf.int32)
  upper = tf.gather(table, k)
  k = tf.where(upper < r, tf.maximum(k - 1, 0), k)  # log's rounding: keep upper >= r
  upper = tf.gather(table, k)
  lower = tf.gather(table, k + 1)  # the next smaller magnitude; k + 1 = levels is zero
  p_lower = tf.clip_by_value(tf.math.divide_no_nan(upper - r, upper - lower), 0.0, 1.0)
  if not signed:  # below the range: round up, never to zero
    p_lower = tf.where(k + 1 == levels, 0.0, p_lower)
  u = tf.random.stateless_uniform(tf.shape(r), seed, dtype=tf.float32)
  code = tf.where(u < p_lower, k + 1, k)
  code = tf.where(r == 0.0, levels, code)
  if signed:
    code = code + tf.where(flat < 0, 128, 0)
  return tf.cast(tf.reshape(code, [-1]), tf.uint8), absmax


def dequantize(codes: tf.Tensor, absmax: tf.Tensor, shape, signed: bool) -> tf.Tensor:
  """(uint8 codes, float32 absmax per block) -> float32 tensor of `shape`."""
  table = tf.constant(M_CODE if signed else V_CODE)
  values = tf.reshape(tf.gather(table, tf.cast(codes, tf.int32)), [-1, BLOCK]) * absmax[:, None]
  size = int(np.prod(shape))
  return tf.reshape(tf.reshape(values, [-1])[:size], shape)


def _tf(variable) -> tf.Variable:
  """The tf.Variable behind a Keras variable (or the variable itself)."""
  return variable.value if isinstance(variable, keras.Variable) else variable


def _low(variable) -> bool:
  return variable.dtype == tf.bfloat16


class _LowPrecision:
  """The update for bfloat16 weights and 8-bit moments, mixed in ahead of a fused optimizer.
  Variables it does not manage (float32 weights with 32-bit state) take the fused update."""

  iterations: tf.Variable  # the Keras optimizer's (an annotation only: no class attribute)

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

  def _rng(self, index: int, stream: int) -> tf.Tensor:
    step = self.iterations if self._step is None else self._step
    seed = tf.stack([tf.constant(self.seed, tf.int64), tf.cast(step, tf.int64)])
    seed = tf.random.experimental.stateless_fold_in(seed, index)
    return tf.random.experimental.stateless_fold_in(seed, stream)

  def _managed_variable(self, variable) -> bool:
    raise NotImplementedError

  def _apply_weight_decay(self, variables):
    # The managed variables' decay is part of their float32 update (one rounding, not two).
    super()._apply_weight_decay([v for v in variables if not self._managed[
        self._get_variable_index(v)]])

  def _decay(self, variable, weight32, learning_rate):
    """The decoupled weight decay's term of the update (Keras: w -= w * wd * lr), float32."""
    if self.weight_decay is None or not self._use_weight_decay(variable):
      return 0.0
    return -(weight32 * tf.cast(self.weight_decay, tf.float32)) * learning_rate

  def _weight32(self, index, var):
    """The weight in float32: with Kahan compensation, the true weight w + c."""
    weight = tf.cast(var, tf.float32)
    if index in self._comp_index:
      weight += tf.cast(self._compensations[self._comp_index[index]], tf.float32)
    return weight

  def _store_weight(self, index, var, weight32, update):
    """weight32 + update, stored in var's format (bfloat16: stochastic or Kahan)."""
    if var.dtype == tf.float32:
      var.assign(weight32 + update)
    elif self.master_weights == 'bfloat16_kahan':
      comp = _tf(self._compensations[self._comp_index[index]])
      new, residual = kahan_add(var, comp, update)
      var.assign(new)
      comp.assign(residual)
    else:
      var.assign(stochastic_round(weight32 + update, self._rng(index, _WEIGHT)))

  def _store_slot(self, index, stream, slot, value):
    """A 32-bit-state slot: float32 as is, bfloat16 rounded stochastically."""
    slot = _tf(slot)
    if slot.dtype == tf.bfloat16:
      slot.assign(stochastic_round(value, self._rng(index, stream)))
    else:
      slot.assign(tf.cast(value, slot.dtype))

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

  def update_step(self, gradient, variable, learning_rate):
    index = self._get_variable_index(variable)
    if not self._managed[index]:
      return super().update_step(gradient, variable, learning_rate)
    var = _tf(variable)
    grad = fused_optimizers._dense(gradient, tf.float32)
    lr = tf.cast(learning_rate, tf.float32)
    step = tf.cast(self.iterations + 1, tf.float32)
    alpha = lr * tf.sqrt(1 - tf.pow(tf.cast(self.beta_2, tf.float32), step)) / (
        1 - tf.pow(tf.cast(self.beta_1, tf.float32), step))
    shape = var.shape
    if self.state_bits == 8:
      m = dequantize(_tf(self._momentums[index]), _tf(self._momentum_scales[index]), shape,
                     signed=True)
      v = dequantize(_tf(self._velocities[index]), _tf(self._velocity_scales[index]), shape,
                     signed=False)
    else:
      m = tf.cast(self._momentums[index], tf.float32)
      v = tf.cast(self._velocities[index], tf.float32)
    # Keras's Adam, term for term, in float32.
    m = m + (grad - m) * (1 - self.beta_1)
    v = v + (tf.square(grad) - v) * (1 - self.beta_2)
    weight = self._weight32(index, var)
    decay = self._decay(variable, weight, lr)
    adam = (m * alpha) / (tf.sqrt(v) + self.epsilon)
    if var.dtype == tf.float32:  # Keras's order: decay first, then the Adam step
      var.assign((weight + decay) - adam)
    else:
      self._store_weight(index, var, tf.cast(var, tf.float32), decay - adam)
    if self.state_bits == 8:
      for codes_var, scale_var, value, stream, signed in (
          (self._momentums[index], self._momentum_scales[index], m, _M, True),
          (self._velocities[index], self._velocity_scales[index], v, _V, False)):
        codes, absmax = quantize(value, self._rng(index, stream), signed)
        _tf(codes_var).assign(codes)
        _tf(scale_var).assign(absmax)
    else:
      self._store_slot(index, _M, self._momentums[index], m)
      self._store_slot(index, _V, self._velocities[index], v)


class _LowPrecisionSGD(_LowPrecision):

  def _managed_variable(self, variable) -> bool:
    return _low(variable)

  def build(self, variables):
    if self.built:
      return
    super().build(variables)  # momentums in each variable's dtype
    self._managed = [self._managed_variable(v) for v in variables]
    self._build_compensations(variables)

  def update_step(self, gradient, variable, learning_rate):
    index = self._get_variable_index(variable)
    if not self._managed[index]:
      return super().update_step(gradient, variable, learning_rate)
    var = _tf(variable)
    grad = fused_optimizers._dense(gradient, tf.float32)
    lr = tf.cast(learning_rate, tf.float32)
    weight = self._weight32(index, var)
    update = self._decay(variable, weight, lr)
    if self.momentum == 0:
      update -= lr * grad
    else:  # Keras: m = -g * lr + m * momentum; w += m (nesterov: w += -g * lr + m * momentum)
      momentum = tf.cast(self.momentum, tf.float32)
      m = -grad * lr + tf.cast(self.momentums[index], tf.float32) * momentum
      update += (-grad * lr + m * momentum) if self.nesterov else m
      self._store_slot(index, _MOMENTUM, self.momentums[index], m)
    self._store_weight(index, var, tf.cast(var, tf.float32), update)


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
