"""Keras layers written the mixed-precision way, for models to reuse.

The pattern, which any custom layer should follow under a mixed policy:
  * `build` creates the weights with `dtype=self.variable_dtype` (float32 under every mixed
    policy), so the optimizer updates float32 master weights;
  * `call` casts its inputs and every weight it reads to `self.compute_dtype` (float16 or
    bfloat16) before the matmuls, where the speed is;
  * the numerically fragile parts (here the softmax over the attention scores, with its -inf mask)
    run in float32 and are cast back;
  * what the backward pass keeps is stored in the compute dtype: else the tape keeps a float32
    intermediate an op's gradient needs (the softmax output, the GELU input), and mixed precision
    saves no activation memory. `masked_softmax` and `gelu_float32` compute in float32 and keep
    only their 16-bit input or output (tf.custom_gradient; the gradient computed in float32).
Keras 3 autocasts a layer's own weights inside `call` already; the explicit casts make the layer
correct wherever it is called from (a tf.function, another layer's call, a test) and make the
dtypes readable in the code.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from trainer.nn import fused


ATTENTION = ('auto', 'full', 'chunked')


@keras.saving.register_keras_serializable(package='trainer')
class CausalSelfAttention(keras.layers.Layer):
  """Multi-head self-attention where position t attends to positions <= t.

  Input and output: [batch, time, d_model]. One fused query/key/value projection and one output
  projection, with biases. Dropout applies to the attention weights when training.
  `attention='chunked'` computes the queries in blocks of `chunk` positions (`chunked_attention`,
  exact): the [batch, heads, time, time] weights are never held whole, nor kept for the backward
  pass; it needs a static sequence length (else the full path runs) and no dropout. 'auto' (the
  default) is 'chunked' where it applies and the sequence spans more than one block, else
  'full': one block would be the plain path with more ops. For a float8
  recipe its GEMMs are the two projections (FLOAT8_KERNELS; trainer/nn/float8_layers.py sets
  `float8_matmul`); the attention's own matmuls stay in the compute dtype.
  """

  FLOAT8_KERNELS = ('qkv_kernel', 'out_kernel')

  def __init__(
    self, num_heads: int, dropout: float = 0.0, attention: str = 'auto', chunk: int = 64, **kwargs
  ):
    super().__init__(**kwargs)
    self.num_heads = int(num_heads)
    self.dropout = float(dropout)
    if attention not in ATTENTION:
      raise ValueError(f'{self.name}: attention must be one of {ATTENTION}, got {attention!r}')
    if attention == 'chunked' and self.dropout:
      raise ValueError(
        f'{self.name}: chunked attention recomputes the weights in the backward '
        'pass, so it takes no dropout (a fresh mask); set dropout=0'
      )
    self.attention, self.chunk = attention, int(chunk)
    self._dropout = keras.layers.Dropout(self.dropout, dtype=self.dtype_policy)

  def build(self, input_shape):
    d_model = int(input_shape[-1])
    if d_model % self.num_heads:
      raise ValueError(
        f'{self.name}: d_model {d_model} is not divisible by num_heads {self.num_heads}'
      )
    self.d_model = d_model
    init = keras.initializers.GlorotUniform()
    # float32 master weights under every mixed policy.
    self.qkv_kernel = self.add_weight(
      name='qkv_kernel', shape=(d_model, 3 * d_model), initializer=init, dtype=self.variable_dtype
    )
    self.qkv_bias = self.add_weight(
      name='qkv_bias', shape=(3 * d_model,), initializer='zeros', dtype=self.variable_dtype
    )
    self.out_kernel = self.add_weight(
      name='out_kernel', shape=(d_model, d_model), initializer=init, dtype=self.variable_dtype
    )
    self.out_bias = self.add_weight(
      name='out_bias', shape=(d_model,), initializer='zeros', dtype=self.variable_dtype
    )

  def call(self, x, training=False):
    dtype = self.compute_dtype
    x = tf.cast(x, dtype)
    batch, time = tf.shape(x)[0], tf.shape(x)[1]
    heads, depth = self.num_heads, self.d_model // self.num_heads

    rows = tf.reshape(x, [-1, self.d_model])  # one 2-D matmul is faster than a batched one
    qkv = self._matmul(rows, self.qkv_kernel) + tf.cast(self.qkv_bias, dtype)
    qkv = tf.reshape(qkv, [batch, time, 3, heads, depth])
    q, k, v = tf.unstack(tf.transpose(qkv, [2, 0, 3, 1, 4]))  # each [batch, heads, time, depth]

    q = q * tf.cast(depth**-0.5, dtype)
    if self._chunked(x.shape[1]):
      out = chunked_attention(q, k, v, self.chunk)
      return self._project(out, batch, time)
    scores = tf.matmul(q, k, transpose_b=True)  # [batch, heads, time, time], compute dtype
    # Mask and softmax in float32 (-inf and the exp/sum are where float16 overflows); the
    # [batch, heads, time, time] weights are kept for the backward pass in the compute dtype.
    weights = masked_softmax(scores, causal_mask(time))
    if self.dropout:
      weights = self._dropout(weights, training=training)

    return self._project(tf.matmul(weights, v), batch, time)

  def _chunked(self, time: int | None) -> bool:
    """Whether a sequence of static length `time` (None: dynamic) takes `chunked_attention`."""
    if time is None or self.attention == 'full':
      return False
    return self.attention == 'chunked' or (not self.dropout and time > self.chunk)

  def _project(self, out, batch, time):
    """[batch, heads, time, depth] -> the output projection, [batch, time, d_model]."""
    dtype = self.compute_dtype
    out = tf.reshape(tf.transpose(out, [0, 2, 1, 3]), [-1, self.d_model])
    out = self._matmul(out, self.out_kernel) + tf.cast(self.out_bias, dtype)
    return tf.reshape(out, [batch, time, self.d_model])

  def _matmul(self, rows, kernel):
    """rows @ kernel in the compute dtype, as a float8 GEMM when a recipe set `float8_matmul`."""
    kernel = tf.cast(kernel, self.compute_dtype)
    float8 = getattr(self, 'float8_matmul', None)
    return float8(rows, kernel) if float8 else tf.matmul(rows, kernel)

  def compute_output_shape(self, input_shape):
    return input_shape

  def get_config(self):
    return {
      **super().get_config(),
      'num_heads': self.num_heads,
      'dropout': self.dropout,
      'attention': self.attention,
      'chunk': self.chunk,
    }


def chunked_attention(q, k, v, chunk: int) -> tf.Tensor:
  """Causal attention softmax(q k^T + mask) v, exact, `chunk` query positions at a time, with
  its backward pass written out: the memory-efficient attention (FlashAttention's algorithm
  over blocks of queries, each against the keys it may see).

  q, k, v: [batch, heads, time, depth] (q already scaled), static time. Block i's queries
  attend to keys [0, end of the block) (the later ones are masked anyway, so their work is
  skipped); its scores and float32 softmax exist one block at a time. The backward pass keeps
  q, k, v, the output and each row's float32 log-sum-exp, and recomputes one block's weights
  at a time from them: exp(s - lse), then dV += P^T dO, dS = P * (dO V^T - rowsum(dO * O)),
  dQ = dS K, dK += dS^T Q. The matmuls run in q's dtype as the plain path's do; statistics
  and dS in float32. Nothing [batch, heads, time, time] is made or kept: transient memory is
  one block's [batch, heads, chunk, <= time] scores."""
  time = int(q.shape[2])
  blocks = [(start, min(start + chunk, time)) for start in range(0, time, chunk)]

  @tf.custom_gradient
  def attend(q, k, v):
    out, lses = _blocked_forward(q, k, v, blocks)
    return out, lambda d_out: _blocked_backward(q, k, v, out, lses, d_out, blocks)

  return attend(q, k, v)


