"""The batch of a skipped step, kept on the device for the forensic replay.

The replay (trainer/insight/forensics.py) must see the skipped step's own batch, bit for bit,
whatever the pipeline does: re-reading "element N" from a new iterator gives another batch under
a shuffle that reshuffles per iterator, random augmentation or a non-deterministic parallel map.
Checkpointing the iterator before each compiled call would write the shuffle buffer every call
(the MNIST pipeline's is the whole training set, ~190 MB), and a non-deterministic map would
still give other elements. So the batch the step consumed is kept: the compiled loop
(trainer/step/loop.py) already stops right after a skip that gets forensics
(`TrainLoop.stop_at_skip`); on the step's skip branch only (its `on_skip`) it gathers the step's
batch (every local replica's share, in replica order: the global batch on one host) into
variables the host reads. A finite step pays nothing; a recorded skip, one copy.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf


class Recording:
  """Wraps the loop's iterator: `next(...)` / `get_next()` are the wrapped iterator's, and the
  last element (a tensor of the graph being traced) is kept in `last`."""

  def __init__(self, iterator: Any) -> None:
    self.iterator, self.last = iterator, None

  def __iter__(self) -> Recording:
    return self

  def __next__(self) -> Any:
    self.last = next(self.iterator)
    return self.last

  def get_next(self) -> Any:
    self.last = self.iterator.get_next()
    return self.last

  def __getattr__(self, name: str) -> Any:  # element_spec and the rest
    return getattr(self.iterator, name)


class KeptBatch:
  """Variables shaped like one (global) batch of `element_spec` (any batch size); `keep` in the
  compiled loop (cross-replica context), `read` on the host."""

  def __init__(self, element_spec: Any) -> None:
    def variable(spec: tf.TensorSpec) -> tf.Variable:
      rank = len(spec.shape)
      return tf.Variable(
        tf.zeros([0] * rank, spec.dtype),
        shape=tf.TensorShape([None] * rank),
        trainable=False,
        name='kept_batch',
      )

    self.element_spec = element_spec
    self.variables = tf.nest.map_structure(variable, element_spec)
    self.kept = tf.Variable(False, trainable=False, name='batch_kept')

  def keep(self, strategy: tf.distribute.Strategy, batch: Any) -> None:
    def whole(value: Any) -> tf.Tensor:
      parts = strategy.experimental_local_results(value)
      return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)

    for variable, value in zip(tf.nest.flatten(self.variables), tf.nest.flatten(batch)):
      variable.assign(whole(value))
    self.kept.assign(True)

  def read(self) -> Any:
    """The kept batch as NumPy arrays (the dataset's structure), then forgotten; None when no
    batch was kept since the last read."""
    if not bool(self.kept.numpy()):
      return None
    self.kept.assign(False)
    return tf.nest.map_structure(lambda v: v.numpy(), self.variables)
