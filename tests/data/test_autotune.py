"""tf.data's autotuning thread is off in a run's pipelines unless the user's options decide
(trainer/data/autotune.py: its lost wake-up held dropped iterators for a whole sleep period)."""

import os

import numpy as np
import tensorflow as tf

from tiny import TinyTrainer, tiny_config
from trainer.data import autotune


def _explicitly(enabled: bool) -> tf.data.Options:
  options = tf.data.Options()
  options.autotune.enabled = enabled
  return options


def test_a_default_dataset_loses_the_thread_and_keeps_its_data_and_other_options():
  sharded = tf.data.Options()
  sharded.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
  dataset = (
    tf.data.Dataset.range(10)
    .map(lambda x: x * 3, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    .prefetch(tf.data.AUTOTUNE)
    .with_options(sharded)
  )
  assert dataset.options().autotune.enabled is None  # unset: tf.data's default, on

  quiet = autotune.without_thread(dataset)

  assert quiet.options().autotune.enabled is False
  assert quiet.options().autotune.initial_parallelism == os.cpu_count()  # not tf.data's 16
  policy = quiet.options().experimental_distribute.auto_shard_policy
  assert policy == tf.data.experimental.AutoShardPolicy.DATA
  np.testing.assert_array_equal(list(quiet.as_numpy_iterator()), np.arange(10) * 3)


def test_an_initial_parallelism_the_user_set_is_kept():
  options = tf.data.Options()
  options.autotune.initial_parallelism = 3
  quiet = autotune.without_thread(tf.data.Dataset.range(3).with_options(options))
  assert quiet.options().autotune.enabled is False
  assert quiet.options().autotune.initial_parallelism == 3


def test_a_dataset_whose_options_decide_is_left_as_it_is():
  for enabled in (True, False):
    dataset = tf.data.Dataset.range(3).with_options(_explicitly(enabled))
    assert autotune.without_thread(dataset) is dataset
    assert dataset.options().autotune.enabled is enabled


class _AutotunedTrain(TinyTrainer):
  """TinyTrainer whose train set asks for autotuning explicitly; its eval set does not."""

  def build_datasets(self):
    datasets = super().build_datasets()
    return datasets._replace(train=datasets.train.with_options(_explicitly(True)))


def test_a_built_trainer_reads_both_sets_without_the_thread_unless_asked(tmp_path):
  plain = TinyTrainer(tiny_config(), str(tmp_path / 'plain'))
  assert plain.datasets.train.options().autotune.enabled is False
  assert plain.datasets.eval.options().autotune.enabled is False

  asked = _AutotunedTrain(tiny_config(), str(tmp_path / 'asked'))
  assert asked.datasets.train.options().autotune.enabled is True
  assert asked.datasets.eval.options().autotune.enabled is False
