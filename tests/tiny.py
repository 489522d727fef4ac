"""A tiny Trainer on synthetic data for the reliability tests: quick to build, no files.
launch_tiny runs it through launch.py in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys

import keras
import ml_collections
import numpy as np
import tensorflow as tf

from trainer import Datasets, Trainer
from trainer import config as config_lib


class TinyTrainer(Trainer):
  """Dense 16 -> Dense 4 on 512 random points whose class is the argmax of 4 fixed projections."""

  def build_model(self):
    return keras.Sequential(
      [
        keras.Input((8,)),
        keras.layers.Dense(16, activation='relu'),
        keras.layers.Dense(4, dtype='float32'),
      ],
      name='tiny',
    )

  def build_datasets(self):
    rng = np.random.default_rng(1234)
    x = rng.normal(size=(512, 8)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(8, 4)), axis=1).astype(np.int32)
    batch = self.config.train.batch_size
    train = (
      tf.data.Dataset.from_tensor_slices((x, y))
      .shuffle(512, seed=self.config.seed)
      .repeat()
      .batch(batch, drop_remainder=True)
    )
    return Datasets(
      train=train,
      eval=tf.data.Dataset.from_tensor_slices((x, y)).batch(batch),
      train_examples=len(x),
    )

  def compute_loss(self, batch, *, training):
    x, y = batch
    logits = tf.cast(self.model(x, training=training), tf.float32)
    loss = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
    correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), y), tf.float32)
    return loss, {'accuracy': correct}


def tiny_config(**overrides) -> ml_collections.ConfigDict:
  """Defaults sized for a few dozen steps; overrides as {'train.steps': 20, ...}."""
  config = config_lib.defaults()
  config.model = 'tiny'
  config.train.batch_size = 32
  config.train.steps = 20
  config.train.steps_per_loop = 5
  config.train.log_every = 5
  config.train.checkpoint_every = 5
  config.precision.policy = 'float32'
  for key, value in overrides.items():
    config_lib.set_dotted(config, key, value)
  return config


def weights(trainer) -> list[np.ndarray]:
  return [v.numpy() for v in trainer.model.weights]


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY_MODULE = '''import tiny


class Tiny(tiny.TinyTrainer):
  """tests/tiny.py's model, for launch.py."""
'''


def tiny_package(folder, package='tinypkg') -> str:
  """folder/<package>/tiny_model.py holding TINY_MODULE; returns its dotted path."""
  path = os.path.join(folder, package)
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, '__init__.py'), 'w') as f:
    f.write('')
  with open(os.path.join(path, 'tiny_model.py'), 'w') as f:
    f.write(TINY_MODULE)
  return f'{package}.tiny_model'


def launch_tiny(workdir, *args, model: str, path) -> subprocess.CompletedProcess:
  """launch.py with configs/mnist_mlp.py and `model` (the dotted path of a module holding one
  TinyTrainer subclass, importable from the folder `path`): float32, batch 32, a log line and a
  checkpoint every 5 steps; `args` add flags (train.steps, --mode, ...) or override these."""
  env = dict(
    os.environ,
    TF_CPP_MIN_LOG_LEVEL='3',
    PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, 'tests'), str(path)]),
  )
  return subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, 'launch.py'),
      '--config=configs/mnist_mlp.py',
      f'--workdir={workdir}',
      f'--config.model={model}',
      '--config.train.batch_size=32',
      '--config.train.steps_per_loop=5',
      '--config.train.log_every=5',
      '--config.train.checkpoint_every=5',
      '--config.precision.policy=float32',
      *args,
    ],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
