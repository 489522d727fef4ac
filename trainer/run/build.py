"""Builds what a Trainer's hooks make and read, in the order they need it.

`build(trainer, config, workdir, strategy)` sets on the trainer, in this order: `config`
(validated), `workdir`, `strategy` (multi_worker and TPU set up before anything touches a
device), `policy`, `datasets` and `total_steps`; then it checks the config against the run
(`check_config`: replicas, policy, length), then under the strategy's scope `model` (whose
build_model may read `datasets`: a finite train set not yet repeated),
`train_metrics` and `eval_metrics`, `global_step`, `metric_names` (from one eager forward pass on
the first eval batch that checks the hooks' contract: one-line errors before anything is
written), `loss_scaler`, `learning_rate` (build_learning_rate(), with the recovery factor),
`optimizer` and `train_step`. Nothing here touches the
run folder; the Runner (trainer/run/runner.py) does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import keras
import tensorflow as tf
from absl import logging

from trainer import config as config_lib
from trainer.errors import ConfigError, UserError
from trainer.run import epochs
from trainer.run.workdir import local_path
from trainer.data import autotune, checks
from trainer.insight import audit
from trainer.nn import remat
from trainer.nn.float8_gemm import RECIPES
from trainer.distribute import strategy as distribute
from trainer.optim import optimizers
from trainer.step import contract, inject, payoff, precision
from trainer.distribute.strategy import state_variable
from trainer.step.loss_scale import LossScaler
from trainer.step.train_step import TrainStep

HOOKS = tuple(contract.HOOK_CALLS)  # the hooks the contract checks, the one list of them
# What the framework sets on a Trainer (build below, Trainer.__init__) and the methods a user
# calls on it: a subclass defining one would read as overriding the framework. Only names a
# built Trainer has (tests/test_update_groups.py checks each); the hooks are meant to be defined.
FRAMEWORK_NAMES = frozenset(
  (
    'config',
    'workdir',
    'strategy',
    'policy',
    'datasets',
    'total_steps',
    'jit_compile',
    'model',
    'train_metrics',
    'eval_metrics',
    'metric_names',
    'global_step',
    'loss_scaler',
    'learning_rate',
    'optimizer',
    'train_step',
    'runner',
    'train',
    'evaluate',
    'request_stop',
  )
)


def check_names(cls_name: str, names: Iterable[str]) -> None:
  """UserError naming the first of `names` (a subclass's or an instance's) the framework owns."""
  taken = sorted(n for n in names if n in FRAMEWORK_NAMES)
  if taken:
    name = taken[0]
    raise UserError(
      f'{cls_name}.{name}: {name!r} is a name the framework owns on a Trainer; '
      f'rename yours (e.g. my_{name}). A subclass defines the hooks '
      f'{", ".join(HOOKS)}, and names of its own'
    )


def _accelerated() -> bool:
  """Whether the run has a GPU or a TPU: where 'auto' turns XLA and grappler on."""
  return bool(tf.config.list_physical_devices('GPU') or tf.config.list_logical_devices('TPU'))


def jit(setting: str, policy: str) -> bool:
  """config.train.jit_compile under the resolved `policy`: 'auto' is on where XLA pays (GPU,
  TPU), off on CPU; a comma-separated list of policies is on under those. Logs the choice and
  why, and warns where XLA computes a CPU's bfloat16 matmuls in float32."""
  on, why = _xla(setting, policy)
  logging.info('XLA %s (%s)%s', 'on' if on else 'off', why, '' if on else '; --race=50 measures it')
  if on and policy == 'mixed_bfloat16' and not _accelerated():
    logging.warning(
      "XLA's CPU backend computes bfloat16 matmuls in float32: this step is slower than "
      "without XLA (train.jit_compile='float32' keeps XLA for float32 runs only)"
    )
  return on


def _xla(setting: str, policy: str) -> tuple[bool, str]:
  if setting == 'auto':
    return _accelerated(), 'auto: on with a GPU or TPU; on a CPU it pays for some models only'
  if setting in config_lib.SWITCHES:
    return setting == 'true', f'train.jit_compile={setting}'
  on = policy in setting.split(',')
  return on, f"train.jit_compile='{setting}' {'lists' if on else 'leaves out'} {policy}"


def grappler(setting: str) -> bool:
  """config.train.grappler: 'auto' is on with a GPU or TPU, off on a CPU (trainer/step/
  grappler.py says why)."""
  return _accelerated() if setting == 'auto' else setting == 'true'


