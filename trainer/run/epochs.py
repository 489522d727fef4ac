"""Finite train datasets, as Keras `fit` takes them: the framework repeats them.

`prepare(datasets, batch_size)` returns the datasets with `train` made endless and the number of
steps in one epoch:
  * a train dataset of known finite cardinality (tf.data.experimental.cardinality, e.g.
    from_tensor_slices(...).batch(B, drop_remainder=True) without .repeat()) is repeated, and
    one epoch is its cardinality, in batches;
  * one of unknown cardinality (a filter, a generator) is repeated too, and one epoch is
    Datasets.train_examples // batch_size;
  * an endless one is used as it is (one epoch = train_examples // batch_size).
Repeating keeps each pass's own shuffle (reshuffle_each_iteration) and works with the resume's
`.skip(step)`.

A repeated dataset can still end: when one pass yields nothing (an empty source, a generator
that does not restart). `end_of_data(trainer)` is the guard around the train loop: it turns
tf.errors.OutOfRangeError into a saved checkpoint and a DataError naming the step, so no work
is lost and the same command resumes once the data is fixed.
"""

from __future__ import annotations

import contextlib

import tensorflow as tf
from absl import logging

from trainer.data import checks
from trainer.errors import DataError


def prepare(datasets, batch_size: int, eval_max_batches: int = 0):
  """(datasets with an endless train, steps per epoch; 0 when unknown)."""
  checks.check_datasets(datasets, batch_size, eval_max_batches)
  cardinality = int(tf.data.experimental.cardinality(datasets.train))
  from_examples = int(datasets.train_examples or 0) // batch_size
  if cardinality == tf.data.experimental.INFINITE_CARDINALITY:
    return datasets, from_examples
  if cardinality == 0:
    raise DataError(
      'build_datasets returned an empty Datasets.train (cardinality 0): check '
      'its source, and that batch_size is not larger than the data with '
      'drop_remainder=True'
    )
  train = datasets.train.repeat()
  if cardinality > 0:
    logging.info(
      'Datasets.train holds %d batches and has no .repeat(): the trainer repeats '
      'it (one epoch = %d steps)',
      cardinality,
      cardinality,
    )
    return datasets._replace(train=train), cardinality
  logging.info(
    'Datasets.train has an unknown length and no .repeat(): the trainer repeats it '
    '(one epoch = Datasets.train_examples // batch_size = %d steps)',
    from_examples,
  )
  return datasets._replace(train=train), from_examples


@contextlib.contextmanager
def end_of_data(runner):
  """Around the train loop (trainer/run/runner.py): the end of the train data saves a
  checkpoint, then raises DataError naming the step reached."""
  try:
    yield
  except tf.errors.OutOfRangeError:
    # The steps completed before the end are in the variables (global step included).
    path = runner.save()
    trainer = runner.trainer
    step = int(trainer.global_step.numpy())
    raise DataError(
      f'build_datasets: Datasets.train ran out of data at step {step} of '
      f'{trainer.total_steps} (a pass over it yielded no batch); saved {path}. '
      'Make every pass yield data (a generator must restart when called again), '
      'or set config.train.steps; the same command resumes'
    ) from None
