"""A small CNN on MNIST: Conv 32 3x3, max-pool 2x2, Conv 64 3x3, Dense 128, Dense 10 (float32)."""

from __future__ import annotations

import keras
import tensorflow as tf

from trainer import Datasets, Trainer
from trainer.data import mnist


def mnist_datasets(config) -> Datasets:
  """Train: cache, shuffle (seeded), repeat, batch, prefetch; eval: the 10,000 test images once.

  Images stay uint8 until batched, then become float32 in [0, 1] with a channel axis; the model
  casts them to its compute dtype.
  """
  (x_train, y_train), (x_test, y_test) = mnist.load(config.data.dir)
  batch = config.train.batch_size

  def to_float(images, labels):
    return tf.cast(images, tf.float32)[..., None] / 255.0, tf.cast(labels, tf.int32)

  train = (
    tf.data.Dataset.from_tensor_slices((x_train, y_train))
    .cache()
    .shuffle(len(x_train), seed=config.seed, reshuffle_each_iteration=True)
    .repeat()
    .batch(batch, drop_remainder=True)
    .map(to_float, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    .prefetch(tf.data.AUTOTUNE)
  )
  eval_ = (
    tf.data.Dataset.from_tensor_slices((x_test, y_test))
    .batch(batch)
    .map(to_float, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    .cache()
    .prefetch(tf.data.AUTOTUNE)
  )
  return Datasets(train=train, eval=eval_, train_examples=len(x_train))


def classification_loss(model, batch, training):
  """Per-example sparse cross-entropy on float32 logits, and per-example accuracy."""
  images, labels = batch
  logits = tf.cast(model(images, training=training), tf.float32)
  loss = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
  correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32)
  return loss, {'accuracy': correct}


class MnistCnnTrainer(Trainer):
  def build_model(self):
    return keras.Sequential(
      [
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(32, 3, activation='relu'),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(64, 3, activation='relu'),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation='relu'),
        keras.layers.Dense(10, dtype='float32'),  # logits stay float32 under any policy
      ],
      name='mnist_cnn',
    )

  def build_datasets(self):
    return mnist_datasets(self.config)

  def compute_loss(self, batch, *, training):
    return classification_loss(self.model, batch, training)
