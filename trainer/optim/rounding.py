"""The storage formats of training below mixed precision, and the random bits they round with.

  stochastic_round  float32 -> bfloat16, rounded up in magnitude with probability (value - lower
                    neighbour) / gap: 16 random bits are added below bfloat16's mantissa, which
                    is then truncated. The expected stored value is the float32 value, so updates
                    far below a weight's bfloat16 spacing survive on average.
  kahan_add         bfloat16 weight plus bfloat16 compensation: s = w + (c + update) in float32,
                    rounded to nearest for w; what rounding dropped (s - w) is kept in c.
  quantize /        8-bit block codes (one byte per element, a float32 absmax per BLOCK
  dequantize        elements) on the dynamic map of Dettmers et al. ("8-bit Optimizers via
                    Block-wise Quantization", 2022; bitsandbytes' create_dynamic_map, written
                    from its definition): an exponent picks a decade of the absmax (10^-7 to 1),
                    the other bits split it linearly, so a block's largest values, which dominate
                    its error, get the finest steps (a linear code's step absmax/127 flushes
                    small values to zero; a purely logarithmic one had 19 % steps for m).
                    Signed (m): 7 decades of 2^i bins (127 magnitudes) each sign, 0 and 1,
                    rounded to nearest as bitsandbytes does. Unsigned (v): 7 decades of 2^(i+1)
                    bins (254 magnitudes), 0 and 1, rounded stochastically between neighbouring
                    codes (at 16-bit resolution) so the expected value is the float32 value: v's
                    per-step change (1 - beta_2 = 0.1 %) is below a code step, and rounded to
                    nearest v would never decay; a non-zero v below the range rounds up to the
                    smallest code, never to zero (a zero v makes Adam's update m / eps).
                    On Adam's moments after 30 MNIST MLP steps the block RMS error / absmax is
                    0.0031 for m (the reference's, bit for bit) and 0.0020 for v (the
                    reference's nearest rounding: 0.0014); tests/step/test_state_bits.py.

`random_bits` draws one unsigned integer per element with TF's stateless Philox kernel (32 bits
for one or two 16-bit chunks, 64 for three or four); `noise(bits, j)` is chunk j. The rounding
functions take these chunks, not seeds, so that a caller compiled by XLA can take bits drawn
outside it: XLA's own random-number generator on a CPU is tens of times slower than TF's kernel.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

BLOCK = 256  # elements per quantization block
DECADES = 7  # the dynamic map's exponents: magnitudes in [1e-7, 1) of the block's absmax, and 1


def _bins(signed: bool) -> list[int]:
  """Linear bins per decade of the dynamic map, smallest decade first: the sign bit of m leaves
  7 bits, so decade i holds 2^i bins (m) or 2^(i + 1) (v): 127 or 254 magnitudes in all."""
  return [2 ** (i if signed else i + 1) for i in range(DECADES)]


def magnitudes(signed: bool) -> np.ndarray:
  """The dynamic map's magnitudes relative to the block's absmax, ascending: 0, then per decade
  i (values 10^(i-7) to 10^(i-6)) the midpoints of its bins splitting [0.1, 1) x 10^(i-6)
  evenly, then 1 (Dettmers et al., 8-bit Optimizers via Block-wise Quantization, 2022).
  129 values for m, 256 for v."""
  values = [0.0]
  for i, n in enumerate(_bins(signed)):
    edges = np.linspace(0.1, 1.0, n + 1)
    values.extend((10.0 ** (i - DECADES + 1) * (edges[:-1] + edges[1:]) / 2).tolist())
  return np.array(values + [1.0], np.float32)


def codebook(signed: bool) -> np.ndarray:
  """The float32 value of each byte (absmax 1). Unsigned (v): byte k is magnitude k. Signed (m):
  bytes 0-128 are the magnitudes (0 to 1), byte 128 + k is -magnitude k for k = 1..127 (no -1:
  a negative absmax element is stored as -0.993, the nearest)."""
  mags = magnitudes(signed)
  if not signed:
    return mags
  return np.concatenate([mags, -mags[1:128]]).astype(np.float32)


M_CODE = codebook(signed=True)  # 256 values
V_CODE = codebook(signed=False)  # 256 values


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


def _upper_index(a: tf.Tensor, signed: bool) -> tf.Tensor:
  """For magnitudes `a` in [0, 1]: the index in `magnitudes(signed)` of the smallest magnitude
  >= a. The decade from log10, the position from the linear bins, then one correction step each
  way for log10's rounding (XLA-friendly: no search)."""
  table = tf.constant(magnitudes(signed))
  bins = _bins(signed)
  offsets = tf.constant(np.cumsum([1] + bins[:-1]), tf.float32)  # index of each decade's first
  counts = tf.constant(bins, tf.float32)
  decade = tf.floor(tf.math.log(tf.maximum(a, 1e-30)) / np.log(10.0)) + DECADES
  i = tf.cast(tf.clip_by_value(decade, 0.0, DECADES - 1.0), tf.int32)
  n, first = tf.gather(counts, i), tf.gather(offsets, i)
  position = (a / 10.0 ** (tf.cast(i, tf.float32) - DECADES + 1) - 0.1) / 0.9 * n - 0.5
  last = int(np.sum(bins)) + 1  # the index of 1.0
  k = tf.cast(tf.clip_by_value(first + tf.math.ceil(position), 1.0, last), tf.int32)
  k = tf.where(tf.gather(table, k) < a, tf.minimum(k + 1, last), k)
  k = tf.where(tf.gather(table, tf.maximum(k - 1, 0)) >= a, tf.maximum(k - 1, 0), k)
  return tf.where(a > 0, k, 0)


