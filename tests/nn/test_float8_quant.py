"""trainer/nn/float8_quant.py against a NumPy reference of the OCP float8 and MX specs built on
ml_dtypes (float8_e4m3fn, float8_e5m2, float8_e8m0fnu): bit for bit, on 10^6 random values per
format and scaling (float32 and bfloat16 inputs, eagerly and under XLA) and on the edge cases."""

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from trainer.nn import float8_quant as fq

DTYPES = {'e4m3fn': ml_dtypes.float8_e4m3fn, 'e5m2': ml_dtypes.float8_e5m2}
EMAX = {'e4m3fn': 8, 'e5m2': 15}  # exponent of each format's largest normal (OCP MX spec)


# ---- the reference ------------------------------------------------------------------------------


def ref_cast(x, fmt):
  """Saturate finite values at +-fmax, then ml_dtypes' round-to-nearest-even cast."""
  fmax = float(ml_dtypes.finfo(DTYPES[fmt]).max)
  x = np.where(np.isfinite(x), np.clip(x, -fmax, fmax), x).astype(np.float32)
  return x.astype(DTYPES[fmt]).astype(np.float32)


def ref_amax(x, axis=None):
  return np.max(np.where(np.isnan(x), np.inf, np.abs(x)), axis=axis, keepdims=axis is not None)


def ftz(x):
  """TF's CPU kernels flush float32 subnormal results to zero (the sign kept)."""
  return np.where(np.abs(x) < 2.0**-126, np.copysign(np.float32(0), x), x).astype(np.float32)


def ref_qdq(x, fmt, scaling, axis=-1):
  x = np.asarray(x, np.float32)
  fmax = np.float32(ml_dtypes.finfo(DTYPES[fmt]).max)
  if scaling in ('tensor', 'axis'):
    a = ref_amax(x, None if scaling == 'tensor' else axis)
    scale = (fmax / np.maximum(a, np.float32(1e-12))).astype(np.float32)  # float32 division
    if scaling == 'axis':  # rounded down to a power of two
      with np.errstate(divide='ignore'):
        scale = np.exp2(np.floor(np.log2(scale.astype(np.float64)))).astype(np.float32)
    with np.errstate(invalid='ignore'):  # inf * 0, 0 / 0: the poisoned tensor or row
      return ref_cast(x * scale, fmt) / scale
  moved = np.moveaxis(x, axis, -1)
  n = moved.shape[-1]
  padded = np.concatenate([moved, np.zeros((*moved.shape[:-1], -n % 32), np.float32)], -1)
  blocks = padded.reshape(*moved.shape[:-1], -1, 32)
  scale = ref_mx_scale(ref_amax(blocks, -1), fmt, scaling == 'block_rceil').astype(np.float64)
  out = ref_cast((blocks / scale).astype(np.float32), fmt) * scale
  out = out.reshape(padded.shape)[..., :n].astype(np.float32)
  return ftz(np.moveaxis(out, -1, axis))


def ref_mx_scale(a, fmt, rceil=False):
  """X = 2^(floor(log2(amax)) - emax_elem) as E8M0 (clamped to its range), NaN for a non-finite
  amax (OCP MX spec v1.0, section 6.3); `rceil`: X = 2^ceil(log2(amax / fmax)), amax / fmax a
  float32 quotient (flushed to zero below 2^-126, as TF's CPU kernels), torchao's RCEIL."""
  fmax = np.float32(ml_dtypes.finfo(DTYPES[fmt]).max)
  with np.errstate(divide='ignore', invalid='ignore', over='ignore'):
    if rceil:
      e = np.clip(np.ceil(np.log2(ftz(a.astype(np.float32) / fmax).astype(np.float64))), -127, 127)
    else:
      e = np.clip(np.floor(np.log2(a.astype(np.float64))) - EMAX[fmt], -127, 127)
  scale = np.where(np.isfinite(a), np.exp2(np.nan_to_num(e, nan=0.0)), np.nan)
  e8m0 = scale.astype(ml_dtypes.float8_e8m0fnu)
  assert np.array_equal(e8m0.astype(np.float64), scale, equal_nan=True)  # representable
  return e8m0


def assert_bits_equal(got, want):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
  bad = np.flatnonzero(~same)
  assert not bad.size, f'{bad.size} differ, e.g. got {got.flat[bad[:4]]} want {want.flat[bad[:4]]}'


# ---- the comparisons ----------------------------------------------------------------------------


def random_values(seed, shape=(1000, 1000)):
  """10^6 values, signs random, magnitudes log-uniform over 2^-30..2^30 with rows and columns of
  their own ranges (so per-row, per-column and per-block scales differ from the tensor's)."""
  rng = np.random.default_rng(seed)
  rows = rng.uniform(-20, 10, (shape[0], 1))
  cols = rng.uniform(-10, 10, (1, shape[1]))
  return (rng.standard_normal(shape) * np.exp2(rows + cols)).astype(np.float32)