def build(trainer, config, workdir: str, strategy: tf.distribute.Strategy | None) -> Any:
  """Sets the trainer's parts (the module docstring lists them); returns the first eval batch
  it checked the hooks on (read once: the runner's start-of-run loss and the numerics probe use
  it too)."""
  contract.check_hooks(trainer, _base(trainer))  # before any hook runs
  trainer.config = c = config_lib.validate(config)
  trainer.workdir = local_path(workdir)
  _set_runtime(trainer, c, strategy)

  # A finite train dataset is repeated; one epoch is its cardinality when known. build_model
  # may read self.datasets (e.g. Normalization.adapt): it sees them as build_datasets returned
  # them (checked), a finite train set one pass, not yet repeated for ever. Both then go
  # without tf.data's autotuning thread, whose lost wake-up could hold each dropped iterator
  # (every evaluation's; the train one at exit) for up to a minute (trainer/data/autotune.py).
  trainer.datasets = trainer.build_datasets()
  prepared, steps_per_epoch = epochs.prepare(
    trainer.datasets, c.train.batch_size, c.train.eval_max_batches
  )
  trainer.datasets = autotune.datasets_without_thread(trainer.datasets)
  prepared = autotune.datasets_without_thread(prepared)
  trainer.total_steps = c.train.steps or c.train.epochs * steps_per_epoch
  check_config(
    c,
    replicas=trainer.strategy.num_replicas_in_sync,
    policy=trainer.policy,
    total_steps=trainer.total_steps,
    train_examples=prepared.train_examples,
  )

  trainer.jit_compile = jit(c.train.jit_compile, trainer.policy)
  with trainer.strategy.scope():
    trainer.model = precision.build_model(
      trainer.build_model,
      c.precision.float32_layers,
      bfloat16_variables=c.precision.master_weights != 'float32',
    )
    trainer.datasets = prepared
    # Two sets of the stateful metrics: one the train loop updates, one the eval loop.
    trainer.train_metrics = trainer.build_metrics()
    contract.check_metrics(trainer.train_metrics)
    trainer.eval_metrics = trainer.build_metrics()
    trainer.global_step = state_variable(0, tf.int64, 'global_step')  # a loss may read it
    # One eager forward pass builds the model, checks the hooks' contract and tells the metric
    # names (the datasets were checked by epochs.prepare).
    batch = checks.first_eval_batch(trainer.datasets)
    trainer.metric_names = _probe(trainer, batch)
    base = _base(trainer)
    if type(trainer).build_train_step is base.build_train_step:  # a custom step may differ
      contract.check_gradient(batch, trainer.compute_loss, trainer.model)
    # After the probe: quantizing needs a built model.
    p = c.precision
    precision.apply_float8(
      trainer.model,
      p.float8,
      float32_layers=p.float32_layers,
      only=p.float8_layers,
      skip=p.float8_skip,
    )
    _build_update(trainer, c)
  return batch


def _set_runtime(trainer, c, strategy: tf.distribute.Strategy | None) -> None:
  """The thread pools before anything starts TF's runtime; then the strategy (multi_worker and
  TPU set up before anything touches a device), determinism, the seed and the policy."""
  distribute.set_threads(c)
  trainer.strategy = strategy or distribute.build(c)
  if c.train.deterministic:
    tf.config.experimental.enable_op_determinism()
  _seed(c.seed)
  float32_xla = _xla(c.train.jit_compile, 'float32')[0] and not _accelerated()
  trainer.policy = precision.apply(c.precision.policy, float32_xla)


_SEEDED: list[int] = []  # the seed this module gave keras.utils.set_random_seed last


def _seed(seed: int) -> None:
  """config.seed seeds Python, NumPy, TF and Keras (keras.utils.set_random_seed), overriding a
  seed the user's code set before: one line when it did (Keras keeps the seed it was given)."""
  try:  # Keras's record of the last seed; an internal name, hence the guard
    from keras.src.utils import rng_utils  # pylint: disable=import-outside-toplevel

    before = rng_utils.get_random_seed() if hasattr(rng_utils, 'get_random_seed') else None
  except ImportError:
    before = None
  if before is not None and before != seed and before not in _SEEDED[-1:]:
    logging.warning(
      'keras.utils.set_random_seed(%d) is overridden by config.seed=%d: the trainer seeds '
      'every run; set --config.seed=%d instead',
      before,
      seed,
      before,
    )
  keras.utils.set_random_seed(seed)
  _SEEDED[:] = [seed]


