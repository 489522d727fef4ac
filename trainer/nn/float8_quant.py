"""Float8 quantize-dequantize, bit-exact to the formats, with the scales each recipe defines.

`qdq(x, fmt, scaling, axis)` returns x (bfloat16 or float32) as a float8 GEMM would see it, in
float32: scaled, saturated, rounded to nearest even into `fmt` (e4m3fn or e5m2, OCP 8-bit
floating point spec) and scaled back, in TF ops that run inside the compiled step (TF's float8
casts round to nearest even, as ml_dtypes does, eagerly, in a graph and under XLA).

The scalings (one per recipe, trainer/nn/float8_recipes.py):
  * 'tensor': one scale, fmax / amax (torchao's tensorwise, Transformer Engine's current
    scaling); the amax is clamped to 1e-12 first (torchao's EPS).
  * 'axis': one scale per slice along `axis` (the GEMM's contraction axis), fmax / amax rounded
    down to a power of two (torchao's rowwise recipe).
  * 'block': 32-element blocks along `axis` with a power-of-two E8M0 scale each, OCP Microscaling
    (MX) spec v1.0 section 6.3: X = 2^(floor(log2(amax)) - emax_elem), clamped to E8M0's
    [2^-127, 2^127]; elements x / X saturated into the format. A ragged tail (a batch axis) is
    padded with zeros, which change no block's amax.
  * 'block_rceil': the same blocks with torchao's RCEIL scale (NVIDIA's MX rounding):
    X = 2^ceil(log2(amax / fmax)), rounded up, so no element saturates (the spec's floor cuts a
    block maximum whose mantissa is above fmax's, 1.75 for e4m3).
Invariants, shared with the NumPy reference in tests/nn/test_float8_quant.py:
  * saturation: finite values beyond the format's largest magnitude become +-fmax; inf and NaN
    are not finite values and stay non-finite (e4m3fn has no inf: inf becomes NaN).
  * a NaN counts as an infinite amax, so a non-finite value poisons its whole tensor, row or
    block (scale 0, or X = NaN): a loss-scaling overflow is never hidden by float8 (XLA's max
    ignores NaN, TF's eager max does not; mapping NaN to inf makes both agree).
  * TF's CPU kernels flush float32 subnormals (below 2^-126) to zero: far below float8's anyway.
"""

from __future__ import annotations

import functools

import ml_dtypes
import tensorflow as tf
from tensorflow.python.framework import dtypes as tf_dtypes

FORMATS = {  # name: (TF dtype, largest finite value, MX emax_elem: exponent of the largest normal)
  'e4m3fn': (tf_dtypes.float8_e4m3fn, float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max), 8),
  'e5m2': (tf_dtypes.float8_e5m2, float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).max), 15),
}
SCALINGS = ('tensor', 'axis', 'block', 'block_rceil')
BLOCK = 32  # MX block size (OCP MX spec: k = 32)
EPS = 1e-12  # amax floor of the tensor and axis scalings (torchao's EPS)
E8M0_MIN, E8M0_MAX = -127, 127  # E8M0's exponents (255 is its NaN)


def amax(x: tf.Tensor, axis=None) -> tf.Tensor:
  """max |x| over `axis` (keepdims), NaN counted as inf (see the module docstring)."""
  magnitude = tf.where(tf.math.is_nan(x), tf.constant(float('inf'), x.dtype), tf.abs(x))
  return tf.reduce_max(magnitude, axis=axis, keepdims=axis is not None)


def cast_saturated(x: tf.Tensor, fmt: str) -> tf.Tensor:
  """float32 x rounded to nearest even into `fmt` with finite values saturated at +-fmax, back in
  float32 (exact: every float8 value is a float32)."""
  fmax = FORMATS[fmt][1]
  return rounded(tf.where(tf.math.is_finite(x), tf.clip_by_value(x, -fmax, fmax), x), fmt)


def rounded(x: tf.Tensor, fmt: str) -> tf.Tensor:
  """float32 x rounded to nearest even into `fmt` and back, not saturated: cast_saturated's
  result wherever |x| < fmax * (1 + 1/28), which rounds to +-fmax (e4m3fn: fmax = 448, the step
  above it would be 480, its NaN; e5m2: fmax = 57344, the step above it 65536, its inf); beyond
  that, e4m3fn gives NaN and e5m2 inf."""
  return tf.cast(tf.cast(x, FORMATS[fmt][0]), tf.float32)


def pow2_floor(s: tf.Tensor) -> tf.Tensor:
  """The largest power of two <= s for finite positive normal float32 s (the mantissa bits
  cleared); 0, inf and NaN stay as they are."""
  bits = tf.bitwise.bitwise_and(tf.bitcast(s, tf.int32), tf.constant(-(1 << 23), tf.int32))
  return tf.where(tf.math.is_finite(s), tf.bitcast(bits, tf.float32), s)


def current_scale(a: tf.Tensor, fmt: str, power_of_two: bool) -> tf.Tensor:
  """fmax / max(amax, EPS) in float32 (0 for an infinite amax), rounded down to a power of two
  when `power_of_two`."""
  scale = FORMATS[fmt][1] / tf.maximum(a, EPS)
  return pow2_floor(scale) if power_of_two else scale


