"""The optimizer and learning-rate schedule from `config.optimizer`.

`optimizer.fused` (default True) picks the one-kernel-per-variable update of
trainer/step/fused_optimizers.py (the same formulas as Keras's Adam, AdamW and SGD, measurably
faster on small models); False picks Keras's own classes.

Optimizers come from a registry a project can extend (trainer/registry.py:
`register_optimizer(name, builder)`, where `builder(opt_config, learning_rate)` returns a Keras
optimizer; `opt_config` is `config.optimizer`, `learning_rate` a float or a no-argument
callable). The builders of adam, adamw and sgd are the functions below.

The schedule is a function of the trainer's global step, which advances on every step, skipped
or not; `optimizer.iterations` counts only applied updates, so it is not used for the schedule.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import keras
import ml_collections
import tensorflow as tf
from absl import logging

from trainer import config, registry
from trainer.errors import ConfigError
from trainer.step import fused_optimizers

# What Keras takes as an optimizer's learning rate: a float, or a no-argument callable it calls at
# every update.
LearningRate = float | Callable[[], tf.Tensor]


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


def schedule(
  opt_config: ml_collections.ConfigDict, total_steps: int
) -> Callable[[tf.Tensor], tf.Tensor]:
  """step (a scalar tensor) -> learning rate (float32): linear warm-up from 0 over
  `warmup_steps`, then constant, or a cosine decay from the peak to `min_learning_rate` (the
  floor, default 0) at `total_steps`:
    rate(step) = floor + (peak - floor) * (1 + cos(pi * progress)) / 2,
    progress = clip((step - warmup_steps) / (total_steps - warmup_steps), 0, 1)
  (nanoGPT's get_lr, with its lr_decay_iters = total_steps and min_lr = the floor)."""
  peak = float(opt_config.learning_rate)
  floor = float(config.value(opt_config, 'optimizer.min_learning_rate'))
  warmup = int(opt_config.warmup_steps)
  kind = opt_config.schedule
  decay_steps = max(total_steps - warmup, 1)

  def learning_rate(step: tf.Tensor) -> tf.Tensor:
    step = tf.cast(step, tf.float32)
    if kind == 'cosine':
      progress = tf.clip_by_value((step - warmup) / decay_steps, 0.0, 1.0)
      rate = floor + 0.5 * (peak - floor) * (1.0 + tf.cos(math.pi * progress))
    else:
      rate = tf.constant(peak, tf.float32)
    if warmup > 0:
      rate = rate * tf.minimum(1.0, (step + 1.0) / warmup)
    return rate

  return learning_rate


def once_per_trace(rate: Callable[[], tf.Tensor]) -> Callable[[], tf.Tensor]:
  """`rate` (a no-argument callable: the learning rate of the current step) computed once per
  graph being traced, the same tensor for every later call in that graph; called eagerly,
  computed every time. Keras calls an optimizer's learning-rate callable at every read, and
  AdamW's weight decay reads it once per variable: each call put the schedule's ops (a read of
  the global step, a cosine, the warm-up) into the step again. Within one graph the global step
  does not change before the update (it advances after it, in `end_step`), so every read in a
  step gets the rate of that step, as before."""
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
  `learning_rate` is a float or a no-argument callable (Keras 3 calls it every update).

  With bfloat16 `master_weights` (config.precision.master_weights) or
  `opt_config.state_bits=8`, adam, adamw and sgd are trainer/step/low_precision.py's classes
  instead, seeded by (`seed`, `step`: the trainer's global step variable)."""
  found = registry.builder(opt_config.name)
  if found is None:
    raise ConfigError(
      f'config.optimizer.name={opt_config.name!r}: {registry.check_name(opt_config.name)}'
    )
  state_bits = int(config.value(opt_config, 'optimizer.state_bits'))
  if master_weights == 'float32' and state_bits == 32:
    return found(opt_config, learning_rate)
  from trainer.step import low_precision  # pylint: disable=import-outside-toplevel

  kwargs: dict[str, Any] = dict(
    learning_rate=learning_rate,
    master_weights=master_weights,
    state_bits=state_bits,
    seed=seed,
    step=step,
    weight_decay=float(opt_config.weight_decay) or None,
  )
  if opt_config.name == 'sgd':
    kwargs['momentum'] = opt_config.momentum
  else:
    kwargs.update(_moments(opt_config))
  if opt_config.name == 'adamw':
    kwargs['weight_decay'] = float(opt_config.weight_decay)
  return low_precision.CLASSES[opt_config.name](**kwargs)


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


def _adam(
  opt_config: ml_collections.ConfigDict, learning_rate: LearningRate
) -> keras.optimizers.Optimizer:
  return _classes(opt_config)[0](
    learning_rate=learning_rate,
    weight_decay=float(opt_config.weight_decay) or None,
    **_moments(opt_config),
  )


def _adamw(
  opt_config: ml_collections.ConfigDict, learning_rate: LearningRate
) -> keras.optimizers.Optimizer:
  return _classes(opt_config)[1](
    learning_rate=learning_rate, weight_decay=float(opt_config.weight_decay), **_moments(opt_config)
  )


def _sgd(
  opt_config: ml_collections.ConfigDict, learning_rate: LearningRate
) -> keras.optimizers.Optimizer:
  return _classes(opt_config)[2](
    learning_rate=learning_rate,
    momentum=opt_config.momentum,
    weight_decay=float(opt_config.weight_decay) or None,
  )
