"""The updates of trainer/optim/low_precision.py's optimizers: pure functions of the stored
tensors, compiled by XLA, one call for many variables.

Unfused, each element-wise op of an update (casts, bit masks; a log and gathers per 8-bit
moment) is a pass over memory, and with a compiled call per variable the launches would cost
more than the math (most variables are small). The random bits are drawn before the call
(rounding.py says why); the optimizer reads the variables before and assigns them after, so a
trace depends only on the shapes and the static rules (decay rates, hyperparameters).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from trainer.optim.rounding import (
  BLOCK,
  blocks,
  dequantize,
  kahan_add,
  noise,
  quantize,
  stochastic_round,
)


def _slices(bits: tf.Tensor, items: tuple, streams: tuple) -> list[dict[str, tf.Tensor]]:
  """Per item, {stream: its 16-bit noise}, each [blocks * BLOCK] (the variable's slice of the
  draw, padded to whole blocks as the 8-bit codes are)."""
  if not streams:
    return [{} for _ in items]
  offset, out = 0, []
  for grad, _ in items:
    size = blocks(int(np.prod(grad.shape))) * BLOCK
    piece = bits[offset : offset + size]
    out.append({name: noise(piece, j) for j, name in enumerate(streams)})
    offset += size
  return out


def _shaped(noise16: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
  """The first elements of a padded noise slice, in `like`'s shape."""
  return tf.reshape(noise16[: int(np.prod(like.shape))], like.shape)


def _weight32(weight_parts: tuple) -> tf.Tensor:
  """The weight in float32: with Kahan compensation, the true weight w + c."""
  weight = tf.cast(weight_parts[0], tf.float32)
  return weight if len(weight_parts) == 1 else weight + tf.cast(weight_parts[1], tf.float32)


def _weight_out(
  weight_parts: tuple, update: tf.Tensor, noise16: tf.Tensor | None, master_weights: str
) -> tuple:
  """The new bfloat16 weight parts from the stored ones and a float32 `update`: Kahan's sum, or
  stochastic rounding."""
  if master_weights == 'bfloat16_kahan':
    return kahan_add(weight_parts[0], weight_parts[1], update)
  weight = weight_parts[0]
  return (stochastic_round(tf.cast(weight, tf.float32) + update, _shaped(noise16, weight)),)


def _slot_out(value: tf.Tensor, like: tf.Tensor, noise16: tf.Tensor) -> tf.Tensor:
  """A 32-bit-state slot: float32 as is, bfloat16 rounded stochastically."""
  if like.dtype == tf.bfloat16:
    return stochastic_round(value, _shaped(noise16, like))
  return tf.cast(value, like.dtype)


@tf.function(jit_compile=True, autograph=False)
def adam_updates(
  items: tuple,
  lr: tf.Tensor,
  alpha: tf.Tensor,
  bits: tf.Tensor,
  rules: tuple,
  streams: tuple,
  hyper: tuple,
) -> tuple:
  """Adam/AdamW (Keras's formula, term for term, in float32) for each (gradient, (weight parts,
  m parts, v parts)) of `items`: m and v are (codes, absmax) with 8-bit state, else (slot,).
  Returns the new parts in the same structure, without the gradient."""
  beta_1, beta_2, epsilon, master_weights = hyper
  out = []
  for (grad, (weight_parts, m_in, v_in)), weight_decay, rand in zip(
    items, rules, _slices(bits, items, streams)
  ):
    shape = weight_parts[0].shape
    if len(m_in) == 2:
      (m_codes, m_absmax), (v_codes, v_absmax) = m_in, v_in
      m = dequantize(m_codes, m_absmax, shape, signed=True)
      v = dequantize(v_codes, v_absmax, shape, signed=False)
    else:
      m, v = tf.cast(m_in[0], tf.float32), tf.cast(v_in[0], tf.float32)
    m = m + (grad - m) * (1 - beta_1)
    v = v + (tf.square(grad) - v) * (1 - beta_2)
    w32 = _weight32(weight_parts)
    decay = -(w32 * weight_decay) * lr if weight_decay else 0.0
    adam = (m * alpha) / (tf.sqrt(v) + epsilon)
    if weight_parts[0].dtype == tf.float32:  # Keras's order: decay first, then the Adam step
      new_weight = ((w32 + decay) - adam,)
    else:
      new_weight = _weight_out(weight_parts, decay - adam, rand.get('weight'), master_weights)
    moments: tuple
    if len(m_in) == 2:
      moments = (quantize(m, rand['m'], signed=True), quantize(v, rand['v'], signed=False))
    else:
      moments = ((_slot_out(m, m_in[0], rand['m']),), (_slot_out(v, v_in[0], rand['v']),))
    out.append((new_weight,) + moments)
  return tuple(out)


@tf.function(jit_compile=True, autograph=False)
def sgd_updates(
  items: tuple, lr: tf.Tensor, bits: tf.Tensor, rules: tuple, streams: tuple, hyper: tuple
) -> tuple:
  """SGD (Keras's formula, in float32) for each (gradient, (weight parts[, (momentum,)])) of
  `items` (bfloat16 weights). Returns the new parts in the same structure."""
  momentum_rate, nesterov, master_weights = hyper
  out = []
  for (grad, parts), weight_decay, rand in zip(items, rules, _slices(bits, items, streams)):
    weight_parts = parts[0]
    w32 = _weight32(weight_parts)
    update = -(w32 * weight_decay) * lr if weight_decay else 0.0
    state: tuple = ()
    if len(parts) == 1:
      update -= lr * grad
    else:  # Keras: m = -g * lr + m * momentum; w += m (nesterov: w += -g * lr + m * momentum)
      slot = parts[1][0]
      m = -grad * lr + tf.cast(slot, tf.float32) * momentum_rate
      update += (-grad * lr + m * momentum_rate) if nesterov else m
      state = ((_slot_out(m, slot, rand['momentum']),),)
    out.append((_weight_out(weight_parts, update, rand.get('weight'), master_weights),) + state)
  return tuple(out)
