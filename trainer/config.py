"""The config schema shared by every model: names, types, defaults and validation.

`defaults()` returns a ConfigDict holding every key below with its default; config files in
`configs/` start from it or spell every key out. `validate(config)` fills keys a config file left
out, checks every value and raises `ConfigError` naming the key (e.g. `config.train.batch_size`).
"""

from __future__ import annotations

import difflib
import math
import os
from typing import Any, NamedTuple
from collections.abc import Callable, Iterable

import ml_collections

from trainer import registry, steps_text

# Re-exported: config_lib.flatten, config_lib.set_dotted, config_lib.diff.
from trainer.dotted import diff, flatten, get as _get, set_dotted  # noqa: F401
from trainer.errors import ConfigError


class Key(NamedTuple):
  type: type
  default: Any
  help: str
  check: Callable[[Any], str | None] | None = None  # returns a complaint, or None when fine
  # Maps older spellings to the value before the type check (precision.float8: True, False). Such
  # a key's default is an untyped field, so a config file may assign either spelling.
  coerce: Callable[[Any], Any] | None = None


def _positive(v):
  return None if v > 0 else 'must be > 0'


def _non_negative(v):
  return None if v >= 0 else 'must be >= 0'


def _momentum(v):
  return None if 0 <= v < 1 else 'must be in [0, 1) (0 = no momentum)'


def _beta(v):
  return None if 0 <= v < 1 else 'must be in [0, 1)'


def _seed(v):
  return None if 0 <= v < 2**32 else 'must be in [0, 2**32) (NumPy and TF take 32-bit seeds)'


def _one_of(*choices):
  def check(v):
    return None if v in choices else f'must be one of {", ".join(choices)}'

  return check


def _jit_setting(v):
  bad = [] if v in SWITCHES else [p for p in v.split(',') if p not in PRECISION_POLICIES]
  if not bad:
    return None
  return (
    f'must be auto, true, false or policies from {", ".join(PRECISION_POLICIES)}, '
    f'comma-separated (not {", ".join(map(repr, bad))})'
  )


# The choices, defined here once (this module imports no TensorFlow); the modules that implement
# them (trainer/step/precision.py and loss_scale.py, trainer/distribute/strategy.py) read them here.
PRECISION_POLICIES = ('float32', 'mixed_float16', 'mixed_bfloat16')
POLICIES = ('auto', *PRECISION_POLICIES)
LOSS_SCALE_MODES = ('none', 'static', 'dynamic')
LOSS_SCALES = ('auto', *(m for m in LOSS_SCALE_MODES if m != 'static'))  # static: a number
STRATEGIES = ('default', 'mirrored', 'multi_worker', 'tpu')
SWITCHES = ('auto', 'true', 'false')  # train.grappler; train.jit_compile, or a list of policies
MASTER_WEIGHTS = ('float32', 'bfloat16_sr', 'bfloat16_kahan')  # trainer/optim/low_precision.py
STATE_BITS = (32, 8)
LOW_PRECISION_OPTIMIZERS = ('adam', 'adamw', 'sgd')  # the ones trainer/optim/low_precision.py has
# precision.float8: 'delayed' is Keras's model.quantize('float8'); the others are current-scaling
# recipes (trainer/nn/float8_gemm.py).
FLOAT8_RECIPES = ('none', 'delayed', 'tensorwise', 'rowwise', 'mxfp8', 'mxfp8_rceil')


def _float8_recipe(v):
  """The boolean precision.float8 of before recipes: True = 'delayed', False = 'none' (also as
  the strings 'true'/'false' of a command line)."""
  if isinstance(v, bool):
    return 'delayed' if v else 'none'
  if isinstance(v, str) and v.lower() in ('true', 'false'):
    return 'delayed' if v.lower() == 'true' else 'none'
  return v


