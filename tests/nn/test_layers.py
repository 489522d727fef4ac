"""trainer.layers.CausalSelfAttention: computes in the policy's dtype, keeps float32 variables,
softmax in float32, and is causal."""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.nn.layers import CausalSelfAttention


@pytest.fixture
def policy(request):
  keras.mixed_precision.set_global_policy(request.param)
  yield request.param
  keras.mixed_precision.set_global_policy('float32')


def _ops(layer, x):
  graph = tf.function(lambda t: layer(t)).get_concrete_function(x).graph
  return graph.get_operations()


@pytest.mark.parametrize('policy', ['mixed_bfloat16', 'mixed_float16', 'float32'], indirect=True)
def test_computes_in_policy_dtype_with_float32_variables(policy):
  compute = keras.mixed_precision.global_policy().compute_dtype
  layer = CausalSelfAttention(num_heads=4)
  x = tf.random.stateless_normal([2, 8, 32], seed=[1, 2])  # float32 input: the layer casts
  y = layer(x)
  assert y.dtype == compute
  assert len(layer.trainable_variables) == 4
  assert {v.dtype for v in layer.trainable_variables} == {'float32'}

  ops = _ops(layer, x)
  matmuls = [op for op in ops if op.type in ('MatMul', 'BatchMatMulV2', 'BatchMatMulV3')]
  assert len(matmuls) == 4  # qkv projection, q.k, weights.v, output projection
  assert {op.outputs[0].dtype.name for op in matmuls} == {compute}
  softmax = [op for op in ops if op.type == 'Softmax']
  assert [op.outputs[0].dtype.name for op in softmax] == ['float32']

  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(tf.cast(layer(x), tf.float32))
  grads = tape.gradient(loss, layer.trainable_variables)
  assert all(g.dtype == tf.float32 and bool(tf.reduce_all(tf.math.is_finite(g))) for g in grads)


@pytest.mark.parametrize('policy', ['mixed_bfloat16'], indirect=True)
def test_low_precision_output_matches_float32_within_bfloat16_error(policy):
  x = tf.random.stateless_normal([2, 16, 32], seed=[3, 4])
  low = CausalSelfAttention(num_heads=4)
  y_low = tf.cast(low(x), tf.float32).numpy()
  ref = CausalSelfAttention(num_heads=4, dtype='float32')
  ref(x)
  ref.set_weights(low.get_weights())
  y_ref = ref(x).numpy()
  error = np.abs(y_low - y_ref).max() / np.abs(y_ref).max()
  assert 0 < error < 0.03  # bfloat16 has 8 significant bits (2**-8 = 0.4 % per rounding)


def test_causal_future_positions_do_not_change_the_past():
  layer = CausalSelfAttention(num_heads=2)
  x = tf.random.stateless_normal([1, 10, 16], seed=[5, 6]).numpy()
  changed = x.copy()
  changed[:, 6:] += 5.0
  a, b = layer(x).numpy(), layer(changed).numpy()
  np.testing.assert_array_equal(a[:, :6], b[:, :6])
  assert np.abs(a[:, 6:] - b[:, 6:]).max() > 0.1


def test_rejects_d_model_not_divisible_by_heads():
  with pytest.raises(ValueError, match='not divisible by num_heads'):
    CausalSelfAttention(num_heads=3)(tf.zeros([1, 4, 16]))


