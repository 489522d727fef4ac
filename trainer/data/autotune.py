"""tf.data's autotuning thread, off unless a dataset turns it on: dropping an iterator must not
wait for it.

With autotuning on (tf.data's default), every iterator starts a thread
(`tensorflow::data::model::Model::OptimizeLoop`) that re-tunes the pipeline, sleeping between
rounds for a period that doubles up to 60 s; dropping the iterator cancels it and waits for it.
In TensorFlow 2.21 the wake-up can be lost: `CancellationManager::StartCancel` runs its callbacks
(the one that wakes the thread) before it marks itself cancelled, so a thread that wakes at once
sees no cancellation and sleeps out its period while the iterator's destructor waits. The end of
a run and every evaluation (each drops an iterator) waited that way in some runs, and never with
the thread off (docs/references.md, "Dropping a tf.data iterator could wait").

Without the thread, AUTOTUNE keeps its starting values. A parallel map or interleave starts at
min(autotune.initial_parallelism, the runner's threads, one per core); tf.data's default of 16
would cap a large host below what the tuner reaches, so `initial_parallelism` is set to the
number of cores (unless the options set it). A prefetch sizes its buffer with its own
(thread-free) tuner. A dataset whose options set `autotune.enabled` is left as it is.
"""

from __future__ import annotations

import os

import tensorflow as tf

from trainer.data.datasets import Datasets


def without_thread(dataset: tf.data.Dataset) -> tf.data.Dataset:
  """`dataset` with autotuning off and AUTOTUNE at one call per core, unless its options
  already set `autotune.enabled`."""
  # The proto is the one place tf.data tells a set option from a defaulted one.
  chosen = dataset.options()._to_proto().autotune_options
  if chosen.WhichOneof('optional_enabled') is not None:
    return dataset
  options = tf.data.Options()
  options.autotune.enabled = False
  if chosen.WhichOneof('optional_initial_parallelism') is None:
    options.autotune.initial_parallelism = os.cpu_count() or 1
  return dataset.with_options(options)


def datasets_without_thread(datasets: Datasets) -> Datasets:
  """Both pipelines of a run through `without_thread`."""
  return datasets._replace(train=without_thread(datasets.train), eval=without_thread(datasets.eval))