def _build_update(trainer, c) -> None:
  """Under the strategy's scope: the loss scaler, the schedule, the optimizer and the step."""
  trainer.loss_scaler = LossScaler.from_config(c.precision, trainer.policy)
  # The schedule, built once: the hook's, times the recovery factor (a variable each recovery
  # lowers). The optimizer reads it at the global step (optimizers.AtGlobalStep), whatever
  # optimizer build_optimizer makes, so a custom one follows recovery too.
  trainer.learning_rate = optimizers.recoverable(
    trainer.build_learning_rate(), c.train.recover_lr_factor
  )
  trainer.optimizer = trainer.build_optimizer(
    optimizers.AtGlobalStep(trainer.learning_rate, trainer.global_step)
  )
  trainer.train_step = step = trainer.build_train_step()
  if isinstance(step, TrainStep) and 'global_step' not in vars(step):
    raise UserError(
      f'{type(step).__name__}.__init__ did not call super().__init__(trainer): the step has '
      'no model, optimizer, loss scaler or global step; call it in __init__ (after setting '
      'what build_optimizers reads)'
    )
  _check_grad_accum(trainer.train_step, c.train.grad_accum_steps)
  inject.install(trainer.train_step, c.debug)  # config.debug.inject_*: around the step
  for line in payoff.lines(c, payoff.parameters(trainer.model)):  # a memory option too costly
    logging.warning(line)


def _probe(trainer, batch) -> tuple:
  """The metric names from the hook check's eager forward pass (contract.probe), which also
  tells whether the model marks a block for config.train.remat."""
  with remat.counted() as blocks:
    names = tuple(
      contract.probe(
        batch,
        trainer.compute_loss,
        stateful=trainer.train_metrics,
        overflow=lambda: audit.overflow(trainer),
      )
    )
  remat.warn_if_unmarked(trainer.config, blocks)
  return names


def _check_grad_accum(step, k: int) -> None:
  """A warning when grad_accum_steps > 1 would not reach a custom compute_gradients: the
  default one splits the batch into micro-batches, an override gets the whole batch."""
  if k > 1 and type(step).compute_gradients is not TrainStep.compute_gradients:
    logging.warning(
      'config.train.grad_accum_steps=%d is applied by TrainStep.compute_gradients, '
      'which %s overrides: it gets the whole batch, not %d micro-batches, unless '
      'it splits the batch itself (or calls super().compute_gradients)',
      k,
      type(step).__name__,
      k,
    )


def check_config(c, *, replicas: int, policy: str, total_steps: int, train_examples) -> None:
  """The config against this run (replicas, the resolved policy, the length: train.steps or epochs
  of `train_examples`): one ConfigError naming the key, before the model is built. What needs a
  built object is checked where it is built: float32_layers' and float8_layers' names, the
  optimizer's low-precision state, early stopping's metric."""
  float8 = c.precision.float8
  config_lib.check_batch_split(c, replicas, 'replicas')
  config_lib.check_master_weights_policy(c, policy)
  recipe = RECIPES.get(float8)  # None: 'none', or 'delayed' (Keras's, under any policy)
  if policy == 'mixed_float16' and recipe is not None and not recipe.float16:
    raise ConfigError(
      f'config.precision.float8={float8!r} does not run with float16 compute '
      f'({recipe.source}: its scaled GEMM writes bfloat16 or float32); use '
      "config.precision.policy='mixed_bfloat16'"
    )
  if not total_steps and train_examples:  # no train.steps, and an epoch of no batch
    raise ConfigError(
      f'config.train.batch_size={c.train.batch_size} is larger than the {train_examples} '
      'training examples.'
    )
  if not total_steps:
    raise ConfigError(
      'config.train.epochs needs the epoch length of a train dataset of unknown '
      'length: set Datasets.train_examples in build_datasets, or config.train.steps'
    )
  if c.optimizer.warmup_steps > total_steps:
    raise ConfigError(
      f'config.optimizer.warmup_steps={c.optimizer.warmup_steps} is longer than '
      f'the run ({total_steps} steps): the learning rate would never reach '
      'config.optimizer.learning_rate; shorten the warm-up or train longer'
    )
  replica = c.debug.inject_nonfinite_replica
  injecting = c.debug.inject_nonfinite_every or c.debug.inject_nonfinite_steps
  if injecting and replica >= replicas:
    raise ConfigError(
      f'config.debug.inject_nonfinite_replica={replica}: the run has {replicas} '
      f'replica(s), numbered 0 to {replicas - 1}; the injection would do '
      'nothing. Use -1 for every replica'
    )


def _base(trainer) -> Any:
  """The framework's Trainer class (the last class in the MRO that defines build_model)."""
  return next(k for k in reversed(type(trainer).__mro__) if 'build_model' in vars(k))