# The blocks run one after another, their slices included (control dependencies): TensorFlow
# would otherwise run the independent blocks, or slice every block's keys, at once and hold them.


def _scores32(qi, kj, start: int, end: int) -> tf.Tensor:
  """Block [start, end)'s float32 scores against keys [0, end), -inf where masked."""
  s = tf.cast(tf.matmul(qi, kj, transpose_b=True), tf.float32)
  mask = tf.range(end)[None, :] <= tf.range(start, end)[:, None]  # [end - start, end]
  return tf.where(mask, s, float('-inf'))


def _blocked_forward(q, k, v, blocks):
  """(the attention's output, each block's float32 log-sum-exp [batch, heads, block, 1])."""
  outs: list[tf.Tensor] = []
  lses = []
  for start, end in blocks:
    with tf.control_dependencies(outs[-1:]):
      qi, kj, vj = q[:, :, start:end], k[:, :, :end], v[:, :, :end]
    s = _scores32(qi, kj, start, end)
    m = tf.reduce_max(s, axis=-1, keepdims=True)  # finite: the diagonal is never masked
    e = tf.exp(s - m)
    total = tf.reduce_sum(e, axis=-1, keepdims=True)
    outs.append(tf.matmul(tf.cast(e / total, q.dtype), vj))  # the softmax as the plain path's
    lses.append(m + tf.math.log(total))
  return tf.concat(outs, axis=2), lses