CASES = [
  ('tensor', -1),
  ('axis', 1),
  ('axis', 0),
  ('block', 1),  # 1000 = 31 blocks + 8: the tail is padded
  ('block', 0),
  ('block_rceil', 1),
  ('block_rceil', 0),
]


@pytest.mark.parametrize('compiled', [False, True], ids=['eager', 'xla'])
@pytest.mark.parametrize('fmt', ['e4m3fn', 'e5m2'])
def test_a_million_random_values_equal_the_reference(fmt, compiled):
  x = random_values(0 if fmt == 'e4m3fn' else 1)
  for scaling, axis in CASES:
    fn = lambda t, s=scaling, a=axis: fq.qdq(t, fmt, s, a)  # noqa: E731
    fn = fq.fused(fmt, scaling, axis) if compiled else fn  # the GEMMs' XLA-compiled q/dq
    assert_bits_equal(fn(tf.constant(x)), ref_qdq(x, fmt, scaling, axis))
    # bfloat16 inputs: rounded to bfloat16 first, then the same.
    xb = tf.cast(tf.constant(x), tf.bfloat16)
    assert_bits_equal(fn(xb), ref_qdq(xb.numpy().astype(np.float32), fmt, scaling, axis))


def format_edges(fmt):
  """The format's grid at scale 1: largest value, beyond it, min normal, subnormals, ties between
  neighbours (rounded to even), values between steps, zeros and the non-finite values."""
  info = ml_dtypes.finfo(DTYPES[fmt])
  fmax, tiny, sub = float(info.max), float(info.smallest_normal), float(info.smallest_subnormal)
  grid = np.arange(256, dtype=np.uint8).view(DTYPES[fmt]).astype(np.float32)
  grid = np.sort(grid[np.isfinite(grid)])
  mids = (grid[:-1] + grid[1:]) / 2  # ties: exact in float32
  between = grid[:-1] + (grid[1:] - grid[:-1]) * 0.3
  special = [fmax, -fmax, fmax * 1.01, -fmax * 1.01, fmax * 1.07, 1e30, tiny, sub, sub / 2]
  special += [sub / 2 * 1.01, sub * 1.5, tiny - sub, 0.0, -0.0, np.inf, -np.inf, np.nan]
  return np.concatenate([grid, mids, between, np.array(special, np.float32)]).astype(np.float32)


@pytest.mark.parametrize('fmt', ['e4m3fn', 'e5m2'])
def test_edge_cases_of_each_format_round_and_saturate_as_the_reference(fmt):
  x = format_edges(fmt)
  for fn in (fq.cast_saturated, tf.function(fq.cast_saturated, jit_compile=True)):
    got = fn(tf.constant(x), fmt).numpy()
    assert_bits_equal(got, ref_cast(x, fmt))
  fmax = float(ml_dtypes.finfo(DTYPES[fmt]).max)
  got = fq.cast_saturated(tf.constant([fmax * 1.07, np.inf, np.nan]), fmt).numpy()
  assert got[0] == fmax and not np.isfinite(got[1:]).any()  # saturated; inf and NaN not hidden


@pytest.mark.parametrize('fmt', ['e4m3fn', 'e5m2'])
def test_edge_cases_of_the_scalings(fmt):
  fmax = float(ml_dtypes.finfo(DTYPES[fmt]).max)
  rows = np.array(
    [
      np.zeros(64),  # amax 0: the EPS floor, E8M0's smallest scale
      np.r_[1.9 * 2 ** EMAX[fmt], np.ones(63)],  # MX: x / X = 1.9 * 2^emax > fmax: saturated
      np.r_[np.nan, np.ones(63)],  # non-finite: poisons its tensor, row, block
      np.r_[np.ones(32), -np.inf, np.ones(31)],
      np.r_[fmax, fmax / 3, 2.0**-40, np.full(61, 0.5)],  # flushed to zero beside a large value
      np.r_[2.0**-118, 2.0**-125, np.full(62, 2.0**-121)],  # X = 2^-127 (clamped), results
      np.r_[2.0**100, -(2.0**100) * 1.5, np.full(62, 3.0)],  # below 2^-126 flushed
    ],
    np.float32,
  )
  for scaling, axis in [('tensor', -1), ('axis', 1), ('axis', 0), ('block', 1), ('block', 0)]:
    want = ref_qdq(rows, fmt, scaling, axis)
    assert_bits_equal(fq.qdq(tf.constant(rows), fmt, scaling, axis).numpy(), want)
    assert_bits_equal(fq.fused(fmt, scaling, axis)(tf.constant(rows)).numpy(), want)  # XLA
  got = fq.qdq(tf.constant(rows), fmt, 'block', 1).numpy()
  assert got[1, 0] == fmax  # saturated, as the MX spec allows
  assert np.isnan(got[2, :32]).all() and (got[2, 32:] == 1).all()  # the NaN's block only
  assert not np.isfinite(got[3, 32:]).any() and (got[3, :32] == 1).all()
  assert np.isnan(fq.qdq(tf.constant(rows), fmt, 'tensor').numpy()).all()


