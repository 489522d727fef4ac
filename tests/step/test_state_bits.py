"""8-bit Adam state (config.optimizer.state_bits=8; trainer/step/low_precision.py and
rounding.py): the block-wise logarithmic code against NumPy, the update against a float64 Adam,
the bytes, skipped steps and resumes."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import low_precision_runs as runs
from tiny import TinyTrainer, tiny_config
from trainer.step import low_precision, rounding
from trainer.errors import ConfigError


def quantize(x: np.ndarray, seed, signed: bool):
  """rounding.quantize with 16-bit noise drawn from `seed`, as the optimizer draws it."""
  size = rounding.blocks(x.size) * rounding.BLOCK
  noise = rounding.noise(rounding.random_bits(tf.constant(seed, tf.int64), size, 1), 0)
  return rounding.quantize(tf.constant(x), noise, signed)


def magnitudes(signed: bool) -> np.ndarray:
  """The code's non-zero magnitudes relative to the block's absmax, written out independently:
  m 2^(-k/4), k < 127; v 2^(-k/8), k < 255."""
  return 2.0 ** (-np.arange(127) / 4) if signed else 2.0 ** (-np.arange(255) / 8)


def decode(codes: np.ndarray, absmax: np.ndarray, signed: bool) -> np.ndarray:
  """uint8 codes -> float64, per the code's definition (zero is the byte after the last
  magnitude; signed: bit 7 is the sign)."""
  codes = codes.astype(np.int64)
  mags = np.append(magnitudes(signed), 0.0)
  index, sign = (codes & 127, np.where(codes >= 128, -1.0, 1.0)) if signed else (codes, 1.0)
  return (sign * mags[index]).reshape(-1, 256) * absmax[:, None].astype(np.float64)


def neighbours(r: np.ndarray, signed: bool):
  """(lower, upper): the code magnitudes either side of r in [0, 1] (0 below the smallest)."""
  mags = np.sort(np.append(magnitudes(signed), 0.0))
  hi = mags[np.minimum(np.searchsorted(mags, r, side='left'), len(mags) - 1)]
  lo = mags[np.maximum(np.searchsorted(mags, r, side='right') - 1, 0)]
  return lo, hi


@pytest.mark.parametrize('signed', [True, False])
def test_quantize_lands_on_a_neighbouring_code_within_the_bound(signed):
  rng = np.random.default_rng(0)
  # a wide range within each block: log-uniform magnitudes over 12 decades, some exact zeros
  x = 10.0 ** rng.uniform(-12, 0, size=1000) * (rng.choice([-1, 1], 1000) if signed else 1)
  x[::97] = 0.0
  x = x.astype(np.float32)
  codes, absmax = quantize(x, [1, 2], signed)
  assert codes.dtype == tf.uint8 and codes.shape == (4 * 256,) and absmax.shape == (4,)
  padded = np.pad(x, (0, 24)).reshape(4, 256).astype(np.float64)
  np.testing.assert_array_equal(absmax.numpy(), np.abs(padded).max(axis=1).astype(np.float32))
  out = decode(codes.numpy(), absmax.numpy(), signed)
  r = np.abs(padded) / np.abs(padded).max(axis=1, keepdims=True)
  lo, hi = neighbours(r, signed)
  scale = np.abs(padded).max(axis=1, keepdims=True)
  got = np.abs(out) / scale
  tol = 1e-6
  on_lo, on_hi = np.isclose(got, lo, rtol=tol, atol=0), np.isclose(got, hi, rtol=tol, atol=0)
  if not signed:  # below the smallest code: rounded up to it, never to zero
    smallest = magnitudes(False)[-1]
    on_hi |= (r > 0) & (r < smallest) & np.isclose(got, smallest, rtol=tol)
    assert np.all(got[r > 0] > 0)
  assert np.all(on_lo | on_hi)
  assert np.all(np.sign(out)[out != 0] == np.sign(padded)[out != 0])
  assert np.all(out[padded == 0] == 0)
  # the bound: within the code's relative step of the value, in range
  ratio = 2 ** (1 / 4) if signed else 2 ** (1 / 8)
  in_range = r >= magnitudes(signed)[-1]
  assert np.all(np.abs(out - padded)[in_range] <= (ratio - 1) * np.abs(padded)[in_range] * 1.0001)


@pytest.mark.parametrize('signed', [True, False])
def test_quantize_is_unbiased(signed):
  values = np.array([0.3, 0.77, 0.0123, 0.999], np.float32)
  draws = 256 * 64
  x = np.concatenate(
    [np.append(np.full(255, v, np.float32), 1.0) for v in values for _ in range(draws // 256)]
  )  # each block: 255 copies and absmax 1
  codes, absmax = quantize(x, [3, 4], signed)
  out = decode(codes.numpy(), absmax.numpy(), signed).reshape(len(values), -1, 256)[:, :, :255]
  for v, got in zip(values, out):
    lo, hi = neighbours(np.float64(v), signed)
    p = (v - lo) / (hi - lo)
    assert abs(got.mean() - v) <= 5 * (hi - lo) * np.sqrt(p * (1 - p) / got.size) + 1e-7


def test_dequantize_inverts_exactly_representable_values():
  x = np.zeros(300, np.float32)
  x[:5] = [2.0, -1.0, 0.5, -(2.0**-30), 0.0]  # on the signed code (absmax 2)
  codes, absmax = quantize(x, [0, 0], True)
  back = rounding.dequantize(codes, absmax, [300], signed=True).numpy()
  np.testing.assert_array_equal(back, x)


def adam64(w, g, m, v, t, lr=1e-2, b1=0.9, b2=0.999, eps=1e-7):
  m = m + (g - m) * (1 - b1)
  v = v + (g * g - v) * (1 - b2)
  return w - m * lr * np.sqrt(1 - b2**t) / (1 - b1**t) / (np.sqrt(v) + eps), m, v


def test_adam_update_uses_the_dequantized_state():
  """Each step equals float64 Adam computed from the state as stored (decoded with NumPy)."""
  rng = np.random.default_rng(3)
  shape = (30, 20)  # 600 elements: 3 blocks, the last one padded
  variable = keras.Variable(rng.normal(size=shape).astype(np.float32))
  optimizer = low_precision.LowPrecisionAdam(learning_rate=1e-2, state_bits=8, seed=1)
  optimizer.build([variable])
  m = v = np.zeros(600)
  for t in range(1, 6):
    g = rng.normal(size=shape).astype(np.float32) * 10.0 ** rng.uniform(-3, 0, size=shape)
    w_before = variable.numpy().astype(np.float64)
    optimizer.apply_gradients([(tf.constant(g, tf.float32), variable)])
    expected, m_new, v_new = adam64(w_before.reshape(-1), g.astype(np.float64).reshape(-1), m, v, t)
    np.testing.assert_allclose(variable.numpy().reshape(-1), expected, rtol=1e-5, atol=1e-7)
    m = decode(
      optimizer._momentums[0].numpy(), optimizer._momentum_scales[0].numpy(), True
    ).reshape(-1)[:600]
    v = decode(
      optimizer._velocities[0].numpy(), optimizer._velocity_scales[0].numpy(), False
    ).reshape(-1)[:600]
    # the stored state is the float64 state within the codes' relative steps
    assert np.all(np.abs(m - m_new) <= (2**0.25 - 1) * np.abs(m_new) * 1.001 + 1e-9)
    assert np.all(np.abs(v - v_new) <= (2**0.125 - 1) * v_new * 1.001 + 1e-12)


@pytest.mark.parametrize('master_weights', ['float32', 'bfloat16_sr'])
def test_an_embedding_gradient_updates_as_its_dense_equal(master_weights):
  """An embedding's gradient (IndexedSlices whose dense shape is known only at run time, so that
  made dense it has no static shape) updates as the same gradient made dense by the caller."""
  dtype = 'float32' if master_weights == 'float32' else 'bfloat16'
  table = np.random.default_rng(5).normal(size=(50, 8)).astype(np.float32)
  ids = tf.constant([[3, 7, 3], [49, 0, 7]])
  results = []
  for sparse in (True, False):
    embedding = keras.Variable(table, dtype=dtype)
    optimizer = low_precision.LowPrecisionAdam(
      learning_rate=1e-2, state_bits=8, seed=2, master_weights=master_weights
    )
    optimizer.build([embedding])

    def make_step(embedding, optimizer, sparse):
      # dense_shape known only at run time, as after the trainer's unscaling and clipping
      @tf.function(input_signature=[tf.TensorSpec([2], tf.int64)])
      def step(dense_shape):
        with tf.GradientTape() as tape:
          loss = tf.reduce_sum(tf.square(tf.cast(tf.gather(embedding.value, ids), tf.float32)))
        grad = tape.gradient(loss, embedding.value)
        grad = tf.IndexedSlices(grad.values, grad.indices, dense_shape)
        optimizer.apply_gradients([(grad if sparse else tf.convert_to_tensor(grad), embedding)])

      return step

    step = make_step(embedding, optimizer, sparse)
    for _ in range(3):
      step(tf.constant(table.shape, tf.int64))
    results.append([v.numpy().tobytes() for v in [embedding] + optimizer.variables])
  assert results[0] == results[1]


def test_state_is_at_most_0_3x_of_float32_moments(tiny_trainer):
  model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512), keras.layers.Dense(10)])
  params = model.count_params()
  optimizer = low_precision.LowPrecisionAdamW(learning_rate=1e-3, state_bits=8)
  optimizer.build(model.trainable_variables)
  state = sum(v.numpy().nbytes for v in optimizer.variables if v.shape != ())
  assert state <= 0.3 * (2 * 4 * params), (state, 8 * params)
  assert state == low_precision.state_bytes(optimizer)
  float32 = keras.optimizers.AdamW(learning_rate=1e-3)
  float32.build(model.trainable_variables)
  assert low_precision.state_bytes(float32) == 8 * params


@pytest.mark.parametrize('setting', ['state_bits_8', 'bfloat16_sr_state_bits_8'])
def test_skipped_step_leaves_every_stored_tensor_bit_identical(tmp_path, setting):
  result = runs.skip_check(str(tmp_path), setting)
  assert result['skipped'] == 1
  assert result['changed_by_skip'] == []
  assert result['changed_by_next']


@pytest.mark.parametrize('setting', ['state_bits_8', 'bfloat16_sr_state_bits_8'])
def test_resume_is_bit_identical(tmp_path, setting):
  assert runs.resume_check(str(tmp_path), setting) == []


def test_state_bits_8_needs_adam():
  with pytest.raises(
    ConfigError,
    match=r'^config.optimizer.state_bits=8 quantizes Adam/AdamW '
    r"moments; config.optimizer.name='sgd'",
  ):
    TinyTrainer(tiny_config(**{'optimizer.state_bits': 8, 'optimizer.name': 'sgd'}), '/nonexistent')
