"""An MNIST MLP built to overflow float16, for the numerics tools (forensics, the advisor).

`model_config.overflow` picks the fault:
  'forward'   Flatten, Dense 'culprit' (64, weights drawn with stddev 3000), LayerNormalization,
              Dense 64 relu, Dense 10 float32. The LayerNormalization makes the culprit's scale
              irrelevant in float32, which trains; in float16 the culprit's outputs pass 65504,
              become inf and every step's loss is non-finite.
  'backward'  Flatten, Dense 'early' 64 relu, Dense 'amplifier' (64, kernel 2000 x identity),
              Dense 10 float32. Forward values stay in float16's range; the gradient the
              amplifier passes back is 2000x its output's, past 65504 at loss scale 32768.
  'none'      the forward model with ordinary weights.
The data and loss are the MNIST CNN's.
"""

from __future__ import annotations

import keras

from models.mnist_cnn import classification_loss, mnist_datasets
from trainer import Trainer
from trainer.errors import ConfigError

CULPRIT_STDDEV = 3000.0  # glorot's stddev for 784 -> 64 is about 0.05


class OverflowDemoTrainer(Trainer):
  def build_model(self):
    kind = self.config.get('model_config', {}).get('overflow', 'forward')
    if kind == 'backward':
      return keras.Sequential(
        [
          keras.Input((28, 28, 1)),
          keras.layers.Flatten(),
          keras.layers.Dense(64, activation='relu', name='early'),
          keras.layers.Dense(
            64, name='amplifier', kernel_initializer=keras.initializers.Identity(gain=2000.0)
          ),
          keras.layers.Dense(10, dtype='float32', name='logits'),
        ],
        name='overflow_backward',
      )
    if kind not in ('forward', 'none'):
      raise ConfigError(
        f'config.model_config.overflow={kind!r}: must be forward, backward or none.'
      )
    init = (
      keras.initializers.RandomNormal(stddev=CULPRIT_STDDEV, seed=self.config.seed)
      if kind == 'forward'
      else 'glorot_uniform'
    )
    return keras.Sequential(
      [
        keras.Input((28, 28, 1)),
        keras.layers.Flatten(),
        keras.layers.Dense(64, name='culprit', kernel_initializer=init),
        keras.layers.LayerNormalization(name='norm'),
        keras.layers.Dense(64, activation='relu', name='hidden'),
        keras.layers.Dense(10, dtype='float32', name='logits'),
      ],
      name='overflow_forward',
    )

  def build_datasets(self):
    return mnist_datasets(self.config)

  def compute_loss(self, batch, *, training):
    return classification_loss(self.model, batch, training)