def is_address(address: object) -> bool:
  """'host:port' (an IPv6 host in brackets) with a port in [1, 65535] and no spaces: the one
  check of a worker's address, for --cluster (trainer/launch/cluster.py) and TF_CONFIG
  (trainer/distribute/strategy.py)."""
  if not isinstance(address, str) or any(c.isspace() for c in address):
    return False
  host, _, port = address.rpartition(':')
  return bool(host.strip('[]')) and port.isdigit() and 0 < int(port) < 65536


def _loss_scale(v):
  if v in LOSS_SCALES:
    return None
  try:
    number = float(v)
  except ValueError:
    return f"must be {', '.join(repr(m) for m in LOSS_SCALES)} or a positive number such as '128'"
  if not math.isfinite(number) or number <= 0:
    return 'a static loss scale must be a positive finite number'
  return None


SCHEMA: dict[str, Key] = {
  'model': Key(
    str,
    'mnist_cnn',
    'module in models/ holding the Trainer subclass, or the dotted '
    'path of a module of your own (my_project.gan)',
  ),
  'seed': Key(int, 0, 'seeds Python, NumPy, TF and the input pipeline', _seed),
  'data.dir': Key(str, '', "folder with the dataset files; '' downloads them"),
  'train.batch_size': Key(int, 128, 'global batch', _positive),
  'train.epochs': Key(int, 5, 'length of training, unless train.steps > 0', _positive),
  'train.steps': Key(int, 0, 'total steps when > 0', _non_negative),
  'train.steps_per_loop': Key(int, 100, 'steps per compiled call', _positive),
  'train.log_every': Key(int, 100, 'steps between log lines and summaries', _positive),
  'train.eval_every': Key(int, 0, 'steps between evals; 0 = only at the end', _non_negative),
  'train.checkpoint_every': Key(int, 1000, 'steps between checkpoints, and at the end', _positive),
  'train.eval_max_batches': Key(
    int,
    0,
    'an eval set of more batches is an error (before training when its length is known, '
    'else when reached): a looping generator never ends an eval; 0 = no bound',
    _non_negative,
  ),
  'train.max_to_keep': Key(int, 3, 'checkpoints kept', _positive),
  'train.jit_compile': Key(
    str,
    'auto',
    "XLA for the per-replica step and the eval's forward pass: 'auto' (GPU/TPU: on, "
    "CPU: off), or the policies it is on under ('float32,...')",
    _jit_setting,
  ),
  'train.grappler': Key(
    str,
    'auto',
    "TensorFlow's graph optimizer (grappler) on the train and eval loops: 'auto' (GPU/TPU: "
    "on, CPU: off), 'true' or 'false'",
    _one_of(*SWITCHES),
  ),
  'train.intra_op_threads': Key(
    int,
    0,
    "threads of TensorFlow's pool that splits one op "
    "(a matmul) across cores; 0 = TensorFlow's choice (one per "
    'core)',
    _non_negative,
  ),
  'train.inter_op_threads': Key(
    int,
    0,
    "threads of TensorFlow's pool that runs independent ops at once; 0 = TensorFlow's choice",
    _non_negative,
  ),
  'train.deterministic': Key(bool, False, 'op determinism: a resumed run is bit-identical'),
  'train.grad_accum_steps': Key(
    int,
    1,
    'micro-batches per optimizer step: the global batch is split into this many, gradients summed',
    lambda v: None if v >= 1 else 'must be >= 1',
  ),
  'train.init_from': Key(
    str, '', "a workdir (or checkpoint) whose model weights a new run starts from; '' = random init"
  ),
  'train.remat': Key(
    bool,
    False,
    'gradient checkpointing: the blocks a model marks '
    '(trainer/nn/remat.py) recompute their activations in the backward pass '
    'instead of keeping them',
  ),
  'train.profile_steps': Key(
    str,
    '',
    "'start,end': a TF profiler trace of those global steps "
    "into the workdir's TensorBoard; '' = off",
  ),
  'train.accept_config_change': Key(
    bool,
    False,
    'resume a workdir whose recorded config '
    'differs in keys other than run length and bookkeeping '
    '(see trainer/run/workdir.py); the change is recorded',
  ),
  'train.async_checkpoint': Key(
    bool,
    False,
    "write checkpoints in TensorFlow's background "
    'thread: the loop waits only for the copy of the variables',
  ),
  'train.recover_tries': Key(
    int,
    0,
    'on a collapse (max_consecutive_skips) or a diverged '
    'loss: restore the last healthy checkpoint and go on past the '
    'failed data, at most N times; 0 = stop',
    _non_negative,
  ),
  'train.recover_lr_factor': Key(
    float,
    1.0,
    'each recovery multiplies the learning rate by this (kept in the checkpoints)',
    lambda v: None if 0 < v <= 1 else 'must be in (0, 1]',
  ),
  'optimizer.name': Key(
    str,
    'adam',
    'a registered optimizer: adam, adamw, sgd or your own (trainer.register_optimizer)',
    registry.check_name,
  ),
  'optimizer.learning_rate': Key(float, 1e-3, 'peak learning rate', _positive),
  'optimizer.schedule': Key(
    str, 'constant', 'learning-rate schedule after warm-up', _one_of('constant', 'cosine')
  ),
  'optimizer.min_learning_rate': Key(
    float,
    0.0,
    'cosine only: the rate the decay ends at (on the last step); 0 = decay to 0',
    _non_negative,
  ),
  'optimizer.warmup_steps': Key(int, 0, 'linear warm-up from 0 to the peak', _non_negative),
  'optimizer.weight_decay': Key(float, 0.0, 'decoupled weight decay', _non_negative),
  'optimizer.clip_norm': Key(
    float, 0.0, 'global-norm clipping of the unscaled gradients; 0 = off', _non_negative
  ),
  'optimizer.momentum': Key(float, 0.9, 'momentum (sgd only)', _momentum),
  'optimizer.beta_1': Key(float, 0.9, "adam, adamw: the first moment's decay rate", _beta),
  'optimizer.beta_2': Key(float, 0.999, "adam, adamw: the second moment's decay rate", _beta),
  'optimizer.epsilon': Key(
    float,
    1e-7,
    'adam and adamw: added to the root of the second '
    "moment (Keras's default 1e-7; PyTorch's is 1e-8)",
    _positive,
  ),
  'optimizer.fused': Key(
    bool,
    True,
    "fused TF kernels in the update (Keras's results); False = Keras's own element-wise update",
  ),
  'optimizer.state_bits': Key(
    int,
    32,
    'bits per Adam/AdamW moment element: 32, or 8 (block-'
    'wise quantized codes, trainer/optim/rounding.py)',
    lambda v: None if v in STATE_BITS else 'must be 32 or 8',
  ),
  'precision.policy': Key(str, 'auto', 'dtype policy', _one_of(*POLICIES)),
  'precision.loss_scale': Key(
    str, 'auto', "'auto', 'none', 'dynamic' or a static number", _loss_scale
  ),
  'precision.initial_scale': Key(float, 32768.0, 'first dynamic scale', _positive),
  'precision.growth_interval': Key(
    int,
    2000,
    'finite steps in a row before the scale grows',
    lambda v: None if v >= 1 else 'must be >= 1',
  ),
  'precision.growth_factor': Key(
    float, 2.0, 'scale multiplier on growth', lambda v: None if v > 1 else 'must be > 1'
  ),
  'precision.backoff_factor': Key(
    float,
    0.5,
    'scale multiplier on a non-finite step',
    lambda v: None if 0 < v < 1 else 'must be in (0, 1)',
  ),
  'precision.min_scale': Key(float, 1.0, 'floor of the dynamic scale', _positive),
  'precision.max_scale': Key(float, 16777216.0, 'cap of the dynamic scale', _positive),
  'precision.hysteresis': Key(
    int,
    1,
    'non-finite steps in a row that back the scale off',
    lambda v: None if v >= 1 else 'must be >= 1',
  ),
  'precision.float8': Key(
    str,
    'none',
    "float8 recipe of the Dense/EinsumDense layers (and attention projections): 'none', 'delayed' "
    "(Keras's model.quantize('float8')), 'tensorwise', 'rowwise', 'mxfp8' or 'mxfp8_rceil' "
    "(current scaling, trainer/nn/float8_gemm.py; mxfp8's E8M0 scales rounded up: torchao's "
    'RCEIL); True = delayed, False = none; emulated without float8 hardware',
    _one_of(*FLOAT8_RECIPES),
    _float8_recipe,
  ),
  'precision.float8_layers': Key(
    str,
    '',
    "comma-separated layer names or paths precision.float8's current-scaling recipes quantize "
    "(and the layers inside them); '' = every Dense/EinsumDense layer and attention projection "
    'that fits the recipe (one that does not, e.g. K=784 under mxfp8, stays in the compute '
    'policy, named in one line); naming a layer that does not fit is an error',
  ),
  'precision.float8_skip': Key(
    str,
    '',
    "comma-separated layer names or paths left out of precision.float8's current-scaling "
    "recipes (and the layers inside them); '' = none",
  ),
  'precision.float32_layers': Key(
    str,
    '',
    'comma-separated layer names computed in float32 '
    "under a mixed policy (and the layers inside them), left out of precision.float8's "
    "current-scaling recipes under any policy; '' = none (launch.py --advise suggests a value)",
  ),
  'precision.master_weights': Key(
    str,
    'float32',
    'the weights the optimizer updates: '
    "'float32', or bfloat16 (mixed_bfloat16 or 'auto') rounded "
    "stochastically ('bfloat16_sr') or Kahan-compensated "
    "('bfloat16_kahan'); trainer/optim/low_precision.py",
    _one_of(*MASTER_WEIGHTS),
  ),
  'precision.max_consecutive_skips': Key(
    int,
    50,
    'skipped steps in a row that stop training with an error; 0 = never stop',
    _non_negative,
  ),
  'precision.allow_low_precision_variables': Key(
    bool,
    False,
    'train layers whose variables are float16/bfloat16 (a layer with '
    "dtype='float16'); False = such a layer is an error at the start of training",
  ),
  'distribute.strategy': Key(
    str,
    'default',
    "'default' (one device), 'mirrored' (local "
    "GPUs), 'multi_worker' (hosts from TF_CONFIG) or 'tpu'",
    _one_of(*STRATEGIES),
  ),
  'distribute.devices': Key(
    str,
    '',
    "mirrored only: devices such as 'GPU:0,GPU:1' "
    "('CPU:0,CPU:1' splits the CPU); '' = all local GPUs",
  ),
  'distribute.tpu': Key(
    str, '', "tpu only: TPU name or 'grpc://host:port'; '' = the TPU of this host"
  ),
  'numerics.every': Key(
    int,
    1000,
    'per-layer gradients flushed to zero, subnormal and zero, '
    'and activation headroom (TensorBoard numerics/, one log line) at the '
    'first log step, then the first log step past every multiple of this '
    'many steps; 0 = off',
    _non_negative,
  ),
  'numerics.forensics_first': Key(
    int,
    3,
    'skipped steps replayed layer by layer to name the '
    'first non-finite layer (<workdir>/forensics/), the first '
    'ones',
    _non_negative,
  ),
  'numerics.forensics_every': Key(int, 100, '... then every N-th skip; 0 = no more', _non_negative),
  'numerics.divergence_factor': Key(
    float,
    10.0,
    'a warning line when the smoothed train loss '
    'passes this many times its best or its first loss, beyond '
    "the run's own noise (trainer/insight/divergence.py); 0 = off",
    _non_negative,
  ),
  'numerics.divergence_stop': Key(
    bool,
    False,
    'divergence also ends the run (exit status 3; the newest checkpoint, written before, is kept)',
  ),
  'early_stopping.metric': Key(
    str,
    '',
    'eval metric that stops training when it stops '
    "improving (needs train.eval_every > 0); '' = off",
  ),
  'early_stopping.mode': Key(
    str,
    'auto',
    "'min', 'max', or 'auto' (min for losses and errors, max otherwise)",
    _one_of('auto', 'min', 'max'),
  ),
  'early_stopping.patience': Key(int, 3, 'evals without improvement to stop', _positive),
  'early_stopping.min_delta': Key(float, 0.0, 'least change that improves', _non_negative),
  'best_checkpoint.metric': Key(
    str, '', "eval metric whose best value's model weights are kept in <workdir>/best; '' = off"
  ),
  'best_checkpoint.mode': Key(
    str, 'auto', "'min', 'max', or 'auto' (as early_stopping.mode)", _one_of('auto', 'min', 'max')
  ),
  'debug.inject_nonfinite_every': Key(
    int, 0, 'make every N-th step non-finite; 0 = off', _non_negative
  ),
  'debug.inject_nonfinite_steps': Key(str, '', 'comma-separated global steps made non-finite'),
  'debug.inject_nonfinite_replica': Key(
    int,
    -1,
    'replica whose gradients the injection poisons; -1 = all replicas',
    lambda v: None if v >= -1 else 'must be >= -1',
  ),
}


