"""Gradient checkpointing (`train.remat`): blocks of a model that recompute their activations.

A block (a layer, or any function of tensors) computed through `remat.checkpoint(fn, *inputs)`
keeps only its inputs for the backward pass and runs `fn` again there to get the activations its
gradient needs. Memory then grows with every block's input plus one block's activations instead
of every block's activations, for about one more forward pass of compute. A model opts in per
block when `remat.enabled(config)` (config.train.remat); the Transformer LM does it in
`TransformerBlock.call`:

  def call(self, x, training=False):
    return remat.checkpoint(lambda x: self.forward(x, training), x, enabled=self.remat)

This is `tf.recompute_grad`, not `keras.RematScope` / `keras.remat`: those wrap a layer's `call`
with its keyword arguments, and Keras always passes `training=`, which tf.custom_gradient refuses
inside a tf.function such as our step ("supports keywords arguments only when eager execution is
enabled"; tests/nn/test_remat.py). Here keyword arguments stay in the closure and only tensors
cross the custom gradient.

The recomputation must reproduce the forward pass: stateful randomness in a block (Dropout with
rate > 0) would draw a fresh mask in it, so the gradient would not be the forward pass's. Models
raise a ConfigError for that combination (`check_no_dropout`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import tensorflow as tf
from absl import logging

from trainer import config as config_lib
from trainer.errors import ConfigError


def enabled(config) -> bool:
  """config.train.remat (its schema default when the config has no such key)."""
  train = config.get('train') if hasattr(config, 'get') else None
  return bool(config_lib.value(train or {}, 'train.remat'))


# While `counted()` is active: one entry per block checkpointed (an enabled `checkpoint` call).
_counts: list[list] = []


def checkpoint(fn: Callable, *inputs, enabled: bool = True):
  """fn(*inputs); when `enabled`, through tf.recompute_grad: the backward pass keeps `inputs`
  (tensors, positional) and the variables fn reads, and recomputes the rest."""
  if not enabled:
    return fn(*inputs)
  for count in _counts:
    count.append(fn)
  return tf.recompute_grad(fn)(*inputs)


@contextlib.contextmanager
def counted():
  """Yields a list that receives one entry per block `checkpoint` recomputes while active."""
  count: list = []
  _counts.append(count)
  try:
    yield count
  finally:
    _counts.remove(count)


def warn_if_unmarked(config, blocks: list) -> None:
  """One warning line when config.train.remat is on and a forward pass of the model (its
  `blocks`, from `counted()`) checkpointed no block: the option then changes nothing."""
  if enabled(config) and not blocks:
    logging.warning(
      'config.train.remat=True changes nothing: the model marks no block for recomputation; '
      'compute a block through trainer.nn.remat.checkpoint(fn, *inputs, '
      'enabled=remat.enabled(config)) in its call (models/transformer_lm.py does it)'
    )


def check_no_dropout(config, rate: float, key: str) -> None:
  """ConfigError when config.train.remat is on and the checkpointed blocks use dropout `rate` > 0
  (`key` names the config key that sets it)."""
  if enabled(config) and rate > 0:
    raise ConfigError(
      f'config.train.remat=True would recompute each block with a fresh dropout '
      f'mask; set {key}=0 or config.train.remat=False'
    )
