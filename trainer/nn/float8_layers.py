"""A current-scaling float8 recipe (trainer/nn/float8_gemm.py) applied to a built model's Dense
and EinsumDense layers, and to layers that name their projection kernels (FLOAT8_KERNELS, such as
CausalSelfAttention's query/key/value and output projections).

Each such layer gets an instance attribute `call` (Dense, EinsumDense) or `float8_matmul` (the
projections) computing its GEMMs in float8; its variables are not touched, so checkpoints and the
hooks of the numerics tools (trainer/insight/hooks.py, which wrap an instance's `call`) see the
same model. Left out: layers computing in float32 under a 16-bit policy (the float32 logits,
`precision.float32_layers`) and, under any policy, the layers `precision.float32_layers` names
(so a float32-compute run quantizes the same layers as its mixed_bfloat16 twin).
`layer.float8_recipe` names the recipe on every quantized layer.
"""

from __future__ import annotations

import math
import string

import keras
import tensorflow as tf

from trainer.errors import ConfigError
from trainer.nn import float8_gemm, float8_quant

KEY = 'config.precision.float8'


def apply(model, name: str, policy: str, leave_out: tuple[str, ...] = ()) -> list[str]:
  """Quantizes `model`'s layers with recipe `name` under the global `policy` (a resolved policy
  name), except those named in `leave_out` (precision.float32_layers) and the layers nested in
  them; the quantized layers' paths. ConfigError for an mxfp8 layer whose contraction axes do
  not divide into 32-element blocks (a recipe's float16 compute: run/build.py's check_config)."""
  recipe = float8_gemm.RECIPES[name]
  sixteen = keras.mixed_precision.dtype_policy().compute_dtype != 'float32'
  done = []
  # pylint: disable-next=protected-access
  for layer in model._flatten_layers(include_self=False):
    if (sixteen and layer.compute_dtype == 'float32') or _named(layer, leave_out):
      continue  # a float32 layer stays float32
    if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
      _check_blocks(layer, recipe, [layer.kernel])
      call = _dense_call if isinstance(layer, keras.layers.Dense) else _einsum_call
      object.__setattr__(layer, 'call', call(layer, recipe))
    elif getattr(layer, 'FLOAT8_KERNELS', None):
      _check_blocks(layer, recipe, [getattr(layer, k) for k in layer.FLOAT8_KERNELS])
      matmul = lambda x, w, r=recipe, p=layer.path: float8_gemm.matmul(x, w, r, p)  # noqa: E731
      object.__setattr__(layer, 'float8_matmul', matmul)
    else:
      continue
    object.__setattr__(layer, 'float8_recipe', name)
    done.append(layer.path)
  return done


def _named(layer, names: tuple[str, ...]) -> bool:
  """Whether `layer` or a layer it is nested in is one of `names` (a name, or a path as the
  numerics line prints it): the match precision.float32_layers makes."""
  parts = (getattr(layer, 'path', None) or layer.name).split('/')
  paths = {'/'.join(parts[i:j]) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)}
  return layer.name in names or any(n in paths for n in names)


def _check_blocks(layer, recipe, kernels) -> None:
  """mxfp8: the forward GEMM contracts over K (the kernel's input size), the input-gradient GEMM
  over N (its output size): both must be whole 32-element blocks. (The weight-gradient GEMM
  contracts over the batch, whose ragged tail is padded with zeros.)"""
  if recipe.scaling != 'block':
    return
  for kernel in kernels:
    k, n = _contraction_sizes(layer, kernel)
    if k % float8_quant.BLOCK or n % float8_quant.BLOCK:
      raise ConfigError(
        f"{KEY}='mxfp8': layer {layer.path} contracts over K={k} (forward) and N={n} (input "
        f'gradient); both must be multiples of {float8_quant.BLOCK} (MX blocks): leave it out '
        'with config.precision.float32_layers or use another recipe'
      )


def _contraction_sizes(layer, kernel) -> tuple[int, int]:
  """(K, N) of the layer's GEMM with `kernel`."""
  if isinstance(layer, keras.layers.EinsumDense):
    _, b, _, _, contracted, _ = _einsum_plan(layer)
    k = math.prod(int(kernel.shape[b.index(c)]) for c in contracted)
    return k, math.prod(int(d) for d in kernel.shape) // k
  return int(kernel.shape[0]), int(kernel.shape[-1])


def _finish(layer, y):
  if layer.bias is not None:
    y = y + tf.cast(layer.bias, layer.compute_dtype)
  return layer.activation(y) if layer.activation is not None else y


def _dense_call(layer, recipe):
  def call(inputs, training=None):
    dtype = layer.compute_dtype
    x, kernel = tf.cast(inputs, dtype), tf.cast(layer.kernel, dtype)
    y = float8_gemm.dense(x, kernel, recipe, layer.path)
    return _finish(layer, y)

  return call


def _einsum_call(layer, recipe):
  """EinsumDense's einsum as one 2-D GEMM: x's free axes folded into M, the contracted ones into
  K, the kernel's free axes into N; then back to the equation's output order."""

  def call(inputs, training=None):
    dtype = layer.compute_dtype
    x, kernel = tf.cast(inputs, dtype), tf.cast(layer.kernel, dtype)
    a, b, out, free, contracted, kfree = _einsum_plan(layer, len(x.shape))
    xt = tf.einsum(f'{a}->{free}{contracted}', x)
    kt = tf.einsum(f'{b}->{contracted}{kfree}', kernel)
    k = int(kt.shape[: len(contracted)].num_elements())
    n = int(kt.shape[len(contracted) :].num_elements())
    y = float8_gemm.matmul(tf.reshape(xt, [-1, k]), tf.reshape(kt, [k, n]), recipe, layer.path)
    shape = tf.concat([tf.shape(xt)[: len(free)], kt.shape[len(contracted) :]], 0)
    return _finish(layer, tf.einsum(f'{free}{kfree}->{out}', tf.reshape(y, shape)))

  return call


def _einsum_plan(layer, rank: int | None = None) -> tuple[str, str, str, str, str, str]:
  """(x's subscripts, the kernel's, the output's, x's free axes, the contracted axes, the
  kernel's free axes) of an EinsumDense equation, x's '...' spelled out for a rank-`rank` x.
  ConfigError for an equation that is not one GEMM (an axis shared by x, the kernel and the
  output, or an ellipsis in the kernel)."""
  left, out = layer.equation.split('->')
  a, b = left.split(',')
  if '...' in a and rank is not None:
    unused = [c for c in string.ascii_letters if c not in layer.equation]
    fill = ''.join(unused[: rank - (len(a) - 3)])
    a, out = a.replace('...', fill), out.replace('...', fill)
  contracted = ''.join(c for c in a if c in b and c not in out)
  free = ''.join(c for c in a if c not in b)
  kfree = ''.join(c for c in b if c not in a)
  if '...' in b or not contracted or sorted(out) != sorted(free + kfree):
    raise ConfigError(
      f'{KEY}: layer {layer.path} (EinsumDense {layer.equation!r}) is not one GEMM (x free, '
      'contracted, kernel free axes); leave it out with config.precision.float32_layers'
    )
  return a, b, out, free, contracted, kfree
