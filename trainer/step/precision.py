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
from trainer.nn import float8_layers, paths
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


def resolve(name: str, float32_xla: bool = False) -> tuple[str, str]:
  """(policy, reason). 'auto': mixed_float16 on a GPU with compute capability >= 7.0,
  mixed_bfloat16 on a TPU or a CPU with AVX512_BF16 or AMX, float32 otherwise; and float32 on
  such a CPU where `float32_xla` (the config turns XLA on for float32 runs): XLA's CPU backend
  computes bfloat16 matmuls in float32, so bfloat16 there goes without XLA, and a config that
  asks for XLA says it pays for this model (configs/nanogpt_cpu.py: float32 with XLA is faster
  than bfloat16 without)."""
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
    if flag in flags and float32_xla:
      return 'float32', (
        f'CPU has {flag.upper()}, but train.jit_compile turns XLA on for float32 and XLA '
        "computes a CPU's bfloat16 matmuls in float32; --race=50 measures both"
      )
    if flag in flags:
      return 'mixed_bfloat16', f'CPU has {flag.upper()} (fast bfloat16)'
  return 'float32', 'CPU without AVX512_BF16 or AMX (no fast low precision)'


def has_fast_float16() -> bool:
  for gpu in tf.config.list_physical_devices('GPU'):
    cc = tf.config.experimental.get_device_details(gpu).get('compute_capability')
    if cc and cc >= (7, 0):
      return True
  return False


def apply(name: str, float32_xla: bool = False) -> str:
  """Resolves and sets the global Keras policy before any model is built; returns its name."""
  policy, reason = resolve(name, float32_xla)
  logging.info('precision policy: %s (%s)', policy, reason)
  if policy == 'mixed_float16' and not has_fast_float16():
    logging.warning(
      'mixed_float16 on hardware without fast float16: float16 is emulated here, '
      'so this will be slower than float32 (use mixed_bfloat16 or float32 for '
      'speed).'
    )
  keras.mixed_precision.set_global_policy(policy)
  return policy


def apply_float8(
  model: keras.Model, recipe: str, *, float32_layers: str = '', only: str = '', skip: str = ''
) -> None:
  """config.precision.float8 on a built model under the global policy: 'none' leaves it,
  'delayed' is Keras's (quantize_float8), the others are current-scaling recipes applied to the
  layers that do not compute in float32 and are not named in `float32_layers`, chosen by `only`
  and `skip` (the values of precision.float32_layers, float8_layers and float8_skip;
  trainer/nn/float8_layers.py). The layers left out because they do not fit: one warning line."""
  if recipe == 'delayed':
    quantize_float8(model)
  elif recipe != 'none':
    layers, misfits = float8_layers.apply(
      model,
      recipe,
      parse_layer_names(float32_layers),
      only=parse_layer_names(only),
      skip=parse_layer_names(skip),
    )
    logging.info('float8 %s: %d layers (%s)', recipe, len(layers), ', '.join(layers))
    if misfits:
      logging.warning(
        'float8 %s: %d layers left in the compute policy, their GEMMs do not fit the recipe: %s',
        recipe,
        len(misfits),
        '; '.join(misfits),
      )


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


def _pattern(names: Iterable[str]) -> str:
  """One regular expression for a layer path holding one of `names` (a name or a path) as whole
  path parts, the layer itself or one inside it. One key, not one per name: Keras's
  DTypePolicyMap refuses a path two keys match (`reaching` names such a pair first)."""
  return f'(.*/)?({"|".join(re.escape(n) for n in names)})(/.*)?'