def quantize(x: tf.Tensor, noise16: tf.Tensor, signed: bool) -> tuple[tf.Tensor, tf.Tensor]:
  """float32 tensor -> (uint8 codes [blocks * BLOCK], float32 absmax [blocks]) on the dynamic
  map. Signed (m): to the nearest code, as bitsandbytes does. Unsigned (v, x >= 0): stochastic
  rounding between the two neighbouring codes with `noise16` ([blocks * BLOCK] int32 in
  [0, 2^16)), unbiased, and a non-zero value below the smallest code rounds up to it."""
  table = tf.constant(magnitudes(signed))
  flat = tf.reshape(tf.cast(x, tf.float32), [-1])
  n = int(np.prod(x.shape))
  flat = tf.reshape(tf.pad(flat, [[0, blocks(n) * BLOCK - n]]), [blocks(n), BLOCK])
  absmax = tf.reduce_max(tf.abs(flat), axis=1)
  a = tf.minimum(tf.math.divide_no_nan(tf.abs(flat), absmax[:, None]), 1.0)  # in [0, 1]
  k = _upper_index(a, signed)
  upper, lower = tf.gather(table, k), tf.gather(table, tf.maximum(k - 1, 0))
  if signed:
    code = tf.where(a - lower < upper - a, tf.maximum(k - 1, 0), k)
    code = tf.where(flat < 0, tf.minimum(code, 127), code)  # -1 is not a code: -0.993
    code = tf.where((flat < 0) & (code > 0), code + 128, code)
  else:
    p_lower = tf.clip_by_value(tf.math.divide_no_nan(upper - a, upper - lower), 0.0, 1.0)
    p_lower = tf.where(k == 1, 0.0, p_lower)  # below the range: round up, never to zero
    u = (tf.cast(tf.reshape(noise16, tf.shape(a)), tf.float32) + 0.5) * 2.0**-16  # in (0, 1)
    code = tf.where(u < p_lower, k - 1, k)
  return tf.cast(tf.reshape(code, [-1]), tf.uint8), absmax


def dequantize(
  codes: tf.Tensor, absmax: tf.Tensor, shape: tf.TensorShape | Sequence[int], signed: bool
) -> tf.Tensor:
  """(uint8 codes, float32 absmax per block) -> float32 tensor of `shape`."""
  table = tf.constant(M_CODE if signed else V_CODE)
  values = tf.reshape(tf.gather(table, tf.cast(codes, tf.int32)), [-1, BLOCK]) * absmax[:, None]
  size = int(np.prod(shape))
  return tf.reshape(tf.reshape(values, [-1])[:size], shape)