def load_file(path: str) -> ml_collections.ConfigDict:
  """`get_config()` of a config file such as configs/mnist.py, loaded by path."""
  import importlib.util

  spec = importlib.util.spec_from_file_location(
    f'_config_{os.path.splitext(os.path.basename(path))[0]}', path
  )
  if spec is None or spec.loader is None:
    raise ConfigError(f'--config={path}: not a Python file (a config file is a .py module)')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def defaults() -> ml_collections.ConfigDict:
  """A ConfigDict with every key of the schema at its default."""
  config = ml_collections.ConfigDict()
  for name, key in SCHEMA.items():
    untyped = key.coerce is not None  # either spelling may be assigned (see Key.coerce)
    set_dotted(
      config, name, ml_collections.FieldReference(key.default, object) if untyped else key.default
    )
  return config


def value(section: Any, name: str) -> Any:
  """`section`'s value of the schema key `name` (config.optimizer and 'optimizer.beta_1'), or
  the key's default in SCHEMA when the section lacks it: a section built by hand rather than by
  `validate`, as a test or a custom builder may pass. The one place such a default is read."""
  return section.get(name.rpartition('.')[2], SCHEMA[name].default)


def _coerce(name, key, value):
  if key.coerce is not None:
    value = key.coerce(value)
  if key.type is float and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if key.type is str and isinstance(value, (int, float)) and not isinstance(value, bool):
    return str(value)
  if key.type is bool and isinstance(value, str) and value.lower() in ('true', 'false'):
    return value.lower() == 'true'
  if not isinstance(value, key.type) or (key.type is int and isinstance(value, bool)):
    raise ConfigError(
      f'config.{name} must be {key.type.__name__}, got {value!r} ({type(value).__name__})'
    )
  # Ints end up in int64 TF variables and tensors; an inf or NaN float (a natural way to write
  # "no limit") would reach the weights after the finite check, so no float key takes one.
  if key.type is int and not -(2**63) <= value < 2**63:
    raise ConfigError(
      f'config.{name}={value} does not fit in a 64-bit integer; give a value below 2**63.'
    )
  if key.type is float and not math.isfinite(value):
    raise ConfigError(
      f'config.{name}={value!r}: must be a finite number (0 turns a limit off '
      'where the key allows it).'
    )
  return value