@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
def test_gelu_float32_keeps_the_dtype_and_is_closer_to_exact(dtype):
  """gelu_float32: same dtype out as in, erf evaluated in float32 (and its gradient too)."""
  from trainer.nn.layers import gelu_float32

  x32 = tf.random.stateless_normal([4096], seed=[3, 4]) * 3.0
  x = tf.cast(x32, dtype)
  exact = tf.nn.gelu(tf.cast(x, tf.float32))  # float32 GELU of the same low-precision inputs
  with tf.GradientTape(persistent=True) as tape:
    tape.watch(x)
    ours, native = gelu_float32(x), tf.nn.gelu(x)
  assert ours.dtype == native.dtype == dtype
  # Ours only rounds the float32 result once: within half an ulp of the low-precision format.
  eps = 2.0**-8 if dtype == 'bfloat16' else 2.0**-11
  ours_err = np.abs(ours.numpy().astype(np.float32) - exact.numpy())
  assert np.all(ours_err <= eps * np.abs(exact.numpy()) + 1e-6)
  native_err = np.abs(native.numpy().astype(np.float32) - exact.numpy())
  assert ours_err.mean() < native_err.mean()
  grad = tape.gradient(ours, x)
  assert grad.dtype == dtype
  with tf.GradientTape() as t32:
    t32.watch(x32)
    want = tf.nn.gelu(x32)
  np.testing.assert_allclose(
    grad.numpy().astype(np.float32), t32.gradient(want, x32).numpy(), rtol=2 * eps, atol=2 * eps
  )


# ---- what the backward pass keeps: masked_softmax and gelu_float32 (custom gradients) --------
TOLERANCE = {'float32': 1e-6, 'bfloat16': 2e-2, 'float16': 2e-3}


def _plain_masked_softmax(scores, mask):
  return tf.cast(
    tf.nn.softmax(tf.where(mask, tf.cast(scores, tf.float32), float('-inf'))), scores.dtype
  )


def _value_and_grad(fn, x, dy):
  with tf.GradientTape() as tape:
    tape.watch(x)
    y = fn(x)
  return y, tape.gradient(y, x, output_gradients=dy)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16', 'float16'])
def test_masked_softmax_equals_the_plain_ops_value_and_gradient(dtype):
  from trainer.nn.layers import causal_mask, masked_softmax

  scores = tf.cast(3 * tf.random.stateless_normal([2, 3, 7, 7], seed=[3, 4]), dtype)
  dy = tf.cast(tf.random.stateless_normal([2, 3, 7, 7], seed=[5, 6]), dtype)
  mask = causal_mask(7)
  y, dx = _value_and_grad(lambda s: masked_softmax(s, mask), scores, dy)
  y_ref, dx_ref = _value_and_grad(lambda s: _plain_masked_softmax(s, mask), scores, dy)
  assert y.dtype == dx.dtype == dtype
  tol = TOLERANCE[dtype]
  np.testing.assert_allclose(tf.cast(y, tf.float32), tf.cast(y_ref, tf.float32), atol=tol)
  # bfloat16: the reference's gradient uses the float32 softmax, ours its bfloat16 rounding
  np.testing.assert_allclose(
    tf.cast(dx, tf.float32), tf.cast(dx_ref, tf.float32), atol=tol, rtol=tol
  )
  upper = ~mask.numpy()
  assert not np.any(y.numpy()[..., upper]) and not np.any(dx.numpy()[..., upper])


def _in_kernels(fn):
  """`fn` traced in a tf.function with trainer/nn/fused.py's kernels active (as in our steps)."""
  from trainer.nn import fused

  def traced(x):
    with fused.kernels():
      return fn(x)

  return tf.function(traced)


