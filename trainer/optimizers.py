"""The optimizer and learning-rate schedule from `config.optimizer`.

`optimizer.fused` (default True) picks the one-kernel-per-variable update of
trainer/fused_optimizers.py (the same formulas as Keras's Adam, AdamW and SGD, measurably faster
on small models); False picks Keras's own classes.

The schedule is a function of the trainer's global step, which advances on every step, skipped
or not; `optimizer.iterations` counts only applied updates, so it is not used for the schedule.
"""
from __future__ import annotations

import math

import keras
import tensorflow as tf

from trainer import fused_optimizers


def schedule(opt_config, total_steps: int):
  """step (a scalar tensor) -> learning rate (float32): linear warm-up from 0 over
  `warmup_steps`, then constant or cosine decay to 0 at `total_steps`."""
  peak = float(opt_config.learning_rate)
  warmup = int(opt_config.warmup_steps)
  kind = opt_config.schedule
  decay_steps = max(total_steps - warmup, 1)

  def learning_rate(step):
    step = tf.cast(step, tf.float32)
    if kind == 'cosine':
      progress = tf.clip_by_value((step - warmup) / decay_steps, 0.0, 1.0)
      rate = 0.5 * peak * (1.0 + tf.cos(math.pi * progress))
    else:
      rate = tf.constant(peak, tf.float32)
    if warmup > 0:
      rate = rate * tf.minimum(1.0, (step + 1.0) / warmup)
    return rate

  return learning_rate


def build(opt_config, learning_rate) -> keras.optimizers.Optimizer:
  """`learning_rate`: a float or a no-argument callable (Keras 3 calls it every update)."""
  name, wd = opt_config.name, float(opt_config.weight_decay) or None
  fused = opt_config.get('fused', True)
  adam, adamw, sgd = ((fused_optimizers.FusedAdam, fused_optimizers.FusedAdamW,
                       fused_optimizers.FusedSGD) if fused else
                      (keras.optimizers.Adam, keras.optimizers.AdamW, keras.optimizers.SGD))
  if name == 'adam':
    return adam(learning_rate=learning_rate, weight_decay=wd)
  if name == 'adamw':
    return adamw(learning_rate=learning_rate, weight_decay=float(opt_config.weight_decay))
  if name == 'sgd':
    return sgd(learning_rate=learning_rate, momentum=opt_config.momentum, weight_decay=wd)
  raise ValueError(f'unknown optimizer {name!r}')