def _blocked_backward(q, k, v, out, lses, d_out, blocks):
  """(dQ, dK, dV): per block, P = exp(s - lse), dV += P^T dO, dS = P * (dO V^T - rowsum(dO *
  O)), dQ = dS K, dK += dS^T Q; dK and dV summed in float32 per key block over the query blocks
  that see it."""
  dtype = q.dtype
  dq: list[tf.Tensor] = []
  dk: list = [0.0] * len(blocks)
  dv: list = [0.0] * len(blocks)
  for i, ((start, end), lse) in enumerate(zip(blocks, lses)):
    with tf.control_dependencies(dq[-1:]):
      qi, kj, vj = q[:, :, start:end], k[:, :, :end], v[:, :, :end]
      do, oi = d_out[:, :, start:end], out[:, :, start:end]
    p = tf.exp(_scores32(qi, kj, start, end) - lse)  # this block's weights, float32
    rowdot = tf.reduce_sum(tf.cast(do, tf.float32) * tf.cast(oi, tf.float32), -1, keepdims=True)
    dp = tf.cast(tf.matmul(do, vj, transpose_b=True), tf.float32)
    ds = tf.cast(p * (dp - rowdot), dtype)
    sizes = [b - a for a, b in blocks[: i + 1]]  # keys [0, end): key blocks 0..i
    for acc, part in (
      (dv, tf.matmul(tf.cast(p, dtype), do, transpose_a=True)),
      (dk, tf.matmul(ds, qi, transpose_a=True)),
    ):
      for j, piece in enumerate(tf.split(tf.cast(part, tf.float32), sizes, axis=2)):
        acc[j] += piece
    with tf.control_dependencies(dk[: i + 1] + dv[: i + 1]):  # summed before the next block
      dq.append(tf.matmul(ds, kj))
  return (
    tf.concat(dq, axis=2),
    tf.cast(tf.concat(dk, axis=2), dtype),
    tf.cast(tf.concat(dv, axis=2), dtype),
  )


def causal_mask(time) -> tf.Tensor:
  """[time, time] bool: True where query t may attend to key s (s <= t)."""
  return tf.linalg.band_part(tf.ones([time, time], tf.bool), -1, 0)