@contextlib.contextmanager
def float32_layers(names: str | Iterable[str], bfloat16_variables: bool = False) -> Iterator[None]:
  """Layers constructed inside this scope whose name or path holds one of `names` (and every
  layer nested in them) compute in float32 under a mixed global policy; the others keep the
  global policy.

  Keras's own mechanism: the global policy becomes a `keras.dtype_policies.DTypePolicyMap` whose
  default is the current policy and whose one entry maps the layer paths holding a name to
  float32. A layer built with no explicit `dtype` holds the map and looks its policy up by its
  Keras path when it is built, so the choice is made before any weight exists; a layer given an
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
  if names:
    policy_map[_pattern(names)] = keras.DTypePolicy('float32')
  keras.config.set_dtype_policy(policy_map)
  try:
    yield
  finally:
    keras.config.set_dtype_policy(base)


def reaching(names: tuple[str, ...], model: keras.Model) -> dict[str, list]:
  """{name: the layers it reaches} for precision.float32_layers' `names`, by a layer's path in
  the model (trainer/nn/paths.py) or its Keras path. ConfigError when one layer is reached by two
  names (one holds the other: Keras's DTypePolicyMap would refuse the pair)."""
  found: dict[str, list] = {n: [] for n in names}
  for path, layer in paths.walk(model):
    keras_path = getattr(layer, 'path', None) or ''
    hit = [n for n in names if any(re.fullmatch(_pattern([n]), p) for p in (path, keras_path))]
    if len(hit) > 1:
      raise ConfigError(
        f'config.precision.float32_layers: {hit[0]!r} and {hit[1]!r} both reach layer {path} '
        "(one holds the other, which Keras's DTypePolicyMap refuses); keep the outer one"
      )
    for n in hit:
      found[n].append(layer)
  return found


@contextlib.contextmanager
def fresh_names() -> Iterator[None]:
  """Keras's automatic names (`dense`, `gpt2_backbone`) numbered from zero inside, as in a
  fresh process: Keras numbers them per process (the second build's backbone is
  `gpt2_backbone_1`), so the advisor's second build, its validation run or a test's would give
  the same config's layers other paths, and a path pasted into float32_layers would miss."""
  from keras.src.backend.common import global_state  # pylint: disable=import-outside-toplevel

  saved = global_state.get_global_attribute('object_name_uids')
  global_state.set_global_attribute('object_name_uids', collections.defaultdict(int))
  try:
    yield
  finally:
    global_state.set_global_attribute('object_name_uids', saved)


def build_model(
  build: Callable[[], keras.Model], names_text: str, bfloat16_variables: bool = False
) -> keras.Model:
  """`build()` (a Trainer's build_model) with the layers named in `names_text` (the value of
  config.precision.float32_layers) kept in float32; ConfigError when a name matches no layer,
  or when two reach the same layer (`reaching`).
  `bfloat16_variables`: the other layers store bfloat16 variables (see float32_layers).

  A layer is reached by its Keras path while it is built (`float32_layers`) and by its path in
  the model after: a nested functional model's layers were built before it existed, with Keras
  paths that miss its name, so a path as the audit and the advisor print it
  ('gpt2_causal_lm/gpt2_backbone/transformer_layer_1') reaches them only then. Under a mixed
  policy their variables are float32 either way; they and the layers inside them get the float32
  policy here."""
  names = parse_layer_names(names_text)
  with float32_layers(names, bfloat16_variables), fresh_names():
    model = build()
  contract.check_model(model)
  if not names:
    return model
  found = reaching(names, model)
  missing = [n for n, layers in found.items() if not layers]
  if missing:
    known = [p for p, _ in paths.walk(model)]
    raise ConfigError(
      f'config.precision.float32_layers={names_text!r}: no layer named '
      f'{", ".join(missing)} in the model; layer paths: {", ".join(known[:20])}'
      + (f' and {len(known) - 20} more' if len(known) > 20 else '')
    )
  if keras.config.dtype_policy().name.startswith('mixed_'):
    for layer in {id(l): l for ls in found.values() for l in ls}.values():
      _to_float32(layer, bfloat16_variables)
  return model


def _to_float32(layer, bfloat16_variables: bool) -> None:
  """`layer` and the layers inside it compute in float32 from now on (a built layer's variables
  are float32 under a mixed policy)."""
  # pylint: disable-next=protected-access
  for inner in layer._flatten_layers(include_self=True):
    if inner.compute_dtype == 'float32' or isinstance(inner, keras.layers.InputLayer):
      continue
    if bfloat16_variables and any(v.dtype != 'float32' for v in inner.weights):
      raise ConfigError(
        f'config.precision.float32_layers: layer {inner.path} was built with bfloat16 '
        'variables before its path in the model was known; name it by its Keras path '
        f'{inner.path!r}'
      )
    inner._dtype_policy = keras.DTypePolicy('float32')  # pylint: disable=protected-access
