"""The optimizer and learning-rate schedule from `config.optimizer`.

`optimizer.fused` (default True) picks the one-kernel-per-variable update of
trainer/optim/fused_optimizers.py (the same formulas as Keras's Adam, AdamW and SGD, measurably
faster on small models); False picks Keras's own classes.

Optimizers come from a registry a project can extend (trainer/registry.py:
`register_optimizer(name, builder)`, where `builder(opt_config, learning_rate)` returns a Keras
optimizer; `opt_config` is `config.optimizer`, `learning_rate` a float or a Keras
LearningRateSchedule, the trainer's `AtGlobalStep`). The builders of adam, adamw and sgd are
the functions below.

The schedule (`ConfigSchedule`, from Trainer.build_learning_rate, times the recovery factor:
`Recoverable`) follows the trainer's global step, not `optimizer.iterations`: `AtGlobalStep`.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import TypeAlias

import keras
import ml_collections
import tensorflow as tf
from keras.optimizers.schedules import LearningRateSchedule as Schedule
from absl import logging

from trainer import config, registry
from trainer.errors import ConfigError
from trainer.optim import fused_optimizers
from trainer.distribute.strategy import state_variable

# What Keras takes as an optimizer's learning rate: a float, a LearningRateSchedule, or a
# no-argument callable; it reads a schedule or a callable at every update.
LearningRate: TypeAlias = 'float | Schedule | Callable[[], tf.Tensor]'


def reset_loss_scale_factor(optimizer: keras.optimizers.Optimizer) -> None:
  """A Keras 3 optimizer given `loss_scale_factor=F` multiplies the loss by F in its own
  `scale_loss` and divides every gradient by F in `apply`: on top of the trainer's loss scaling
  (which never calls the optimizer's `scale_loss`) each update would be F times too small. Reset
  to None, as Keras's LossScaleOptimizer does with its inner optimizer, with one warning line."""
  factor = getattr(optimizer, 'loss_scale_factor', None)
  if factor is not None:
    name = getattr(optimizer, 'name', type(optimizer).__name__)
    logging.warning(
      'optimizer %s: loss_scale_factor=%g reset to None: the trainer scales the '
      'loss itself (config.precision.loss_scale), and the optimizer would divide '
      'every gradient by %g again',
      name,
      factor,
      factor,
    )
    optimizer.loss_scale_factor = None


class ConfigSchedule(Schedule):
  """config.optimizer's schedule, step (a scalar tensor) -> learning rate (float32): linear
  warm-up from 0 over `warmup_steps`, then constant, or a cosine decay from the peak to `floor`
  (config.optimizer.min_learning_rate, default 0) at `total_steps`:
    rate(step) = floor + (peak - floor) * (1 + cos(pi * progress)) / 2,
    progress = clip((step - warmup_steps) / (total_steps - warmup_steps), 0, 1)
  (nanoGPT's get_lr, with its lr_decay_iters = total_steps and min_lr = the floor)."""

  def __init__(self, peak: float, floor: float, warmup: int, kind: str, total_steps: int):
    self.peak, self.floor, self.warmup, self.kind = float(peak), float(floor), int(warmup), kind
    self.total_steps = int(total_steps)

  def __call__(self, step):
    step = tf.cast(step, tf.float32)
    if self.kind == 'cosine':
      decay_steps = max(self.total_steps - self.warmup, 1)
      progress = tf.clip_by_value((step - self.warmup) / decay_steps, 0.0, 1.0)
      rate = self.floor + 0.5 * (self.peak - self.floor) * (1.0 + tf.cos(math.pi * progress))
    else:
      rate = tf.constant(self.peak, tf.float32)
    if self.warmup > 0:
      rate = rate * tf.minimum(1.0, (step + 1.0) / self.warmup)
    return rate

  def get_config(self) -> dict:
    return {k: getattr(self, k) for k in ('peak', 'floor', 'warmup', 'kind', 'total_steps')}


def schedule(opt_config, total_steps: int) -> ConfigSchedule:
  """The schedule of `opt_config` (config.optimizer) for a run of `total_steps`."""
  return ConfigSchedule(
    peak=opt_config.learning_rate,
    floor=opt_config.get('min_learning_rate', 0.0),
    warmup=opt_config.warmup_steps,
    kind=opt_config.schedule,
    total_steps=total_steps,
  )


class Recoverable(Schedule):
  """`schedule(step) x factor`: `factor` is a float64 variable that each recovery lowers
  (config.train.recover_lr_factor, trainer/run/recovery.py) and a Keras callback setting the
  rate sets (trainer/run/keras_callbacks.py); every checkpoint saves it ('lr_factor'). None (the
  schedule alone, no variable in the step) until `settable()` makes it, before the step is
  traced. The product is taken in float64: factors such as 1e-40 (taming a learning rate of
  1e38) are no float32."""

  def __init__(self, schedule: Schedule, factor: tf.Variable | None = None):
    self.schedule, self.factor = schedule, factor

  def settable(self) -> tf.Variable:
    """The factor, made at 1 (under the strategy's scope) when there is none yet."""
    if self.factor is None:
      self.factor = state_variable(1.0, tf.float64, 'lr_factor')
    return self.factor

  def __call__(self, step):
    if self.factor is None:
      return self.schedule(step)
    rate = tf.cast(self.schedule(step), tf.float64) * self.factor
    return tf.cast(rate, tf.float32)

  def get_config(self) -> dict:
    factor = 1.0 if self.factor is None else float(self.factor.numpy())
    return {'schedule': self.schedule.get_config(), 'factor': factor}


def recoverable(rate: Schedule, recover_lr_factor: float) -> Recoverable:
  """`rate` times a factor: made now when recovery lowers the learning rate
  (`recover_lr_factor` below 1), else when a Keras callback may set it (Recoverable.settable);
  made under the strategy's scope."""
  wrapped = Recoverable(rate)
  if recover_lr_factor != 1.0:
    wrapped.settable()
  return wrapped


class AtGlobalStep(Schedule):
  """What `build_optimizer(learning_rate)` gets: the trainer's schedule at the trainer's global
  step, which advances on every step, skipped or not. The step Keras passes (its iterations:
  applied updates only) is not read; called with no argument, as the callable it replaces, it
  gives the same rate. Computed once per traced graph: `once_per_trace`."""

  def __init__(self, schedule: Schedule, global_step: tf.Variable):
    self.schedule, self.global_step = schedule, global_step
    self._rate = once_per_trace(lambda: schedule(global_step))

  def __call__(self, step=None):
    del step  # optimizer.iterations: see the class docstring
    return self._rate()

  def get_config(self) -> dict:
    return {'schedule': self.schedule.get_config()}


def once_per_trace(rate: Callable[[], tf.Tensor]) -> Callable[[], tf.Tensor]:
  """`rate` (a no-argument callable: the current step's learning rate) computed once per graph
  being traced, the same tensor for every later call in it; eagerly, every time. Keras reads the
  rate at every use (AdamW's decay once per variable), each read adding the schedule's ops to the
  step again; within a graph the global step advances only after the update (`end_step`), so
  every read in a step gets that step's rate."""
  computed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

  def learning_rate() -> tf.Tensor:
    if tf.executing_eagerly():
      return rate()
    graph = tf.compat.v1.get_default_graph()
    if graph not in computed:
      computed[graph] = rate()
    return computed[graph]

  return learning_rate


def build(
  opt_config: ml_collections.ConfigDict,
  learning_rate: LearningRate,
  *,
  master_weights: str = 'float32',
  seed: int = 0,
  step: tf.Variable | None = None,
) -> keras.optimizers.Optimizer:
  """The registered builder of `opt_config.name`, called with (opt_config, learning_rate);
  `learning_rate` is a float or a LearningRateSchedule (Keras 3 calls it every update).

  With bfloat16 `master_weights` (config.precision.master_weights) or
  `opt_config.state_bits=8`, adam, adamw and sgd are trainer/optim/low_precision.py's classes
  instead, seeded by (`seed`, `step`: the trainer's global step variable)."""
  found = registry.builder(opt_config.name)
  if found is None:
    raise ConfigError(
      f'config.optimizer.name={opt_config.name!r}: {registry.check_name(opt_config.name)}'
    )
  state_bits = int(config.value(opt_config, 'optimizer.state_bits'))
  if master_weights == 'float32' and state_bits == 32:
    return found(opt_config, learning_rate)
  from trainer.optim import low_precision  # pylint: disable=import-outside-toplevel

  return low_precision.CLASSES[opt_config.name](
    learning_rate=learning_rate,
    master_weights=master_weights,
    state_bits=state_bits,
    seed=seed,
    step=step,
    **_options(opt_config, opt_config.name),
  )


def _classes(opt_config: ml_collections.ConfigDict) -> tuple[type, type, type]:
  """(Adam, AdamW, SGD): the fused ones (one kernel per variable) or Keras's own."""
  if config.value(opt_config, 'optimizer.fused'):
    return (fused_optimizers.FusedAdam, fused_optimizers.FusedAdamW, fused_optimizers.FusedSGD)
  return keras.optimizers.Adam, keras.optimizers.AdamW, keras.optimizers.SGD


def _moments(opt_config: ml_collections.ConfigDict) -> dict:
  """Adam's beta_1, beta_2 and epsilon from the config (the schema's defaults, Keras's, when a
  config built without the schema lacks them)."""
  return {
    k: float(config.value(opt_config, f'optimizer.{k}')) for k in ('beta_1', 'beta_2', 'epsilon')
  }


def _options(opt_config: ml_collections.ConfigDict, name: str) -> dict:
  """The keyword arguments of adam, adamw or sgd (`name`) beyond the learning rate: AdamW's
  weight decay always, the others' only when set; Adam's moments or SGD's momentum."""
  decay = float(opt_config.weight_decay)
  own = {'momentum': opt_config.momentum} if name == 'sgd' else _moments(opt_config)
  return {'weight_decay': decay if name == 'adamw' else decay or None, **own}


def _adam(
  opt_config: ml_collections.ConfigDict, learning_rate: LearningRate
) -> keras.optimizers.Optimizer:
  return _classes(opt_config)[0](learning_rate=learning_rate, **_options(opt_config, 'adam'))


def _adamw(
  opt_config: ml_collections.ConfigDict, learning_rate: LearningRate
) -> keras.optimizers.Optimizer:
  return _classes(opt_config)[1](learning_rate=learning_rate, **_options(opt_config, 'adamw'))


def _sgd(
  opt_config: ml_collections.ConfigDict, learning_rate: LearningRate
) -> keras.optimizers.Optimizer:
  return _classes(opt_config)[2](learning_rate=learning_rate, **_options(opt_config, 'sgd'))
