"""Precision policies: resolve 'auto' from the hardware and set the Keras global policy.

Every policy keeps float32 master weights; mixed_* compute in float16/bfloat16. Models keep
their final logits float32 (`dtype='float32'` on the last layer) and the loss is float32.
`config.precision.float32_layers` names layers kept in float32 under a mixed policy
(`build_model`, through Keras per-layer dtype policies).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import re
from collections.abc import Callable, Iterable, Iterator

import keras
import tensorflow as tf
from absl import logging

from trainer.step import contract
from trainer import config
from trainer.nn import float8_layers
from trainer.errors import ConfigError

POLICIES = config.PRECISION_POLICIES


@functools.cache
def cpu_flags() -> frozenset[str]:
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('flags'):
          return frozenset(line.split(':', 1)[1].split())
  except OSError:
    pass
  return frozenset()


# On a CPU, bfloat16 pays where the matmuls are wide: oneDNN's bfloat16 kernels halve a wide
# matmul's time, while every cast, float32 island and element-wise op stays as slow, and a narrow
# model's step is mostly those (nanoGPT's CPU shape, width 128, trains faster in float32 with XLA
# than in bfloat16; width 512 about 1.6x faster in bfloat16: docs/guides/performance.md).
CPU_BFLOAT16_WIDTH = 256


def resolve(name: str, width: Callable[[], float] | None = None) -> tuple[str, str]:
  """(policy, reason). 'auto': mixed_float16 on a GPU with compute capability >= 7.0,
  mixed_bfloat16 on a TPU, and on a CPU with AVX512_BF16 or AMX when the model's matmuls are
  at least CPU_BFLOAT16_WIDTH wide (`width()`, `matmul_width` of the model: asked only then),
  float32 otherwise."""
  if name != 'auto':
    return name, 'set by config.precision.policy'
  if tf.config.list_logical_devices('TPU'):
    return 'mixed_bfloat16', 'TPU found (bfloat16 is native)'
  for gpu in tf.config.list_physical_devices('GPU'):
    cc = tf.config.experimental.get_device_details(gpu).get('compute_capability')
    if cc and cc >= (7, 0):
      return 'mixed_float16', f'GPU with compute capability {cc[0]}.{cc[1]} (tensor cores)'
  if tf.config.list_physical_devices('GPU'):
    return 'float32', 'GPU older than compute capability 7.0 (no fast float16)'
  flags = cpu_flags()
  for flag in ('amx_bf16', 'avx512_bf16'):
    if flag in flags:
      wide = width() if width is not None else float('inf')
      if wide >= CPU_BFLOAT16_WIDTH:
        return 'mixed_bfloat16', f'CPU has {flag.upper()} (fast bfloat16)' + (
          f' and the matmuls are {wide:.0f} wide' if width is not None else ''
        )
      return 'float32', (
        f'CPU has {flag.upper()}, but the matmuls are {wide:.0f} wide, under '
        f'{CPU_BFLOAT16_WIDTH}: too narrow for bfloat16 to pay; --race=50 measures it'
      )
  return 'float32', 'CPU without AVX512_BF16 or AMX (no fast low precision)'


def matmul_width(model: keras.Model) -> float:
  """How wide the model's matmuls are: the median over its kernels' parameters of each
  kernel's smaller side (a [K, N] kernel, or a convolution's [..., N] with K its other sides'
  product), 0 without kernels. A matmul's 16-bit speed-up grows with it."""
  sides = sorted(
    (min(int(tf.size(w)) // int(w.shape[-1]), int(w.shape[-1])), int(tf.size(w)))
    for w in model.trainable_weights
    if len(w.shape) >= 2 and 'kernel' in w.path.rsplit('/', 1)[-1]
  )
  half, seen = sum(n for _, n in sides) / 2, 0
  for side, n in sides:
    seen += n
    if seen >= half:
      return float(side)
  return 0.0


def probe_width(build_model: Callable[[], keras.Model], seed: int) -> float:
  """`matmul_width` of a model `build_model` builds under float32 and that is then dropped,
  leaving no trace: Keras's default layer names (dense, dense_1, ...) count per process and the
  random generator moves, and the model built next must get the names and initial weights a
  run with that policy set explicitly gets."""
  from keras.src.backend.common import global_state  # the name counters: Keras has no API

  names = dict(global_state.get_global_attribute('object_name_uids') or {})
  base = keras.config.dtype_policy()
  keras.config.set_dtype_policy('float32')
  try:
    return matmul_width(build_model())
  finally:
    keras.config.set_dtype_policy(base)
    global_state.set_global_attribute('object_name_uids', collections.defaultdict(int, names))
    keras.utils.set_random_seed(seed)


def has_fast_float16() -> bool:
  for gpu in tf.config.list_physical_devices('GPU'):
    cc = tf.config.experimental.get_device_details(gpu).get('compute_capability')
    if cc and cc >= (7, 0):
      return True
  return False


def apply(name: str, width: Callable[[], float] | None = None) -> str:
  """Resolves and sets the global Keras policy before any model is built; returns its name."""
  policy, reason = resolve(name, width)
  logging.info('precision policy: %s (%s)', policy, reason)
  if policy == 'mixed_float16' and not has_fast_float16():
    logging.warning(
      'mixed_float16 on hardware without fast float16: float16 is emulated here, '
      'so this will be slower than float32 (use mixed_bfloat16 or float32 for '
      'speed).'
    )
  keras.mixed_precision.set_global_policy(policy)
  return policy


def apply_float8(model: keras.Model, recipe: str, policy: str, float32_layers: str = '') -> None:
  """config.precision.float8 on a built model under the resolved `policy`: 'none' leaves it,
  'delayed' is Keras's (quantize_float8), the others are current-scaling recipes applied to the
  layers that do not compute in float32 and are not named in `float32_layers` (the value of
  precision.float32_layers; trainer/nn/float8_layers.py)."""
  if recipe == 'delayed':
    quantize_float8(model)
  elif recipe != 'none':
    layers = float8_layers.apply(model, recipe, policy, parse_layer_names(float32_layers))
    logging.info('float8 %s: %d layers (%s)', recipe, len(layers), ', '.join(layers))


def quantize_float8(model: keras.Model) -> None:
  """config.precision.float8: Keras's float8 training for every Dense and EinsumDense layer
  (`model.quantize('float8')`: inputs, kernels and output gradients are cast to float8 with
  per-tensor scales from an amax history). Without float8 hardware (e.g. on a CPU) the casts
  are emulated (quantize-dequantize): the numerics are float8's, the speed is not."""
  import warnings

  with warnings.catch_warnings():  # "Layer InputLayer does not have a `quantize` method"
    warnings.simplefilter('ignore', UserWarning)
    model.quantize('float8')


def parse_layer_names(text: str) -> tuple[str, ...]:
  """'culprit, block0_ln1' -> ('culprit', 'block0_ln1'): the value of precision.float32_layers."""
  return tuple(dict.fromkeys(n.strip() for n in text.split(',') if n.strip()))


@contextlib.contextmanager
def float32_layers(names: str | Iterable[str], bfloat16_variables: bool = False) -> Iterator[None]:
  """Layers constructed inside this scope whose name is in `names` (and every layer nested in
  them) compute in float32 under a mixed global policy; the others keep the global policy.

  Keras's own mechanism: the global policy becomes a `keras.dtype_policies.DTypePolicyMap` whose
  default is the current policy and whose entries map the layer paths `(.*/)?name(/.*)?` to
  float32. A layer built with no explicit `dtype` holds the map and looks its policy up by its
  path when it is built, so the choice is made before any weight exists; a layer given an
  explicit dtype (such as float32 logits) keeps it. Outside the scope the global policy is the
  plain one again; no-op without names or under a non-mixed policy.

  `bfloat16_variables` (config.precision.master_weights bfloat16_*, under mixed_bfloat16): the
  other layers get Keras's 'bfloat16' policy instead: bfloat16 variables, the same bfloat16
  compute as mixed_bfloat16 (run/build.py's check_config refuses them under another policy)."""
  names = parse_layer_names(names) if isinstance(names, str) else tuple(names)
  base = keras.config.dtype_policy()
  if not (names or bfloat16_variables) or not base.name.startswith('mixed_'):
    yield
    return
  default = keras.DTypePolicy('bfloat16') if bfloat16_variables else base
  policy_map = keras.dtype_policies.DTypePolicyMap(default_policy=default)
  for name in names:
    policy_map[f'(.*/)?{re.escape(name)}(/.*)?'] = keras.DTypePolicy('float32')
  keras.config.set_dtype_policy(policy_map)
  try:
    yield
  finally:
    keras.config.set_dtype_policy(base)


def build_model(
  build: Callable[[], keras.Model], names_text: str, bfloat16_variables: bool = False
) -> keras.Model:
  """`build()` (a Trainer's build_model) with the layers named in `names_text` (the value of
  config.precision.float32_layers) kept in float32; ConfigError when a name matches no layer.
  `bfloat16_variables`: the other layers store bfloat16 variables (see float32_layers)."""
  names = parse_layer_names(names_text)
  with float32_layers(names, bfloat16_variables):
    model = build()
  contract.check_model(model)
  if names:
    # pylint: disable-next=protected-access
    layers = list(model._flatten_layers(include_self=False))
    found = {layer.name for layer in layers}
    # A path as the numerics line prints it ('net/big') names the layer too.
    paths = [getattr(layer, 'path', None) or layer.name for layer in layers]
    missing = [
      n for n in names if n not in found and not any(p == n or p.endswith('/' + n) for p in paths)
    ]
    if missing:
      raise ConfigError(
        f'config.precision.float32_layers={names_text!r}: no layer named '
        f'{", ".join(missing)} in the model; layer names: '
        f'{", ".join(sorted(found))}.'
      )
  return model
