"""What `Trainer.build_datasets()` returns."""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf


class Datasets(NamedTuple):
  """The train and eval sets of a run.

  `train`: global batches (`drop_remainder=True`); a finite one is repeated by the trainer
  (trainer/run/epochs.py). `eval`: one pass over the eval set, batched, remainder kept.
  `train_examples`: one epoch is `train_examples // batch_size` steps (0: the cardinality of
  `train` when known)."""

  train: tf.data.Dataset
  eval: tf.data.Dataset
  train_examples: int = 0