def masked_softmax(scores: tf.Tensor, mask: tf.Tensor) -> tf.Tensor:
  """softmax over the last axis of `scores` where `mask` (broadcast) is True, 0 elsewhere.

  Computed in float32 whatever scores' dtype; returned in scores' dtype, and only that result
  is kept for the backward pass: the gradient, y * (dy - sum(dy * y)), is computed in float32
  from it. Plain `tf.nn.softmax` on float32 scores would make the tape keep its float32 output,
  twice the bytes of the 16-bit attention weights, and at long context the largest tensor kept.
  Every row needs at least one True (the causal mask's diagonal); a row of -inf gives NaN.
  """
  dtype = scores.dtype

  @tf.custom_gradient
  def forward(x):
    y = tf.cast(
      tf.nn.softmax(tf.where(mask, tf.cast(x, tf.float32), float('-inf')), axis=-1), dtype
    )

    def backward(dy):
      y32, dy32 = tf.cast(y, tf.float32), tf.cast(dy, tf.float32)
      dx = y32 * (dy32 - tf.reduce_sum(dy32 * y32, axis=-1, keepdims=True))
      return tf.cast(dx, dtype)  # 0 where masked: y is 0 there

    return y, backward

  return forward(scores)


def layer_norm(x: tf.Tensor, gamma: tf.Tensor, beta: tf.Tensor, epsilon: float) -> tf.Tensor:
  """(x - mean) / sqrt(var + epsilon) * gamma + beta over the last axis, in float32 whatever x's
  dtype (returned float32: the caller casts), with its backward pass written out.

  TensorFlow has no layer-norm kernel on a CPU: Keras's LayerNormalization is about eight ops
  forward and autodiff through them about twice as many backward. Here the backward pass is the
  closed form, from the normalized input xhat and the per-row 1/std:
    g = dy * gamma;  dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dgamma = sum over rows of dy * xhat;  dbeta = sum over rows of dy.
  What it keeps: xhat when x is float32; under a mixed policy x itself, in its 16-bit dtype
  (xhat is recomputed from it), so the tape keeps no float32 copy of a 16-bit activation.
  """
  low = x.dtype != tf.float32

  @tf.custom_gradient
  def forward(x, gamma, beta):
    x32 = tf.cast(x, tf.float32)
    mean = tf.reduce_mean(x32, axis=-1, keepdims=True)
    centered = x32 - mean
    rstd = tf.math.rsqrt(tf.reduce_mean(tf.square(centered), axis=-1, keepdims=True) + epsilon)
    xhat = centered * rstd
    kept = x if low else xhat

    def backward(dy):
      xh = (tf.cast(kept, tf.float32) - mean) * rstd if low else kept
      dy = tf.cast(dy, tf.float32)
      g = dy * gamma
      rows = list(range(len(dy.shape) - 1))
      dx = rstd * (
        g
        - tf.reduce_mean(g, axis=-1, keepdims=True)
        - xh * tf.reduce_mean(g * xh, axis=-1, keepdims=True)
      )
      return tf.cast(dx, x.dtype), tf.reduce_sum(dy * xh, rows), tf.reduce_sum(dy, rows)

    return xhat * gamma + beta, backward

  return forward(x, tf.cast(gamma, tf.float32), tf.cast(beta, tf.float32))


@keras.saving.register_keras_serializable(package='trainer')
class LayerNorm(keras.layers.LayerNormalization):
  """keras.layers.LayerNormalization (same weights, names, config and float32 statistics) whose
  call over the last axis with both gamma and beta runs `layer_norm`; any other configuration
  runs Keras's own call."""

  def call(self, inputs):
    rank = len(inputs.shape)
    last = self.axis in ([-1], [rank - 1])
    if not (last and self.gamma is not None and self.beta is not None) or self.rms_scaling:
      return super().call(inputs)
    out = layer_norm(inputs, self.gamma, self.beta, self.epsilon)
    return tf.cast(out, self.compute_dtype)


_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


