"""A current-scaling float8 recipe (trainer/nn/float8_gemm.py) applied to a built model's Dense
and EinsumDense layers, and to layers that name their projection kernels (FLOAT8_KERNELS, such as
CausalSelfAttention's query/key/value and output projections).

Each such layer gets an instance attribute `call` (Dense, EinsumDense) or `float8_matmul` (the
projections) computing its GEMMs in float8; its variables are not touched, so checkpoints and the
hooks of the numerics tools (trainer/insight/hooks.py, which wrap an instance's `call`) see the
same model. Left out: layers computing in float32 under a 16-bit policy (the float32 logits,
`precision.float32_layers`) and, under any policy, the layers `precision.float32_layers` names
(so a float32-compute run quantizes the same layers as its mixed_bfloat16 twin). Chosen by path,
in the spirit of torchao's `module_filter_fn`: `precision.float8_layers` (only these),
`precision.float8_skip` (not these). A layer whose GEMM does not fit the recipe (mxfp8's 32-element
blocks) stays in the compute policy, named in one line with the reason, as torchao's recipes skip
the layers whose dimensions do not fit. `layer.float8_recipe` names the recipe on every quantized
layer.
"""

from __future__ import annotations

import math
import string

import keras
import tensorflow as tf

from trainer.errors import ConfigError
from trainer.nn import float8_gemm, float8_quant

KEY = 'config.precision.float8'


def apply(
  model, name: str, leave_out: tuple[str, ...] = (), only: tuple[str, ...] = (), skip=()
) -> tuple[list[str], list[str]]:
  """Quantizes `model`'s layers with recipe `name` under the global policy, except those named in
  `leave_out` (precision.float32_layers) or `skip` (precision.float8_skip) and the layers nested
  in them; with `only` (precision.float8_layers), only the layers it names (and those nested in
  them). A layer whose GEMM does not fit the recipe (mxfp8: axes not in whole 32-element blocks;
  an EinsumDense that is not one GEMM) stays in the compute policy, unless `only` names it
  itself: then a ConfigError. Returns (the quantized layers' paths, 'path (why)' of those left
  out for not fitting). A name in `only` or `skip` that matches no layer is a ConfigError."""
  recipe = float8_gemm.RECIPES[name]
  sixteen = keras.mixed_precision.dtype_policy().compute_dtype != 'float32'
  done: list[str] = []
  misfits: list[str] = []
  used: set[str] = set()
  # pylint: disable-next=protected-access
  layers = list(model._flatten_layers(include_self=False))
  for layer in layers:
    used.update(n for n in (*only, *skip) if _named(layer, (n,)))
    if (sixteen and layer.compute_dtype == 'float32') or _named(layer, leave_out + tuple(skip)):
      continue  # a float32 layer stays float32
    if only and not _named(layer, only):
      continue
    kernels = _kernels(layer)
    if not kernels:
      continue
    why = _misfit(layer, recipe, kernels)
    if why and (layer.name in only or layer.path in only):
      raise ConfigError(
        f"{KEY}='{name}': layer {layer.path} {why}; take it out of "
        'config.precision.float8_layers or use another recipe'
      )
    if why:
      misfits.append(f'{layer.path} ({why})')
      continue
    if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
      call = _dense_call if isinstance(layer, keras.layers.Dense) else _einsum_call
      object.__setattr__(layer, 'call', call(layer, recipe))
    else:
      matmul = lambda x, w, r=recipe, p=layer.path: float8_gemm.matmul(x, w, r, p)  # noqa: E731
      object.__setattr__(layer, 'float8_matmul', matmul)
    object.__setattr__(layer, 'float8_recipe', name)
    done.append(layer.path)
  for key, names in (('float8_layers', only), ('float8_skip', skip)):
    if missing := [n for n in names if n not in used]:
      raise ConfigError(
        f'config.precision.{key}={",".join(names)!r}: no layer named {", ".join(missing)} in '
        f'the model; layer names: {", ".join(sorted(x.name for x in layers))}'
      )
  return done, misfits


def _kernels(layer) -> list:
  """The kernels of the GEMMs a recipe computes in `layer`: Dense's and EinsumDense's, or the
  projections a layer names (FLOAT8_KERNELS); [] for any other layer."""
  if isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
    return [layer.kernel]
  return [getattr(layer, k) for k in getattr(layer, 'FLOAT8_KERNELS', None) or ()]


def _named(layer, names: tuple[str, ...]) -> bool:
  """Whether `layer` or a layer it is nested in is one of `names` (a name, or a path as the
  numerics line prints it): the match precision.float32_layers makes."""
  parts = (getattr(layer, 'path', None) or layer.name).split('/')
  paths = {'/'.join(parts[i:j]) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)}
  return layer.name in names or any(n in paths for n in names)


def _misfit(layer, recipe, kernels) -> str | None:
  """Why `layer`'s GEMMs do not fit `recipe`, or None. An EinsumDense must be one GEMM. mxfp8:
  the forward GEMM contracts over K (the kernel's input size), the input-gradient GEMM over N
  (its output size): both must be whole 32-element blocks (the weight-gradient GEMM contracts
  over the batch, whose ragged tail is padded with zeros)."""
  if isinstance(layer, keras.layers.EinsumDense):
    try:
      _einsum_plan(layer)
    except ConfigError:
      return f'(EinsumDense {layer.equation!r}) is not one GEMM'
  if not recipe.scaling.startswith('block'):
    return None
  for kernel in kernels:
    k, n = _contraction_sizes(layer, kernel)
    if k % float8_quant.BLOCK or n % float8_quant.BLOCK:
      return (
        f'contracts over K={k} (forward) and N={n} (input gradient); mxfp8 needs both in '
        f'multiples of {float8_quant.BLOCK} (MX blocks)'
      )
  return None


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
    return _finish(layer, float8_gemm.dense(x, kernel, recipe, layer.path))

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
      'contracted, kernel free axes); leave it out with config.precision.float8_skip'
    )
  return a, b, out, free, contracted, kfree