@pytest.mark.parametrize('kernels', [False, True], ids=['ops', 'xla_kernels'])
@pytest.mark.parametrize('dtype', ['float32', 'bfloat16', 'float16'])
def test_gelu_float32_gradient_equals_the_plain_ops(dtype, kernels):
  """Eagerly (TensorFlow's ops) and as the XLA kernels the trainer's steps run: the same values
  and gradients as plain tf.nn.gelu in float32, to the dtype's tolerance (XLA's erfc and exp
  differ from TensorFlow's in float32 rounding only)."""
  from trainer.nn.layers import gelu_float32

  x = tf.cast(3 * tf.random.stateless_normal([64, 33], seed=[7, 8]), dtype)
  dy = tf.cast(tf.random.stateless_normal([64, 33], seed=[9, 10]), dtype)
  plain = lambda t: tf.cast(tf.nn.gelu(tf.cast(t, tf.float32)), t.dtype)
  value_and_grad = lambda x: _value_and_grad(gelu_float32, x, dy)
  y, dx = (_in_kernels(value_and_grad) if kernels else value_and_grad)(x)
  y_ref, dx_ref = _value_and_grad(plain, x, dy)
  assert y.dtype == dx.dtype == dtype
  tol = TOLERANCE[dtype]
  np.testing.assert_allclose(tf.cast(y, tf.float32), tf.cast(y_ref, tf.float32), atol=tol)
  np.testing.assert_allclose(
    tf.cast(dx, tf.float32), tf.cast(dx_ref, tf.float32), atol=tol, rtol=tol
  )


def _xla_functions(fn, x) -> list[str]:
  """Names of the functions the graph of tf.function(fn) traced with x has XLA compile."""
  library = tf.function(fn).get_concrete_function(x).graph.as_graph_def().library
  return [f.signature.name for f in library.function if f.attr['_XlaMustCompile'].b]


def test_gelu_runs_as_xla_kernels_only_inside_kernels():
  """trainer/nn/fused.py: GELU's forward and backward are each one XLA-compiled function while
  `kernels()` is active (the trainer's steps), plain ops elsewhere (an export, a user's loop)."""
  from trainer.nn import fused
  from trainer.nn.layers import gelu_float32

  x = tf.zeros([4, 8])

  def value_and_grad(x, active):
    with fused.kernels() if active else contextlib.nullcontext():
      return _value_and_grad(gelu_float32, x, tf.ones_like(x))

  on = _xla_functions(lambda x: value_and_grad(x, True), x)
  assert sorted(name.split('_gelu_')[1].split('_')[0] for name in on) == ['backward', 'forward']
  assert _xla_functions(lambda x: value_and_grad(x, False), x) == []
  assert not fused.active()


def _kept(fn, x):
  """Tensors the backward pass of sum(fn(x)) keeps (benchmarks/memory.py's account)."""
  from benchmarks.memory import kept_for_backward

  def loss_and_grad(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      loss = tf.reduce_sum(tf.cast(fn(x), tf.float32))
    return loss, tape.gradient(loss, x)

  return kept_for_backward(tf.function(loss_and_grad).get_concrete_function(x).graph)


@pytest.mark.parametrize('dtype', ['bfloat16', 'float16'])
def test_backward_keeps_the_attention_weights_and_gelu_input_in_the_compute_dtype(dtype):
  from trainer.nn.layers import causal_mask, gelu_float32, masked_softmax

  scores = tf.zeros([2, 3, 16, 16], dtype)
  big = lambda kept: [t for t in kept if t.shape.num_elements() == scores.shape.num_elements()]
  ours = big(_kept(lambda s: masked_softmax(s, causal_mask(16)), scores))
  plain = big(_kept(lambda s: _plain_masked_softmax(s, causal_mask(16)), scores))
  assert [t.dtype.name for t in ours] == [dtype]  # the 16-bit weights, once
  assert 'float32' in [t.dtype.name for t in plain]  # what the plain ops keep
  x = tf.zeros([4, 64], dtype)
  dtypes = lambda fn: [t.dtype.name for t in _kept(lambda t: fn(2 * t), x)]  # 2 * t: not an input
  assert dtypes(gelu_float32) == [dtype]  # its input, once
  assert 'float32' in dtypes(lambda t: tf.cast(tf.nn.gelu(tf.cast(t, tf.float32)), t.dtype))


def test_attention_layer_keeps_nothing_float32_of_size_time_squared():
  keras.mixed_precision.set_global_policy('mixed_bfloat16')
  layer = CausalSelfAttention(num_heads=2)
  x = tf.zeros([2, 16, 8], tf.bfloat16)
  layer(x)
  kept = _kept(layer, x)
  squares = [t for t in kept if t.shape.as_list()[-2:] == [16, 16] and t.shape.rank == 4]
  assert squares and {t.dtype.name for t in squares} == {'bfloat16'}


def _attention_pair(policy, time=40, chunk=16):
  """A full and a chunked CausalSelfAttention with the same weights."""
  keras.mixed_precision.set_global_policy(policy)
  full = CausalSelfAttention(num_heads=2, attention='full')
  chunked = CausalSelfAttention(num_heads=2, attention='chunked', chunk=chunk)
  x = tf.random.stateless_normal([3, time, 8], [1, 2])
  full(x)
  chunked(x)
  for a, b in zip(chunked.weights, full.weights):
    a.assign(b)
  return full, chunked, x


def _value_and_grads(layer, x):
  with tf.GradientTape() as tape:
    tape.watch(x)
    y = layer(x)
    loss = tf.reduce_sum(tf.cast(y, tf.float32) * tf.cos(tf.range(8, dtype=tf.float32)))
  return [y, *tape.gradient(loss, [x, *layer.trainable_variables])]


@pytest.mark.parametrize('time, chunk', [(40, 16), (32, 8), (12, 64)])
def test_chunked_attention_equals_full_to_float32_rounding(time, chunk):
  full, chunked, x = _attention_pair('float32', time, chunk)
  for a, b in zip(
    tf.function(lambda x: _value_and_grads(chunked, x))(x), _value_and_grads(full, x)
  ):
    # float32 rounding of sums of terms as large as the tensor's largest element
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5 * np.abs(b.numpy()).max())