@fused.kernel
def _gelu_forward(x):
  x32 = tf.cast(x, tf.float32)
  if x.dtype == tf.float32:
    return tf.nn.gelu(x32)  # erfc's: relative accuracy in the left tail too
  # A 16-bit output: x (1 + erf(x / sqrt 2)) / 2, PyTorch's formula, as XLA's erf costs half its
  # erfc. Where 1 + erf cancels (x < -3) the float32 result is within 2.5e-4 of x Phi(x),
  # relative, where |GELU| > 1e-3: below bfloat16's rounding (2**-9), about float16's (2**-12).
  return tf.cast(0.5 * x32 * (1.0 + tf.math.erf(x32 * _SQRT_HALF)), x.dtype)


@fused.kernel
def _gelu_backward(x, dy):
  x32 = tf.cast(x, tf.float32)
  # Phi(x) = erfc(-x / sqrt 2) / 2: in the left tail 1 + erf(x / sqrt 2) cancels to a few
  # float32 roundings of 1 (0 below x = -5.9), while erfc keeps Phi's relative accuracy.
  cdf = 0.5 * tf.math.erfc(-x32 * _SQRT_HALF)
  pdf = _INV_SQRT_2PI * tf.exp(-0.5 * tf.square(x32))
  return tf.cast(tf.cast(dy, tf.float32) * (cdf + x32 * pdf), x.dtype)


@tf.custom_gradient
def _gelu_kept_as_input(x):
  """Exact GELU in float32, returned in x's dtype; the backward pass keeps only x. Each pass is
  one XLA kernel inside the trainer's steps (trainer/nn/fused.py)."""
  return _gelu_forward(x), lambda dy: _gelu_backward(x, dy)


@keras.saving.register_keras_serializable(package='trainer')
def gelu_float32(x):
  """Exact GELU computed in float32, returned in x's dtype: `Dense(..., activation=gelu_float32)`.

  Element-wise transcendental ops are another fragile-and-slow part: on a CPU, bfloat16 and
  float16 erf are emulated, so GELU in them is slower than in float32 and this cast-compute-cast
  lies between the two (in the Transformer LM bfloat16 GELU was a large share of the step's op
  time: docs/guides/model-and-data.md, "Custom layers under a mixed policy"); on a GPU the casts
  cost little, and float32 is more precise too. The backward pass keeps only x (in its own dtype)
  and computes Phi(x) + x * phi(x) from it in float32; with plain casts around tf.nn.gelu the
  tape would keep the float32 copy of x.
  """
  return _gelu_kept_as_input(tf.convert_to_tensor(x))


@keras.saving.register_keras_serializable(package='trainer')
class TokenAndPositionEmbedding(keras.layers.Layer):
  """Token ids [batch, time] -> token embedding + learned position embedding [batch, time, d].

  Same pattern: float32 tables built in `build`, the looked-up rows cast to the compute dtype.
  Inputs longer than `max_length` fail with an error naming both lengths.
  """

  def __init__(self, vocab_size: int, max_length: int, d_model: int, **kwargs):
    super().__init__(**kwargs)
    self.vocab_size, self.max_length, self.d_model = int(vocab_size), int(max_length), int(d_model)

  def build(self, input_shape):
    init = keras.initializers.RandomNormal(stddev=0.02)
    self.token_table = self.add_weight(
      name='token_table',
      shape=(self.vocab_size, self.d_model),
      initializer=init,
      dtype=self.variable_dtype,
    )
    self.position_table = self.add_weight(
      name='position_table',
      shape=(self.max_length, self.d_model),
      initializer=init,
      dtype=self.variable_dtype,
    )

  def call(self, ids):
    time = tf.shape(ids)[1]
    tf.debugging.assert_less_equal(
      time,
      self.max_length,
      message=f'{self.name}: sequence longer than max_length={self.max_length}',
    )
    dtype = self.compute_dtype
    tokens = tf.gather(tf.cast(self.token_table, dtype), ids)
    positions = tf.cast(self.position_table[:time], dtype)
    return tokens + positions[None]

  def compute_output_shape(self, input_shape):
    return (*input_shape, self.d_model)

  def get_config(self):
    return {
      **super().get_config(),
      'vocab_size': self.vocab_size,
      'max_length': self.max_length,
      'd_model': self.d_model,
    }
