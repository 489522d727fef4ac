"""Your own data as a ready `Datasets` in one call: from NumPy arrays, a folder of images per
class, or a TensorFlow Datasets name.

Every helper builds the same pipelines from single (features, label) examples:
  train: cache, shuffle the whole set with config.seed (a new order each epoch), repeat, batch
         with config.train.batch_size (drop_remainder=True), `prepare`, prefetch;
  eval:  batch (the remainder kept: every example counted once), `prepare`, prefetch, cache.
Both carry AutoShardPolicy.DATA: each worker takes its share of every batch's examples (in-memory
and generated data have no files to shard by). `prepare(features, labels)` runs on whole batches
(vectorised); the default casts integer images to float32 in [0, 1] and labels to int32
(from_image_folder's scales Keras's float 0-255 pixels).

  def build_datasets(self):
    return ready.from_arrays(self.config, train=(x_train, y_train), eval=(x_test, y_test))
"""

from __future__ import annotations

import os

import numpy as np
import tensorflow as tf

from trainer.errors import DataError
from trainer.data.datasets import Datasets


def to_float(features, labels):
  """The default `prepare`: uint8/integer pixels to float32 in [0, 1], labels to int32
  (float features pass through as float32)."""
  floats = tf.cast(features, tf.float32)
  return floats / 255.0 if features.dtype.is_integer else floats, tf.cast(labels, tf.int32)


def pixels_to_unit(images, labels):
  """from_image_folder's default `prepare`: pixel values 0-255 (of any dtype) to float32 in
  [0, 1], labels to int32."""
  return tf.cast(images, tf.float32) / 255.0, tf.cast(labels, tf.int32)


def _options() -> tf.data.Options:
  options = tf.data.Options()
  options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
  return options


def pipelines(
  config, train: tf.data.Dataset, eval_: tf.data.Dataset, train_examples: int, *, prepare=to_float
) -> Datasets:
  """The train and eval pipelines around two datasets of single (features, label) examples."""
  batch = config.train.batch_size
  if train_examples < batch:
    raise DataError(
      f'the train set holds {train_examples} examples, fewer than '
      f'config.train.batch_size={batch}; lower the batch size'
    )
  train = (
    train.cache()
    .shuffle(train_examples, seed=config.seed, reshuffle_each_iteration=True)
    .repeat()
    .batch(batch, drop_remainder=True)
    .map(prepare, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    .prefetch(tf.data.AUTOTUNE)
    .with_options(_options())
  )
  # The prefetch comes before the cache, not after: an iterator dropped after a partial read
  # (take(k)) while a prefetch after the cache is still reading can finalize the cache truncated
  # (trainer/data/checks.py: first_eval_batch). Reading a finished cache needs no prefetch.
  eval_ = (
    eval_.batch(batch)
    .map(prepare, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    .prefetch(tf.data.AUTOTUNE)
    .cache()
    .with_options(_options())
  )
  return Datasets(train=train, eval=eval_, train_examples=int(train_examples))


def from_arrays(config, *, train: tuple, eval: tuple, prepare=to_float) -> Datasets:
  """From (features, labels) NumPy arrays in memory: features [N, ...], labels [N] (integers
  for classes; a [N, 1] column is flattened to [N])."""

  def checked(name, pair):
    x, y = (np.asarray(a) for a in pair)
    if y.ndim == 2 and y.shape[1] == 1:
      y = y.reshape(-1)
    if len(x) != len(y):
      raise DataError(f'from_arrays: {name} has {len(x)} examples but {len(y)} labels')
    return x, y

  (x, y), (xe, ye) = checked('train', train), checked('eval', eval)
  return pipelines(
    config,
    tf.data.Dataset.from_tensor_slices((x, y)),
    tf.data.Dataset.from_tensor_slices((xe, ye)),
    len(x),
    prepare=prepare,
  )


def from_image_folder(
  config,
  directory: str,
  *,
  image_size: tuple[int, int],
  eval_directory: str = '',
  eval_fraction: float = 0.0,
  color_mode: str = 'rgb',
  prepare=pixels_to_unit,
) -> Datasets:
  """From a folder holding one sub-folder of images per class (the class names, sorted, are
  labels 0, 1, ...), via keras.utils.image_dataset_from_directory. Images are resized to
  `image_size` (height, width) and come as [H, W, C] (C = 1 for color_mode='grayscale', 3 for
  'rgb'); float32 pixel values 0-255, which the default `prepare` scales to [0, 1]. The eval set is
  `eval_directory` (same class folders), or `eval_fraction` of `directory` split off with
  config.seed."""
  import keras

  if not os.path.isdir(directory):
    raise DataError(
      f'from_image_folder: {directory!r} is not a folder; it must hold one '
      'folder of images per class'
    )
  if bool(eval_directory) == bool(eval_fraction):
    raise DataError('from_image_folder: give either eval_directory or eval_fraction (0 < f < 1)')
  common = dict(
    labels='inferred',
    label_mode='int',
    color_mode=color_mode,
    batch_size=None,
    image_size=tuple(image_size),
    verbose=False,
  )
  if eval_directory:
    train = keras.utils.image_dataset_from_directory(directory, shuffle=False, **common)
    eval_ = keras.utils.image_dataset_from_directory(
      eval_directory, shuffle=False, class_names=train.class_names, **common
    )
  else:
    # shuffle=True with the seed only picks which files go to which subset, once.
    train, eval_ = keras.utils.image_dataset_from_directory(
      directory,
      shuffle=True,
      seed=config.seed,
      validation_split=eval_fraction,
      subset='both',
      **common,
    )
  count = int(train.cardinality())
  if count <= 0:
    raise DataError(f'from_image_folder: no images found under {directory!r}')
  return pipelines(config, train, eval_, count, prepare=prepare)


def from_tfds(
  config,
  name: str,
  *,
  data_dir: str,
  train_split: str = 'train',
  eval_split: str = 'test',
  prepare=to_float,
) -> Datasets:
  """From a TensorFlow Datasets name prepared under `data_dir` (no download: run
  `tfds build <name> --data_dir=...` or builder.download_and_prepare() once), as
  (features, label) pairs (as_supervised). Needs `pip install "mpt-trainer[tfds]"`."""
  try:
    import tensorflow_datasets as tfds
  except ImportError:
    raise DataError(
      'from_tfds needs tensorflow-datasets: pip install "mpt-trainer[tfds]"'
    ) from None
  try:
    builder = tfds.builder(name, data_dir=data_dir)
    if not builder.is_prepared():
      raise DataError(
        f'from_tfds: {name!r} is not prepared under data_dir={data_dir!r}; '
        f'run `tfds build {name} --data_dir={data_dir}` once'
      )
    train, eval_ = builder.as_dataset(
      split=[train_split, eval_split], as_supervised=True, shuffle_files=False
    )
    count = builder.info.splits[train_split].num_examples
  except (tfds.core.registered.DatasetNotFoundError, KeyError, ValueError) as e:
    raise DataError(
      f'from_tfds: {name!r} under data_dir={data_dir!r}: {e}'.splitlines()[0]
    ) from None
  return pipelines(config, train, eval_, count, prepare=prepare)
