"""The float8 GEMM each current-scaling recipe computes, emulated: y = x @ w and its two backward
GEMMs, every operand quantized and dequantized as the recipe says (trainer/nn/float8_quant.py).

A recipe names the formats of the forward operands (x, w) and of the output gradient g, and the
scaling. Each GEMM quantizes its two operands along its own contraction axis, as the hardware
GEMMs need (torchao's rowwise and MX training do the same):
    forward   y  = x @ w       x per row (along K), w per column (along K)
    dgrad     dx = g @ w^T     g per row (along N), w per row (along N)
    wgrad     dw = x^T @ g     x per column (along M), g per column (along M)
With one scale per tensor the axis does not matter: the forward's quantized x and w are reused.
Products are summed in float32 (as float8 tensor cores accumulate) and cast to the input's dtype
(the GEMM's bfloat16 output). The recipes keep no state: nothing to checkpoint or agree on across
replicas. Under loss scaling the scaled gradient is quantized: its amax scales with the loss
scale, so for a power-of-two scale the quantized values are the unscaled ones times it (an
overflow is an infinite amax, which poisons the whole tensor, row or block: the step skips).
"""

from __future__ import annotations

import contextlib
import dataclasses

import tensorflow as tf

from trainer.nn import float8_quant


@dataclasses.dataclass(frozen=True)
class Recipe:
  name: str
  forward: str  # format of x and w: 'e4m3fn'
  gradient: str  # format of the output gradient: 'e5m2' or 'e4m3fn'
  scaling: str  # float8_quant.SCALINGS: 'tensor', 'axis' or 'block'
  float16: bool  # whether a float16 compute dtype is allowed (see RECIPES)
  source: str  # whose recipe this is


RECIPES = {
  # Per-tensor current scaling: torchao's tensorwise, Transformer Engine's Float8CurrentScaling
  # (HYBRID: e5m2 gradients). cuBLAS's per-tensor scaled GEMM writes float16 too.
  'tensorwise': Recipe(
    'tensorwise', 'e4m3fn', 'e5m2', 'tensor', True, 'torchao tensorwise / TE current scaling'
  ),
  # torchao's rowwise recipe: every operand e4m3, scales rounded down to powers of two. Its
  # row-wise scaled GEMM (torch._scaled_mm with per-row scales) writes bfloat16 only.
  'rowwise': Recipe('rowwise', 'e4m3fn', 'e4m3fn', 'axis', False, 'torchao rowwise'),
  # MXFP8 (OCP MX spec): 32-element blocks along the contraction axis, E8M0 scales; e5m2
  # gradients as Transformer Engine's MXFP8BlockScaling (HYBRID). Its block-scaled GEMMs write
  # bfloat16 or float32, and dequantized blocks span 2^+-127, far beyond float16.
  'mxfp8': Recipe('mxfp8', 'e4m3fn', 'e5m2', 'block', False, 'OCP MX / TE MXFP8BlockScaling'),
  # The same with torchao's RCEIL scale (NVIDIA's cuBLAS MX rounding): 2^ceil(log2(amax / fmax)).
  'mxfp8_rceil': Recipe(
    'mxfp8_rceil', 'e4m3fn', 'e5m2', 'block_rceil', False, 'torchao MX, RCEIL scales'
  ),
}


_observers: list = []  # observe(): called with each quantized operand


@contextlib.contextmanager
def observe(record):
  """While active, `record(name, operand, counts)` for every operand quantized in a GEMM given a
  `name`: operand 'x', 'w' (as the forward quantizes them) or 'g' (as the input-gradient GEMM
  does), counts = float8_quant.counts. For measurements (benchmarks/float8_recipes.py), run
  eagerly; a step compiled meanwhile would keep the calls in its graph."""
  _observers.append(record)
  try:
    yield
  finally:
    _observers.remove(record)


def _note(name, operand, t, fmt, scaling, axis):
  for record in _observers if name else ():
    record(name, operand, float8_quant.counts(t, fmt, scaling, axis))


def matmul(x: tf.Tensor, w: tf.Tensor, recipe: Recipe, name: str = '') -> tf.Tensor:
  """x [M, K] @ w [K, N] as `recipe`'s float8 GEMM, forward and backward; in x's dtype. `name`
  (a layer's path) labels its operands for `observe`."""
  fwd, grd, scaling = recipe.forward, recipe.gradient, recipe.scaling
  qdq = lambda t, fmt, axis: float8_quant.fused(fmt, scaling, axis)(t)  # noqa: E731

  @tf.custom_gradient
  def gemm(x, w):
    xq, wq = qdq(x, fwd, 1), qdq(w, fwd, 0)
    _note(name, 'x', x, fwd, scaling, 1)
    _note(name, 'w', w, fwd, scaling, 0)

    def grad(g):
      _note(name, 'g', g, grd, scaling, 1)
      if scaling == 'tensor':  # one scale per tensor: the forward's operands serve again
        gq = qdq(g, grd, 1)
        dx = tf.matmul(gq, wq, transpose_b=True)
        dw = tf.matmul(xq, gq, transpose_a=True)
      else:
        dx = tf.matmul(qdq(g, grd, 1), qdq(w, fwd, 1), transpose_b=True)
        dw = tf.matmul(qdq(x, fwd, 0), qdq(g, grd, 0), transpose_a=True)
      return tf.cast(dx, x.dtype), tf.cast(dw, w.dtype)

    return tf.cast(tf.matmul(xq, wq), x.dtype), grad

  return gemm(x, w)


def dense(x: tf.Tensor, w: tf.Tensor, recipe: Recipe, name: str = '') -> tf.Tensor:
  """x [..., K] @ w [K, N]: the leading axes folded into M."""
  k, n = w.shape
  shape = tf.shape(x)
  y = matmul(tf.reshape(x, [-1, k]), w, recipe, name)
  return tf.reshape(y, tf.concat([shape[:-1], [n]], 0))