# Top-level names the schema owns. Any other top-level key (e.g. `model_config`) belongs to the
# model, which checks it itself; a key inside a schema section must be a schema key.
SECTIONS = frozenset(name.split('.')[0] for name in SCHEMA)
# Top-level names that can only mean a schema key given without its section (config.learning_rate
# for config.optimizer.learning_rate). Generic names (steps, epsilon, momentum, policy, ...) may be
# a model's own settings and pass.
_SECTIONLESS = (
  'learning_rate',
  'batch_size',
  'loss_scale',
  'initial_scale',
  'warmup_steps',
  'weight_decay',
  'clip_norm',
  'steps_per_loop',
  'log_every',
  'checkpoint_every',
  'eval_every',
  'grad_accum_steps',
  'master_weights',
  'state_bits',
  'float32_layers',
  'max_consecutive_skips',
  'min_learning_rate',
)
_LEAVES = {
  name.rsplit('.', 1)[-1]: name for name in SCHEMA if name.rsplit('.', 1)[-1] in _SECTIONLESS
}


def did_you_mean(key: str, known: Iterable[str]) -> str | None:
  """The one key of `known` that `key` most likely meant: a near spelling (train.batch_sise), or
  the same last name in another section (train.learning_rate, learning_rate: the optimizer's),
  PyTorch's and Keras's `lr` read as learning_rate; None when there is no single guess. The one
  did-you-mean of the schema check and of launch.py's override errors."""
  known = list(known)
  close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
  if close:
    return close[0]
  leaf = key.rsplit('.', 1)[-1]
  leaf = {'lr': 'learning_rate'}.get(leaf, leaf)
  same = [k for k in known if k.rsplit('.', 1)[-1] == leaf and k != key]
  return same[0] if len(same) == 1 else None


