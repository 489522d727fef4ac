"""keras.io's "Simple MNIST convnet" as a Trainer (configs/keras_mnist_convnet.py).

The example's model: Conv 32 3x3 relu, max-pool 2, Conv 64 3x3 relu, max-pool 2, flatten,
dropout 0.5, Dense 10 (34,826 parameters). Its `fit(..., validation_split=0.1)` trains on the
first 90 % of the 60,000 training images (Keras takes the validation split from the end, before
shuffling), so the train split here is the first 54,000 images; the eval set is the 10,000 test
images, on which the example reports its test accuracy.
One difference in form, none in function: the example ends in a softmax and a cross-entropy on
probabilities; here the last Dense emits float32 logits and the cross-entropy takes logits (the
same function, computed stably; under a mixed policy the logits stay float32).

Model keys (config.model_config): validation_split (the share of the training images held out
from the end, as Keras's fit does; they are not used).
"""

from __future__ import annotations

import keras
import ml_collections
import tensorflow as tf

from models import model_section
from trainer import Datasets, Trainer
from trainer.data import mnist
from trainer.errors import ConfigError
from models.mnist_cnn import classification_loss

MODEL_DEFAULTS = dict(validation_split=0.1)


def model_config(config) -> ml_collections.ConfigDict:
  m = model_section(config, MODEL_DEFAULTS, 'keras_mnist_convnet')
  if not 0 <= m.validation_split < 1:
    raise ConfigError(
      f'config.model_config.validation_split={m.validation_split}: must be in [0, 1)'
    )
  return m


def build_convnet() -> keras.Model:
  return keras.Sequential(
    [
      keras.Input((28, 28, 1)),
      keras.layers.Conv2D(32, 3, activation='relu'),
      keras.layers.MaxPooling2D(2),
      keras.layers.Conv2D(64, 3, activation='relu'),
      keras.layers.MaxPooling2D(2),
      keras.layers.Flatten(),
      keras.layers.Dropout(0.5),
      keras.layers.Dense(10, dtype='float32'),  # logits, float32 under any policy
    ],
    name='keras_mnist_convnet',
  )


class KerasMnistConvnetTrainer(Trainer):
  def build_datasets(self):
    c = self.config
    m = model_config(c)
    (x_train, y_train), (x_test, y_test) = mnist.load(c.data.dir)
    keep = len(x_train) - int(len(x_train) * m.validation_split)  # Keras: split off the end
    x_train, y_train = x_train[:keep], y_train[:keep]

    def to_float(images, labels):
      return tf.cast(images, tf.float32)[..., None] / 255.0, tf.cast(labels, tf.int32)

    train = (
      tf.data.Dataset.from_tensor_slices((x_train, y_train))
      .cache()
      .shuffle(len(x_train), seed=c.seed, reshuffle_each_iteration=True)
      .repeat()
      .batch(c.train.batch_size, drop_remainder=True)
      .map(to_float, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
      .prefetch(tf.data.AUTOTUNE)
    )
    eval_ = (
      tf.data.Dataset.from_tensor_slices((x_test, y_test))
      .batch(c.train.batch_size)
      .map(to_float, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
      .cache()
      .prefetch(tf.data.AUTOTUNE)
    )
    return Datasets(train=train, eval=eval_, train_examples=len(x_train))

  def build_model(self):
    return build_convnet()

  def compute_loss(self, batch, *, training):
    return classification_loss(self.model, batch, training)