@pytest.mark.parametrize('time, chunk', [(64, 16), (50, 16)])
def test_chunked_attention_gradients_equal_the_plain_path_normwise(time, chunk):
  """The issue's bound: every gradient of the blocked attention within 1e-6 of the plain
  path's, relative in the 2-norm, in float32 (a wrong term in dS or a block's keys shows as
  a difference of order 1)."""
  full, chunked, x = _attention_pair('float32', time, chunk)
  got = tf.function(lambda x: _value_and_grads(chunked, x))(x)
  for a, b in zip(got, tf.function(lambda x: _value_and_grads(full, x))(x)):
    assert np.linalg.norm(a.numpy() - b.numpy()) <= 1e-6 * np.linalg.norm(b.numpy())


def test_chunked_attention_in_bfloat16_within_bfloat16_rounding():
  full, chunked, x = _attention_pair('mixed_bfloat16')
  a, b = chunked(x), full(x)
  assert a.dtype == tf.bfloat16
  np.testing.assert_allclose(
    tf.cast(a, tf.float32).numpy(), tf.cast(b, tf.float32).numpy(), rtol=2**-7, atol=2**-8
  )


def test_chunked_attention_keeps_no_time_squared_tensor():
  _, chunked, x = _attention_pair('mixed_bfloat16', time=64, chunk=16)
  kept = _kept(chunked, tf.cast(x, tf.bfloat16))
  assert kept
  assert not [
    t
    for t in kept
    if t.shape.rank == 4 and t.shape.as_list()[-1] == 64 and t.shape.as_list()[-2] > 1
  ]
  _, full_kept = None, _kept(_attention_pair('mixed_bfloat16', time=64)[0], tf.cast(x, tf.bfloat16))
  assert [t for t in full_kept if t.shape.as_list()[-2:] == [64, 64]]  # the check can fail


def test_auto_attention_is_chunked_only_past_one_block_without_dropout():
  keras.mixed_precision.set_global_policy('float32')
  auto = CausalSelfAttention(num_heads=2, chunk=16)
  assert [auto._chunked(t) for t in (None, 16, 17)] == [False, False, True]
  assert not CausalSelfAttention(num_heads=2, chunk=16, dropout=0.1)._chunked(64)
  assert not CausalSelfAttention(num_heads=2, chunk=16, attention='full')._chunked(64)
  assert CausalSelfAttention(num_heads=2, chunk=16, attention='chunked')._chunked(8)