def _check_unknown(config) -> None:
  """ConfigError with a did-you-mean for each key the schema does not know (all of them, in one
  line): any key under a schema section (train, optimizer, ...), a top-level key that is a near
  miss of a section, or one named like a schema key without its section."""
  known, problems = list(SCHEMA), []
  for name in flatten(config):
    top = name.split('.')[0]
    if name in SCHEMA:
      continue
    if top in SECTIONS:
      if top in SCHEMA:  # a scalar key such as `seed` given sub-keys
        problems.append(f'config.{top} is a single value, not a section (config.{name})')
        continue
      guess = did_you_mean(name, known)
    else:
      close = difflib.get_close_matches(top, SECTIONS, n=1, cutoff=0.8)
      if not close and name in _LEAVES:  # e.g. config.learning_rate: a section left out
        problems.append(
          f'config.{name} is not a config key; did you mean '
          f"config.{_LEAVES[name]}? (a key of the model's own goes under "
          'config.model_config)'
        )
        continue
      if not close:
        continue  # the model's own key
      guess = name.replace(top, close[0], 1)
    hint = (
      f'did you mean config.{guess}?'
      if guess
      else f'the keys of config.{top} are listed in configs/mnist.py.'
    )
    problems.append(f'config.{name} is not a config key; {hint}')
  if problems:
    raise ConfigError('; '.join(problems) if len(problems) > 1 else problems[0])


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Returns a copy of `config` with missing keys filled in; raises ConfigError on bad values.

  Keys a model adds for itself (top-level keys outside the schema's sections, e.g.
  `model_config.*`) pass through unchecked; an unknown key inside a section is an error.
  """
  if isinstance(config, ml_collections.ConfigDict):
    config = config.to_dict()
  if not isinstance(config, dict):
    raise ConfigError(
      f'the config is a {type(config).__name__}; get_config() must return an '
      'ml_collections.ConfigDict (see configs/mnist.py).'
    )
  config = ml_collections.ConfigDict(config)
  _check_unknown(config)
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
    raise ConfigError(
      f'config.precision.min_scale={p.min_scale} is above '
      f'config.precision.max_scale={p.max_scale}; make min_scale <= max_scale.'
    )
  if not p.min_scale <= p.initial_scale <= p.max_scale:
    raise ConfigError(
      f'config.precision.initial_scale={p.initial_scale} must lie within '
      f'[min_scale, max_scale] = [{p.min_scale}, {p.max_scale}].'
    )
  for every in ('log_every', 'eval_every', 'checkpoint_every'):
    if t[every] % t.steps_per_loop:
      raise ConfigError(
        f'config.train.{every}={t[every]} must be a multiple of '
        f'config.train.steps_per_loop={t.steps_per_loop}: logging, eval and '
        'checkpoints happen between compiled calls.'
      )
  if t.batch_size % t.grad_accum_steps:
    raise ConfigError(
      f'config.train.batch_size={t.batch_size} must be a multiple of '
      f'config.train.grad_accum_steps={t.grad_accum_steps}.'
    )
  o = config.optimizer
  if o.min_learning_rate > o.learning_rate:
    raise ConfigError(
      f'config.optimizer.min_learning_rate={o.min_learning_rate} is above '
      f'config.optimizer.learning_rate={o.learning_rate}; the cosine decays '
      'from the peak down to the floor: make the floor <= the peak.'
    )
  if config.early_stopping.metric and not t.eval_every:
    raise ConfigError(
      f'config.early_stopping.metric={config.early_stopping.metric!r} needs '
      'evals during training: set config.train.eval_every > 0.'
    )
  _check_low_precision(config)
  steps_text.steps(config.debug.inject_nonfinite_steps)
  steps_text.profile_steps(config.train.profile_steps)
  return config


def check_batch_split(config, parts: int, what: str) -> None:
  """ConfigError when the global batch (and its gradient-accumulation slices) does not divide
  into `parts` equal shares (`what`: 'replicas', or 'workers' for the launcher, which knows
  the worker count before any TensorFlow process starts)."""
  batch, k = int(config.train.batch_size), int(config.train.grad_accum_steps)
  if batch % parts:
    raise ConfigError(
      f'config.train.batch_size={batch} does not divide among {parts} {what}; use a '
      f'multiple of {parts} (e.g. {(batch // parts + 1) * parts}).'
    )
  if (batch // parts) % k:
    raise ConfigError(
      f'config.train.grad_accum_steps={k} does not divide the per-{what[:-1]} batch '
      f'{batch // parts} (config.train.batch_size={batch} over {parts} {what}).'
    )


def check_master_weights_policy(config, policy: str) -> None:
  """ConfigError: master_weights is not float32 and `policy` (the config's, or what 'auto'
  resolved to) is not mixed_bfloat16."""
  if (p := config.precision).master_weights != 'float32' and policy != 'mixed_bfloat16':
    resolved = f', which resolved to {policy!r} on this machine' if p.policy != policy else ''
    raise ConfigError(
      f'config.precision.master_weights={p.master_weights!r} needs '
      f"config.precision.policy='mixed_bfloat16' (got {p.policy!r}{resolved}); "
      "or set master_weights='float32'."
    )


def loss_scale_note(config, policy: str) -> str | None:
  """The warning line for config.precision.loss_scale='dynamic' under the float32 policy (the
  config's, or what 'auto' resolved to: `policy`); None otherwise. Not a ConfigError: the run is
  correct, and a config written for a GPU (auto, dynamic) must still run where auto is float32.
  Float32 gradients do not underflow where a loss scale keeps float16's, so the scale only adds
  a multiply, an unscale and a scale update to every step. 'auto' is none under float32: silent."""
  p = config.precision
  if p.loss_scale != 'dynamic' or policy != 'float32':
    return None
  resolved = (
    "config.precision.policy='auto' resolved to float32 on this machine"
    if p.policy == 'auto'
    else "config.precision.policy='float32'"
  )
  return (
    f"config.precision.loss_scale='dynamic' does nothing useful under float32 ({resolved}): "
    "float32 gradients do not underflow as float16's do, and the scale costs every step a "
    "multiply, an unscale and a scale update; set loss_scale='auto' (dynamic under "
    "mixed_float16 only) or 'none'"
  )


def _check_low_precision(config) -> None:
  """master_weights and state_bits: what they need ('auto' checked once resolved, by build)."""
  p, o = config.precision, config.optimizer
  if p.policy != 'auto':
    check_master_weights_policy(config, p.policy)
  if p.master_weights != 'float32' and o.name not in LOW_PRECISION_OPTIMIZERS:
    raise ConfigError(
      f'config.precision.master_weights={p.master_weights!r} works with '
      f'config.optimizer.name adam, adamw or sgd, not {o.name!r}.'
    )
  if o.state_bits == 8 and o.name not in ('adam', 'adamw'):
    raise ConfigError(
      f'config.optimizer.state_bits=8 quantizes Adam/AdamW moments; '
      f'config.optimizer.name={o.name!r} is not adam or adamw: set state_bits=32.'
    )