def mx_exponent(a: tf.Tensor, fmt: str, rceil: bool = False) -> tf.Tensor:
  """The MX shared scale's exponent, clamp(floor(log2(amax)) - emax_elem, -127, 127) (int32):
  X = 2^e, an E8M0 value. floor(log2) of a float32 is its unbiased exponent field (a zero or
  subnormal amax reads -127, already below the clamp; a non-finite amax is handled by the
  caller)."""
  if rceil:  # torchao's RCEIL (NVIDIA's): ceil(log2(amax / fmax)), so no element saturates
    bits = tf.bitcast(a / FORMATS[fmt][1], tf.int32)
    up = tf.cast(tf.bitwise.bitwise_and(bits, (1 << 23) - 1) != 0, tf.int32)
    return tf.clip_by_value(tf.bitwise.right_shift(bits, 23) - 127 + up, E8M0_MIN, E8M0_MAX)
  field = tf.bitwise.right_shift(tf.bitcast(a, tf.int32), 23) - 127
  return tf.clip_by_value(field - FORMATS[fmt][2], E8M0_MIN, E8M0_MAX)


def mx_inverse_scale(a: tf.Tensor, fmt: str, rceil: bool = False) -> tf.Tensor:
  """1 / X = 2^-e as float32 (normal: -e <= 127, and e <= 119 for any float32 amax), NaN where the
  amax is not finite (the OCP MX spec's NaN scale). Dividing by 2^-e instead of multiplying by
  X keeps X = 2^-127, a float32 subnormal that TF's CPU kernels read as 0, out of the math."""
  inverse = tf.bitcast(tf.bitwise.left_shift(127 - mx_exponent(a, fmt, rceil), 23), tf.float32)
  return tf.where(tf.math.is_finite(a), inverse, tf.constant(float('nan'), tf.float32))


def scaled(x: tf.Tensor, fmt: str, scaling: str, axis: int = -1):
  """(x times its scales in float32, the function taking quantized values back to x's layout
  and magnitude) for `scaling` ('tensor', 'axis' or 'block' along `axis`)."""
  x = tf.cast(x, tf.float32)
  if scaling.startswith('block'):
    return _scaled_blocks(x, fmt, axis, rceil=scaling == 'block_rceil')
  if scaling == 'tensor':
    scale = current_scale(amax(x), fmt, power_of_two=False)
  elif scaling == 'axis':
    scale = current_scale(amax(x, axis), fmt, power_of_two=True)
  else:
    raise ValueError(f'float8 scaling {scaling!r}: must be one of {", ".join(SCALINGS)}')
  return x * scale, lambda q: q / scale


def qdq(x: tf.Tensor, fmt: str, scaling: str, axis: int = -1) -> tf.Tensor:
  """x quantized to `fmt` with `scaling` ('tensor', 'axis' or 'block' along `axis`) and
  dequantized, in float32."""
  y, back = scaled(x, fmt, scaling, axis)
  # The tensor and axis scales keep every finite |y| <= fmax * (1 + 2^-23): scale <= fmax / amax
  # rounded once (the axis scale rounded down to a power of two on top), |x| <= amax, the product
  # rounded once. So saturating first would change no bit (`rounded`), and 4 of the chain's
  # element-wise passes go. An MX block's x / X reaches 2^(emax + 1) > fmax: it must saturate.
  return back(cast_saturated(y, fmt) if scaling.startswith('block') else rounded(y, fmt))


@functools.cache
def fused(fmt: str, scaling: str, axis: int = -1):
  """`qdq` with these arguments as one XLA computation (jit_compile, one compilation per input
  shape): its element-wise chain fused into a few passes instead of one op, one pass and one
  buffer each, in a step that is not compiled with XLA (inside one, it is inlined). Bit for bit
  `qdq` (tests/nn/test_float8_quant.py compares both with the reference, eagerly and under XLA).
  The GEMMs stay outside: their products are what they were."""
  return tf.function(
    lambda x: qdq(x, fmt, scaling, axis), jit_compile=True, autograph=False, reduce_retracing=True
  )


def counts(x: tf.Tensor, fmt: str, scaling: str, axis: int = -1) -> tf.Tensor:
  """[saturated, flushed, nonzero] element counts (float32) of x's quantization: finite scaled
  values beyond the format's largest; nonzero values that became zero (the MX padding is zero)."""
  y, _ = scaled(x, fmt, scaling, axis)
  q = cast_saturated(y, fmt)
  nonzero = tf.not_equal(y, 0.0)
  saturated = tf.math.is_finite(y) & (tf.abs(y) > FORMATS[fmt][1])
  flags = [saturated, nonzero & tf.equal(q, 0.0), nonzero]
  return tf.stack([tf.reduce_sum(tf.cast(f, tf.float32)) for f in flags])


def _scaled_blocks(x: tf.Tensor, fmt: str, axis: int, rceil: bool = False):
  """MX: `axis` moved last, zero-padded to whole blocks of 32, one E8M0 scale per block. Both
  scalings are exact (powers of two), but for results below 2^-126, which TF flushes to zero."""
  rank = x.shape.rank
  axis %= rank
  perm = [i for i in range(rank) if i != axis] + [axis]
  back = [perm.index(i) for i in range(rank)]
  moved = tf.transpose(x, perm) if axis != rank - 1 else x
  shape = tf.shape(moved)
  n = shape[-1]
  pad = (-n) % BLOCK
  padded = tf.pad(moved, [[0, 0]] * (rank - 1) + [[0, pad]])
  blocks = tf.reshape(padded, tf.concat([shape[:-1], [(n + pad) // BLOCK, BLOCK]], 0))
  inverse = mx_inverse_scale(amax(blocks, -1), fmt, rceil)

  def unscale(q):
    out = tf.reshape(q / inverse, tf.concat([shape[:-1], [n + pad]], 0))[..., :n]
    return tf.transpose(out, back) if axis != rank - 1 else out

  return blocks * inverse, unscale
