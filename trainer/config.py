"""The config schema shared by every model: names, types, defaults and validation.

`defaults()` returns a ConfigDict holding every key below with its default; config files in
`configs/` start from it or spell every key out. `validate(config)` fills keys a config file left
out, checks every value and raises `ConfigError` naming the key (e.g. `config.train.batch_size`).
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable, NamedTuple

import ml_collections

from trainer.errors import ConfigError


class Key(NamedTuple):
  type: type
  default: Any
  help: str
  check: Callable[[Any], str | None] | None = None  # returns a complaint, or None when fine


def _positive(v):
  return None if v > 0 else 'must be > 0'


def _non_negative(v):
  return None if v >= 0 else 'must be >= 0'


def _one_of(*choices):
  def check(v):
    return None if v in choices else f'must be one of {", ".join(choices)}'
  return check


def _loss_scale(v):
  if v in ('auto', 'none', 'dynamic'):
    return None
  try:
    number = float(v)
  except ValueError:
    return "must be 'auto', 'none', 'dynamic' or a positive number such as '128'"
  if not math.isfinite(number) or number <= 0:
    return 'a static loss scale must be a positive finite number'
  return None


SCHEMA: dict[str, Key] = {
    'model': Key(str, 'mnist_cnn', 'module in models/ holding the Trainer subclass'),
    'seed': Key(int, 0, 'seeds Python, NumPy, TF and the input pipeline'),
    'data.dir': Key(str, '', "folder with the dataset files; '' downloads them"),
    'train.batch_size': Key(int, 128, 'global batch', _positive),
    'train.epochs': Key(int, 5, 'length of training, unless train.steps > 0', _positive),
    'train.steps': Key(int, 0, 'total steps when > 0', _non_negative),
    'train.steps_per_loop': Key(int, 100, 'steps per compiled call', _positive),
    'train.log_every': Key(int, 100, 'steps between log lines and summaries', _positive),
    'train.eval_every': Key(int, 0, 'steps between evals; 0 = only at the end', _non_negative),
    'train.checkpoint_every': Key(int, 1000, 'steps between checkpoints (and at the end)',
                                  _positive),
    'train.max_to_keep': Key(int, 3, 'checkpoints kept', _positive),
    'train.jit_compile': Key(str, 'auto', "XLA for the per-replica step: 'auto' is on for "
                             'GPU/TPU, off on CPU', _one_of('auto', 'true', 'false')),
    'train.deterministic': Key(bool, False, 'op determinism: a resumed run is bit-identical'),
    'train.grad_accum_steps': Key(int, 1, 'micro-batches per optimizer step: the global batch '
                                  'is split into this many, gradients summed',
                                  lambda v: None if v >= 1 else 'must be >= 1'),
    'train.init_from': Key(str, '', "a workdir (or checkpoint) whose model weights a new run "
                           "starts from; '' = random init"),
    'train.remat': Key(bool, False, 'gradient checkpointing: the blocks a model marks '
                       '(trainer/remat.py) recompute their activations in the backward pass '
                       'instead of keeping them'),
    'train.profile_steps': Key(str, '', "'start,end': a TF profiler trace of those global steps "
                               "into the workdir's TensorBoard; '' = off"),
    'optimizer.name': Key(str, 'adam', 'optimizer', _one_of('adam', 'adamw', 'sgd')),
    'optimizer.learning_rate': Key(float, 1e-3, 'peak learning rate', _positive),
    'optimizer.schedule': Key(str, 'constant', 'learning-rate schedule after warm-up',
                              _one_of('constant', 'cosine')),
    'optimizer.warmup_steps': Key(int, 0, 'linear warm-up from 0 to the peak', _non_negative),
    'optimizer.weight_decay': Key(float, 0.0, 'decoupled weight decay', _non_negative),
    'optimizer.clip_norm': Key(float, 0.0, 'global-norm clipping of the unscaled gradients; '
                               '0 = off', _non_negative),
    'optimizer.momentum': Key(float, 0.9, 'momentum (sgd only)', _non_negative),
    'optimizer.fused': Key(bool, True, "one TF kernel per variable update (Keras's formulas); "
                           "False = Keras's own element-wise update"),
    'precision.policy': Key(str, 'auto', 'dtype policy', _one_of(
        'auto', 'float32', 'mixed_float16', 'mixed_bfloat16')),
    'precision.loss_scale': Key(str, 'auto', "'auto', 'none', 'dynamic' or a static number",
                                _loss_scale),
    'precision.initial_scale': Key(float, 32768.0, 'first dynamic scale', _positive),
    'precision.growth_interval': Key(int, 2000, 'finite steps in a row before the scale grows',
                                     lambda v: None if v >= 1 else 'must be >= 1'),
    'precision.growth_factor': Key(float, 2.0, 'scale multiplier on growth',
                                   lambda v: None if v > 1 else 'must be > 1'),
    'precision.backoff_factor': Key(float, 0.5, 'scale multiplier on a non-finite step',
                                    lambda v: None if 0 < v < 1 else 'must be in (0, 1)'),
    'precision.min_scale': Key(float, 1.0, 'floor of the dynamic scale', _positive),
    'precision.max_scale': Key(float, 16777216.0, 'cap of the dynamic scale', _positive),
    'precision.hysteresis': Key(int, 1, 'non-finite steps in a row that back the scale off',
                                lambda v: None if v >= 1 else 'must be >= 1'),
    'precision.max_consecutive_skips': Key(int, 50, 'skipped steps in a row that stop training '
                                           'with an error; 0 = never stop', _non_negative),
    'distribute.strategy': Key(str, 'default', "'default' (one device), 'mirrored' (local "
                               "GPUs), 'multi_worker' (hosts from TF_CONFIG) or 'tpu'",
                               _one_of('default', 'mirrored', 'multi_worker', 'tpu')),
    'distribute.devices': Key(str, '', "mirrored only: comma-separated devices such as "
                              "'GPU:0,GPU:1'; '' = all local GPUs"),
    'distribute.tpu': Key(str, '', "tpu only: TPU name or 'grpc://host:port'; '' = the TPU "
                          'of this host'),
    'debug.inject_nonfinite_every': Key(int, 0, 'make every N-th step non-finite; 0 = off',
                                        _non_negative),
    'debug.inject_nonfinite_steps': Key(str, '', 'comma-separated global steps made '
                                        'non-finite'),
    'debug.inject_nonfinite_replica': Key(int, -1, 'replica whose gradients the injection '
                                          'poisons; -1 = all replicas',
                                          lambda v: None if v >= -1 else 'must be >= -1'),
}


def load_file(path: str) -> ml_collections.ConfigDict:
  """`get_config()` of a config file such as configs/mnist.py, loaded by path."""
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      f'_config_{os.path.splitext(os.path.basename(path))[0]}', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def defaults() -> ml_collections.ConfigDict:
  """A ConfigDict with every key of the schema at its default."""
  config = ml_collections.ConfigDict()
  for name, key in SCHEMA.items():
    set_dotted(config, name, key.default)
  return config


def set_dotted(config, dotted: str, value) -> None:
  """config['a']['b'] = value for dotted 'a.b', on a ConfigDict or a plain dict; missing parents
  are created (as ConfigDicts)."""
  *parents, leaf = dotted.split('.')
  node = config
  for part in parents:
    if part not in node:
      node[part] = ml_collections.ConfigDict()
    node = node[part]
  node[leaf] = value


def _get(config, dotted):
  node = config
  for part in dotted.split('.'):
    if not hasattr(node, 'keys') or part not in node:
      raise KeyError(dotted)
    node = node[part]
  return node


def flatten(config, prefix='') -> dict[str, Any]:
  """{'train.batch_size': 128, ...} for every leaf of a (nested) ConfigDict or dict."""
  flat = {}
  for key, value in config.items():
    name = f'{prefix}{key}'
    if hasattr(value, 'items'):
      flat.update(flatten(value, name + '.'))
    else:
      flat[name] = value
  return flat


def _coerce(name, key, value):
  if key.type is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if key.type is str and isinstance(value, (int, float)) and not isinstance(value, bool):
    return str(value)
  if key.type is bool and isinstance(value, str) and value.lower() in ('true', 'false'):
    return value.lower() == 'true'
  if not isinstance(value, key.type) or (key.type is int and isinstance(value, bool)):
    raise ConfigError(f'config.{name} must be {key.type.__name__}, got {value!r} '
                      f'({type(value).__name__})')
  return value


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Returns a copy of `config` with missing keys filled in; raises ConfigError on bad values.

  Keys a model adds for itself (e.g. `model_config.*`) pass through unchecked.
  """
  config = ml_collections.ConfigDict(config.to_dict())
  for name, key in SCHEMA.items():
    try:
      value = _get(config, name)
    except KeyError:
      set_dotted(config, name, key.default)
      continue
    value = _coerce(name, key, value)
    if key.check is not None and (complaint := key.check(value)):
      raise ConfigError(f'config.{name}={value!r}: {complaint}.')
    set_dotted(config, name, value)

  p, t = config.precision, config.train
  if p.min_scale > p.max_scale:
    raise ConfigError(f'config.precision.min_scale={p.min_scale} is above '
                      f'config.precision.max_scale={p.max_scale}; make min_scale <= max_scale.')
  if not p.min_scale <= p.initial_scale <= p.max_scale:
    raise ConfigError(f'config.precision.initial_scale={p.initial_scale} must lie within '
                      f'[min_scale, max_scale] = [{p.min_scale}, {p.max_scale}].')
  for every in ('log_every', 'eval_every', 'checkpoint_every'):
    if t[every] % t.steps_per_loop:
      raise ConfigError(f'config.train.{every}={t[every]} must be a multiple of '
                        f'config.train.steps_per_loop={t.steps_per_loop}: logging, eval and '
                        'checkpoints happen between compiled calls.')
  if t.batch_size % t.grad_accum_steps:
    raise ConfigError(f'config.train.batch_size={t.batch_size} must be a multiple of '
                      f'config.train.grad_accum_steps={t.grad_accum_steps}.')
  parse_steps(config.debug.inject_nonfinite_steps)
  from trainer import profiling  # the parser lives with the profiler
  profiling.parse(config.train.profile_steps)
  return config


def parse_steps(text: str) -> tuple[int, ...]:
  """'3, 10,12' -> (3, 10, 12); ConfigError naming config.debug.inject_nonfinite_steps."""
  steps = []
  for part in filter(None, (p.strip() for p in text.split(','))):
    if not part.isdigit():
      raise ConfigError(f'config.debug.inject_nonfinite_steps={text!r}: {part!r} is not a '
                        'step number; give comma-separated non-negative integers.')
    steps.append(int(part))
  return tuple(sorted(set(steps)))


def diff(old: dict, new: dict) -> list[str]:
  """Flattened keys whose values differ between two configs (as dicts)."""
  a, b = flatten(old), flatten(new)
  return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
