"""The optimizer and learning-rate schedule from `config.optimizer`.

`optimizer.fused` (default True) picks the one-kernel-per-variable update of
trainer/fused_optimizers.py (the same formulas as Keras's Adam, AdamW and SGD, measurably faster
on small models); False picks Keras's own classes.

Optimizers come from a registry a project can extend: `register_optimizer(name, builder)`, where
`builder(opt_config, learning_rate)` returns a Keras optimizer (`opt_config` is
`config.optimizer`; `learning_rate` a float or a no-argument callable). adam, adamw and sgd are
registered here. `config.optimizer.name` is checked against the registry when the config is
validated, so register before building the Trainer (e.g. at the top of your model's module).

The schedule is a function of the trainer's global step, which advances on every step, skipped
or not; `optimizer.iterations` counts only applied updates, so it is not used for the schedule.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import keras
import tensorflow as tf

from trainer import fused_optimizers
from trainer.errors import ConfigError

Builder = Callable[..., keras.optimizers.Optimizer]  # (opt_config, learning_rate) -> optimizer
_REGISTRY: dict[str, Builder] = {}


def register_optimizer(name: str, builder: Builder) -> None:
  """Makes `config.optimizer.name = name` build its optimizer with
  `builder(opt_config, learning_rate)`; registering a name again replaces its builder."""
  if not isinstance(name, str) or not name:
    raise ValueError(f'register_optimizer: the name must be a non-empty string, got {name!r}')
  if not callable(builder):
    raise TypeError(f'register_optimizer({name!r}, ...): the builder must be callable as '
                    f'builder(opt_config, learning_rate), got {builder!r}')
  _REGISTRY[name] = builder


def names() -> tuple[str, ...]:
  """The registered optimizer names, sorted."""
  return tuple(sorted(_REGISTRY))


def check_name(name: str) -> str | None:
  """A complaint for config validation when `name` is not registered, else None."""
  if name in _REGISTRY:
    return None
  return (f'must be a registered optimizer: {", ".join(names())} (a project adds its own with '
          'trainer.register_optimizer(name, builder))')


def schedule(opt_config, total_steps: int):
  """step (a scalar tensor) -> learning rate (float32): linear warm-up from 0 over
  `warmup_steps`, then constant, or a cosine decay from the peak to `min_learning_rate` (the
  floor, default 0) at `total_steps`:
    rate(step) = floor + (peak - floor) * (1 + cos(pi * progress)) / 2,
    progress = clip((step - warmup_steps) / (total_steps - warmup_steps), 0, 1)
  (nanoGPT's get_lr, with its lr_decay_iters = total_steps and min_lr = the floor)."""
  peak = float(opt_config.learning_rate)
  floor = float(opt_config.get('min_learning_rate', 0.0))
  warmup = int(opt_config.warmup_steps)
  kind = opt_config.schedule
  decay_steps = max(total_steps - warmup, 1)

  def learning_rate(step):
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


def build(opt_config, learning_rate) -> keras.optimizers.Optimizer:
  """The registered builder of `opt_config.name`, called with (opt_config, learning_rate);
  `learning_rate` is a float or a no-argument callable (Keras 3 calls it every update)."""
  builder = _REGISTRY.get(opt_config.name)
  if builder is None:
    raise ConfigError(f'config.optimizer.name={opt_config.name!r}: {check_name(opt_config.name)}')
  return builder(opt_config, learning_rate)


def _classes(opt_config):
  """(Adam, AdamW, SGD): the fused ones (one kernel per variable) or Keras's own."""
  if opt_config.get('fused', True):
    return (fused_optimizers.FusedAdam, fused_optimizers.FusedAdamW, fused_optimizers.FusedSGD)
  return keras.optimizers.Adam, keras.optimizers.AdamW, keras.optimizers.SGD


def _moments(opt_config) -> dict:
  """Adam's beta_1, beta_2 and epsilon from the config (Keras's defaults when a config built
  without the schema lacks them)."""
  return {'beta_1': float(opt_config.get('beta_1', 0.9)),
          'beta_2': float(opt_config.get('beta_2', 0.999)),
          'epsilon': float(opt_config.get('epsilon', 1e-7))}


def _adam(opt_config, learning_rate):
  return _classes(opt_config)[0](learning_rate=learning_rate,
                                 weight_decay=float(opt_config.weight_decay) or None,
                                 **_moments(opt_config))


def _adamw(opt_config, learning_rate):
  return _classes(opt_config)[1](learning_rate=learning_rate,
                                 weight_decay=float(opt_config.weight_decay),
                                 **_moments(opt_config))


def _sgd(opt_config, learning_rate):
  return _classes(opt_config)[2](learning_rate=learning_rate, momentum=opt_config.momentum,
                                 weight_decay=float(opt_config.weight_decay) or None)


register_optimizer('adam', _adam)
register_optimizer('adamw', _adamw)
register_optimizer('sgd', _sgd)