def test_chunked_attention_refuses_dropout():
  with pytest.raises(ValueError, match='set dropout=0'):
    CausalSelfAttention(num_heads=2, dropout=0.1, attention='chunked')


def test_gelu_float32_gradient_keeps_relative_accuracy_in_the_left_tail():
  """d/dx GELU = Phi(x) + x phi(x) against float64 (Python's math.erfc): 1 + erf(x / sqrt 2)
  would cancel for x << 0 (0.14 relative error seen); erfc keeps the float32 result within a
  few roundings."""
  import math
  from trainer.nn.layers import gelu_float32

  x64 = np.linspace(-12.0, 4.0, 1601)
  x = tf.constant(x64, tf.float32)
  with tf.GradientTape() as tape:
    tape.watch(x)
    y = tf.reduce_sum(gelu_float32(x))
  dx = tape.gradient(y, x).numpy().astype(np.float64)
  xs = x.numpy().astype(np.float64)  # the float32 inputs, exactly
  pdf = np.exp(-0.5 * xs**2) / np.sqrt(2 * np.pi)
  want = 0.5 * np.vectorize(math.erfc)(-xs / np.sqrt(2)) + xs * pdf
  normal = np.abs(want) > 1e-30  # float32 still holds it with full relative precision
  relative = np.abs(dx[normal] - want[normal]) / np.abs(want[normal])
  assert relative.max() < 1e-4, (xs[normal][relative.argmax()], relative.max())


@pytest.mark.parametrize('policy', ['float32', 'mixed_bfloat16'], indirect=True)
def test_layer_norm_equals_keras_layer_normalization_value_and_gradients(policy):
  """LayerNorm's written-out backward pass gives Keras's LayerNormalization's values and its
  gradients for the input, gamma and beta (to float32 rounding; under mixed_bfloat16 to the
  rounding of the bfloat16 output), with the same weights and dtypes, and has fewer ops."""
  from trainer.nn.layers import LayerNorm

  x = 1 + 3 * tf.random.stateless_normal([4, 5, 16], seed=[1, 2])
  ours, keras_ln = LayerNorm(epsilon=1e-5), keras.layers.LayerNormalization(epsilon=1e-5)
  for layer in (ours, keras_ln):
    layer.build(x.shape)
    layer.gamma.assign(1 + 0.1 * tf.random.stateless_normal([16], seed=[3, 4]))
    layer.beta.assign(0.1 * tf.random.stateless_normal([16], seed=[5, 6]))
  dy = tf.random.stateless_normal([4, 5, 16], seed=[7, 8])

  def value_and_grads(layer):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = layer(x)
      loss = tf.reduce_sum(tf.cast(y, tf.float32) * dy)
    return [y, *tape.gradient(loss, [x, layer.gamma, layer.beta])]

  got, want = value_and_grads(ours), value_and_grads(keras_ln)
  assert [t.dtype for t in got] == [t.dtype for t in want]
  assert got[0].dtype == (tf.bfloat16 if policy == 'mixed_bfloat16' else tf.float32)
  tol = 1e-2 if policy == 'mixed_bfloat16' else 1e-5
  for g, w in zip(got, want):
    np.testing.assert_allclose(tf.cast(g, tf.float32), tf.cast(w, tf.float32), atol=tol, rtol=tol)
  if policy == 'float32':  # what it is for: fewer ops in the step's graph, forward and backward

    def ops(layer):
      def f(t):
        with tf.GradientTape() as tape:
          tape.watch(t)
          y = layer(t)
        return tape.gradient(y, [t, *layer.trainable_variables])

      return len(tf.function(f).get_concrete_function(x).graph.get_operations())

    assert ops(ours) < ops(keras_ln)
