"""An MLP on flattened MNIST: Flatten, Dense 128 relu, Dense 10 (float32 logits).

The data pipeline and the loss are the MNIST CNN's (imported, not copied): only the model differs.
"""

from __future__ import annotations

import keras

from models.mnist_cnn import classification_loss, mnist_datasets
from trainer import Trainer


class MnistMlpTrainer(Trainer):
  def build_model(self):
    return keras.Sequential(
      [
        keras.Input((28, 28, 1)),
        keras.layers.Flatten(),
        keras.layers.Dense(128, activation='relu'),
        keras.layers.Dense(10, dtype='float32'),  # logits stay float32 under any policy
      ],
      name='mnist_mlp',
    )

  def build_datasets(self):
    return mnist_datasets(self.config)

  def compute_loss(self, batch, *, training):
    return classification_loss(self.model, batch, training)
