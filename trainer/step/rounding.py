"""The storage formats of training below mixed precision, and the random bits they round with.

  stochastic_round  float32 -> bfloat16, rounded up in magnitude with probability equal to the
                    value's distance from the lower neighbour over the gap: 16 uniform random
                    bits are added to the float32 bit pattern below bfloat16's mantissa, which
                    is then truncated. The expected stored value is the float32 value, so
                    updates far below a weight's bfloat16 spacing survive on average.
  kahan_add         bfloat16 weight plus a bfloat16 compensation: the float32 sum s = w + (c +
                    update) is rounded to nearest for w, and what rounding dropped (s - w) is
                    kept in c.
  quantize /        8-bit block codes: one byte per element, in blocks of BLOCK elements with a
  dequantize        float32 absmax per block. Logarithmic (dynamic) codes: constant relative
                    precision over the range, as bitsandbytes' dynamic code (a linear code's
                    step absmax/127 flushes every element below it to zero, and Adam's v spans
                    many decades within a block):
                      signed (m): a sign bit and 127 magnitudes 2^(-k/4) x absmax, plus zero;
                      unsigned (v): 255 magnitudes 2^(-k/8) x absmax, plus zero; a non-zero
                      value below the range rounds up to the smallest code, never to zero (a
                      zero v would make Adam's update m / epsilon).
                    Values round stochastically between their two neighbouring codes
                    (probability by linear distance, at 16-bit resolution), so the expected
                    dequantized value is the float32 value: with round-to-nearest, v's per-step
                    change of (1 - beta_2) = 0.1 % is far below a code step and v would never
                    decay.

Random bits: `random_bits` draws one unsigned integer per element with TF's stateless Philox
kernel, 32 bits when one or two 16-bit chunks are needed, 64 bits for three or four;
`noise(bits, j)` is chunk j. The rounding functions take these 16-bit chunks, not seeds, so that
a caller compiled by XLA can take bits drawn outside it: XLA's own random-number generator on a
CPU is tens of times slower than TF's kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

BLOCK = 256  # elements per quantization block
M_LEVELS, V_LEVELS = 127, 255  # non-zero magnitudes of each code
M_RATIO, V_RATIO = 4, 8  # magnitudes 2^(-k / ratio)


def codebook(levels: int, ratio: int, signed: bool) -> np.ndarray:
  """The float32 value of each byte (absmax 1): unsigned byte k < levels is 2^(-k/ratio), byte
  `levels` is 0; signed: bit 7 is the sign of the unsigned 7-bit code."""
  magnitudes = np.append(2.0 ** (-np.arange(levels) / ratio), 0.0).astype(np.float32)
  if not signed:
    return magnitudes
  return np.concatenate([magnitudes, -magnitudes]).astype(np.float32)


M_CODE = codebook(M_LEVELS, M_RATIO, signed=True)  # 256 values
V_CODE = codebook(V_LEVELS, V_RATIO, signed=False)  # 256 values


def random_bits(seed: tf.Tensor, size: int, chunks: int) -> tf.Tensor:
  """[size] uniform random integers holding `chunks` (at most 4) 16-bit chunks each."""
  if not 1 <= chunks <= 4:
    raise ValueError(f'random_bits: chunks={chunks}, must be 1 to 4')
  dtype = tf.uint32 if chunks <= 2 else tf.uint64
  return tf.random.stateless_uniform(
    [size], seed, minval=None, maxval=None, dtype=dtype, alg='philox'
  )


def noise(bits: tf.Tensor, chunk: int) -> tf.Tensor:
  """Chunk `chunk` of `bits`: int32 uniform in [0, 2^16)."""
  return tf.cast(
    tf.bitwise.bitwise_and(
      tf.bitwise.right_shift(bits, 16 * chunk), tf.constant(0xFFFF, bits.dtype)
    ),
    tf.int32,
  )


def stochastic_round(x: tf.Tensor, noise16: tf.Tensor) -> tf.Tensor:
  """float32 -> bfloat16, rounded up in magnitude with probability (x - down) / (up - down).

  `noise16` (x's shape, int32 in [0, 2^16)) is added to the float32 bit pattern and the low 16
  bits are cleared; the result is exactly representable in bfloat16. Finite inputs only (the
  step never applies a non-finite update)."""
  bits = tf.bitcast(tf.cast(x, tf.float32), tf.int32)
  return tf.cast(
    tf.bitcast(tf.bitwise.bitwise_and(bits + noise16, -65536), tf.float32), tf.bfloat16
  )


def kahan_add(
  weight: tf.Tensor, compensation: tf.Tensor, update: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
  """(new weight, new compensation), both bfloat16: s = w + (c + update) in float32, w' = s
  rounded to nearest, c' = s - w' rounded to nearest."""
  total = tf.cast(weight, tf.float32) + (tf.cast(compensation, tf.float32) + update)
  new = tf.cast(total, tf.bfloat16)
  return new, tf.cast(total - tf.cast(new, tf.float32), tf.bfloat16)


def blocks(size: int) -> int:
  return -(-size // BLOCK)


def quantize(x: tf.Tensor, noise16: tf.Tensor, signed: bool) -> tuple[tf.Tensor, tf.Tensor]:
  """float32 tensor -> (uint8 codes [blocks * BLOCK], float32 absmax [blocks]), rounded
  stochastically between neighbouring codes (unbiased) with `noise16` ([blocks * BLOCK] int32
  in [0, 2^16)). Unsigned: x >= 0, and a non-zero value below the smallest code rounds up to
  it."""
  levels, ratio = (M_LEVELS, M_RATIO) if signed else (V_LEVELS, V_RATIO)
  table = tf.constant(codebook(levels, ratio, signed=False))  # magnitudes, then 0
  flat = tf.reshape(tf.cast(x, tf.float32), [-1])
  n = int(np.prod(x.shape))
  flat = tf.reshape(tf.pad(flat, [[0, blocks(n) * BLOCK - n]]), [blocks(n), BLOCK])
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
  u = (tf.cast(tf.reshape(noise16, tf.shape(r)), tf.float32) + 0.5) * 2.0**-16  # in (0, 1)
  code = tf.where(u < p_lower, k + 1, k)
  code = tf.where(r == 0.0, levels, code)
  if signed:
    code = code + tf.where(flat < 0, 128, 0)
  return tf.cast(tf.reshape(code, [-1]), tf.uint8), absmax


def dequantize(
  codes: tf.Tensor, absmax: tf.Tensor, shape: tf.TensorShape | Sequence[int], signed: bool
) -> tf.Tensor:
  """(uint8 codes, float32 absmax per block) -> float32 tensor of `shape`."""
  table = tf.constant(M_CODE if signed else V_CODE)
  values = tf.reshape(tf.gather(table, tf.cast(codes, tf.int32)), [-1, BLOCK]) * absmax[:, None]
  size = int(np.prod(shape))
  return tf.reshape(tf.reshape(values, [-1])[:size], shape)
