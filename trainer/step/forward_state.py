"""The state a forward pass assigns (BatchNormalization's moving statistics, any variable a layer
assigns in `call`): read before a step, put back when the step is skipped or only probed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import keras

import tensorflow as tf


def forward_state(model: keras.Model) -> list[tf.Variable]:
  """The variables a forward pass may assign: the model's non-trainable variables (Batch-
  Normalization's moving statistics, any state a layer updates in `call`), as tf.Variables."""
  return [getattr(v, 'value', v) for v in model.non_trainable_variables]


@contextlib.contextmanager
def forward_state_kept(model: keras.Model) -> Iterator[None]:
  """Within: a forward pass may assign the model's forward state (`forward_state`); on exit every
  replica's copy of it is put back. Eager or while a tf.function traces (the reads and the
  restoring assignments are ordered with the forward pass's own by the shared variables)."""
  state = [c for v in forward_state(model) for c in getattr(v, 'values', (v,))]
  saved = [v.read_value() for v in state]
  try:
    yield
  finally:
    for variable, value in zip(state, saved):
      variable.assign(value)