@pytest.mark.parametrize('fmt', ['e4m3fn', 'e5m2'])
def test_mx_exponents_are_the_e8m0_scales_of_the_reference(fmt):
  rng = np.random.default_rng(2)
  a = np.abs(rng.standard_normal(10**5) * np.exp2(rng.uniform(-140, 127, 10**5)))
  a = np.r_[a, 0.0, 2.0**-126, 2.0**-119, 2.0**-118, 3.4e38, 2.0**127]
  a = np.minimum(a, 3.4e38).astype(np.float32)
  for rceil in (False, True):
    got = np.exp2(fq.mx_exponent(tf.constant(a), fmt, rceil).numpy().astype(np.float64))
    want = ref_mx_scale(ftz(a), fmt, rceil).astype(np.float64)
    np.testing.assert_array_equal(got.astype(ml_dtypes.float8_e8m0fnu).astype(np.float64), want)
  inverse = fq.mx_inverse_scale(tf.constant([np.inf, np.nan, 1.0]), fmt).numpy()
  assert np.isnan(inverse[:2]).all() and inverse[2] == 2.0 ** EMAX[fmt]


@pytest.mark.parametrize('fmt', ['e4m3fn', 'e5m2'])
def test_counts_of_saturated_and_flushed_values(fmt):
  fmax = float(ml_dtypes.finfo(DTYPES[fmt]).max)
  block = np.r_[1.9 * 2 ** EMAX[fmt], np.ones(30), 0.0].astype(np.float32)  # X = 1: 1.9 * 2^emax
  np.testing.assert_array_equal(fq.counts(tf.constant(block), fmt, 'block').numpy(), [1, 0, 31])
  # RCEIL rounds the scale up: the block maximum fits, nothing saturates.
  np.testing.assert_array_equal(
    fq.counts(tf.constant(block), fmt, 'block_rceil').numpy(), [0, 0, 31]
  )
  x = np.array([fmax, 2.0**-40, -(2.0**-41), 1.0, 0.0], np.float32)  # scale 1: two flushed
  np.testing.assert_array_equal(fq.counts(tf.constant(x), fmt, 'tensor').numpy(), [0, 2, 4])


@pytest.mark.parametrize('fmt', ['e4m3fn', 'e5m2'])
def test_tensor_and_axis_scalings_round_without_saturating(fmt):
  """Their scaled values stay within fmax * (1 + 2^-23), which rounds to fmax unsaturated: their
  q/dq skips the saturation (no clip in the graph) with the same bits. MX blocks reach beyond
  fmax * (1 + 1/28), where the unsaturated cast overflows: the block scaling saturates."""
  fmax = float(ml_dtypes.finfo(DTYPES[fmt]).max)
  x = np.float32(fmax) * np.array([1, 1 + 2.0**-23, 1 + 2.0**-22, 1.03, 1.0357], np.float32)
  x = np.r_[x, -x, 0.0, np.nan, np.inf].astype(np.float32)
  for fn in (fq.rounded, tf.function(fq.rounded, jit_compile=True)):
    assert_bits_equal(fn(tf.constant(x), fmt), ref_cast(x, fmt))
  assert not np.isfinite(fq.rounded(tf.constant([fmax * 1.08]), fmt).numpy()).any()
  for scaling, clipped in (('tensor', False), ('axis', False), ('block', True)):
    fn = tf.function(lambda t, s=scaling: fq.qdq(t, fmt, s, 1))
    graph = fn.get_concrete_function(tf.TensorSpec([4, 64], tf.float32)).graph
    assert any(op.type == 'Minimum' for op in graph.get_operations()) == clipped, scaling
  # Amaxes whose element scales to above fmax (fmax / amax rounded up, times amax): still fmax.
  a = np.float32(1) + np.arange(1, 2048, dtype=np.float32) / np.float32(1024)
  over = a[(np.float32(fmax) / a) * a > np.float32(fmax)]
  assert over.size
  x = np.r_[over[:8], -over[:8], 0.5].astype(np.float32)
  for i in range(8):  # each one the amax of its tensor
    t = np.r_[x[i], 0.5, -0.25].astype(np.float32)
    got = fq.qdq(tf.constant(t), fmt, 'tensor').numpy()
    assert_bits_equal(got, ref_qdq(t, fmt, 'tensor'))
