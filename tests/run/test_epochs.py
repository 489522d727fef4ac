"""Finite train datasets (trainer/run/epochs.py): repeated by the trainer as Keras fit does; the
end of data that cannot be repeated saves a checkpoint and says so, and the run resumes."""

import os

import numpy as np
import pytest
import tensorflow as tf

from tiny import TinyTrainer, tiny_config
from trainer import Datasets
from trainer.run import build, epochs
from trainer.errors import ConfigError, DataError


def arrays(n=128):
  rng = np.random.default_rng(1)
  x = rng.normal(size=(n, 8)).astype(np.float32)
  return x, (x[:, 0] > 0).astype(np.int32)


def test_prepare_known_cardinality_repeats_and_counts_batches():
  x, y = arrays(100)
  train = tf.data.Dataset.from_tensor_slices((x, y)).batch(32, drop_remainder=True)
  datasets, steps = epochs.prepare(Datasets(train, train, 0), 32)
  assert steps == 3  # 100 // 32 batches: the cardinality, no train_examples needed
  assert int(datasets.train.cardinality()) == tf.data.INFINITE_CARDINALITY
  assert len(list(datasets.train.take(7))) == 7


def test_prepare_unknown_cardinality_uses_train_examples():
  x, y = arrays()
  train = (
    tf.data.Dataset.from_tensor_slices((x, y))
    .filter(lambda a, b: True)
    .batch(32, drop_remainder=True)
  )
  assert int(train.cardinality()) == tf.data.UNKNOWN_CARDINALITY
  datasets, steps = epochs.prepare(Datasets(train, train, 128), 32)
  assert steps == 4 and len(list(datasets.train.take(9))) == 9
  _, steps = epochs.prepare(Datasets(train, train), 32)
  assert steps == 0
  with pytest.raises(ConfigError, match='set Datasets.train_examples'):
    length = dict(total_steps=0, train_examples=Datasets(train, train).train_examples)
    build.check_config(tiny_config(**{'train.steps': 0}), replicas=1, policy='float32', **length)


def test_prepare_leaves_an_endless_dataset_alone():
  x, y = arrays()
  train = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(32)
  eval_ = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)  # an eval set must end
  datasets, steps = epochs.prepare(Datasets(train, eval_, 128), 32)
  assert datasets.train is train and steps == 4


class OneShotTrainer(TinyTrainer):
  """Its train data comes from a generator that yields 3 batches on the first call only (a
  stream that cannot restart): the dataset's length is unknown and it ends."""

  calls = 0
  calls_with_data = 1

  def build_datasets(self):
    x, y = arrays()

    def batches():
      OneShotTrainer.calls += 1
      if OneShotTrainer.calls <= OneShotTrainer.calls_with_data:
        for i in range(3):
          yield x[32 * i : 32 * (i + 1)], y[32 * i : 32 * (i + 1)]

    spec = (tf.TensorSpec([32, 8], tf.float32), tf.TensorSpec([32], tf.int32))
    train = tf.data.Dataset.from_generator(batches, output_signature=spec)
    evals = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    return Datasets(train=train, eval=evals, train_examples=128)


def test_end_of_unrepeatable_data_saves_and_says_so(tmp_path):
  workdir = str(tmp_path / 'work')
  config = tiny_config(
    **{
      'train.steps': 10,
      'train.steps_per_loop': 2,
      'train.log_every': 2,
      'train.checkpoint_every': 10,
    }
  )
  trainer = OneShotTrainer(config, workdir)
  with pytest.raises(DataError) as info:
    trainer.train()
  message = str(info.value)
  assert '\n' not in message
  assert message.startswith('build_datasets: Datasets.train ran out of data at step 3 of 10')
  assert 'the same command resumes' in message
  assert os.path.exists(os.path.join(workdir, 'checkpoints', 'ckpt-3.index'))
  # Once the data restarts on every pass, the same command resumes from the saved step.
  OneShotTrainer.calls, OneShotTrainer.calls_with_data = 0, 100
  resumed = OneShotTrainer(tiny_config(**{'train.steps': 6, 'train.steps_per_loop': 1}), workdir)
  resumed.train()
  assert int(resumed.global_step.numpy()) == 6
