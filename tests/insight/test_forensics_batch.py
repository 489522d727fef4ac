"""The forensic replay sees the skipped step's own batch, whatever the pipeline does: a shuffle
that reshuffles on every new iterator (as the shipped MNIST pipeline does) with one corrupt
example; and a replay on request of a healthy step does not claim that the step differed."""

import glob
import os
import re
import subprocess
import sys

import numpy as np
import tensorflow as tf

from conftest import MNIST_DIR, ROOT
from tiny import TinyTrainer, tiny_config
from trainer import TrainStep
from trainer.insight import forensics

CORRUPT = 137  # the example whose first feature is inf


class Reshuffled(TinyTrainer):
  """512 points, one of them with an inf feature; reshuffled on every new iterator."""

  def build_datasets(self):
    datasets = super().build_datasets()
    x, y = next(iter(datasets.eval.unbatch().batch(512)))
    x = x.numpy()
    x[CORRUPT, 0] = np.inf
    train = (
      tf.data.Dataset.from_tensor_slices((x, y.numpy()))
      .shuffle(512, seed=self.config.seed, reshuffle_each_iteration=True)
      .repeat()
      .batch(self.config.train.batch_size, drop_remainder=True)
    )
    return datasets._replace(train=train)


def test_the_replay_names_the_corrupt_input_at_each_skipped_step(tmp_path, caplog, capfd):
  config = tiny_config(
    **{
      'precision.policy': 'mixed_float16',
      'train.steps': 48,
      'train.steps_per_loop': 8,
      'train.log_every': 8,
      'train.checkpoint_every': 48,
      'numerics.forensics_first': 3,
      'numerics.forensics_every': 0,
      'precision.max_consecutive_skips': 0,
    }
  )
  trainer = Reshuffled(config, str(tmp_path / 'w'))
  with caplog.at_level('WARNING'):
    try:
      trainer.train()
    except Exception:  # pylint: disable=broad-except  (an inf input may leave a NaN eval)
      pass
  # The skipped steps, as the collapse guard prints them from inside the compiled step.
  skipped = [int(s) for s in re.findall(r'skipped step (\d+) \(', capfd.readouterr().err)]
  assert len(skipped) == 3, skipped  # one epoch = 16 steps, one corrupt example each epoch
  lines = [
    r.getMessage()
    for r in caplog.records
    if 'first non-finite' in r.getMessage() or 'replay finite' in r.getMessage()
  ]
  assert [int(l.split(':')[0].split()[1]) for l in lines] == skipped, lines
  assert all(
    'forward input' in l and 'the batch itself has non-finite values' in l for l in lines
  ), lines
  # Each folder's batch holds the corrupt example, while element N of a new iterator over the
  # pipeline (what the replay read before) is, at some of these steps, another batch.
  other = []
  for step in skipped:
    batch = forensics.load(forensics.folder_for(str(tmp_path / 'w'), step)).batch
    assert np.isinf(batch[0]).sum() == 1
    reread = next(iter(trainer.datasets.train.skip(step)))
    other.append(bool(np.isfinite(reread[0].numpy()).all()))
  assert any(other), 'the pipeline did not reshuffle: the test proves nothing'


def test_diagnose_on_a_healthy_run_does_not_claim_the_step_differed(tmp_path):
  result = subprocess.run(
    [
      sys.executable,
      'launch.py',
      '--config=configs/mnist_mlp.py',
      '--mode=diagnose',
      f'--config.data.dir={MNIST_DIR}',
      '--config.precision.policy=mixed_float16',
      f'--workdir={tmp_path / "run"}',
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'},
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert 'replay finite' in result.stdout, result.stdout
  assert 'differed' not in result.stdout + result.stderr


class OwnSkipStep(TrainStep):
  """A custom step that skips on its own (no `apply_or_skip`): the compiled loop, not the skip
  branch, keeps the skipped step's batch."""

  def step(self, iterator):
    outputs, grads, nonfinite, _ = self.strategy.run(self.replica_step, args=(next(iterator),))
    flags = self.groups_finite(nonfinite)  # one group: one flag
    outputs = {
      k: self.strategy.reduce(tf.distribute.ReduceOp.SUM, v, axis=None) for k, v in outputs.items()
    }

    def apply():
      self.strategy.run(lambda g: self.apply_group(0, g), args=(grads,))
      return tf.constant(0, tf.int64)

    skipped = tf.cond(flags[0], apply, lambda: tf.constant(1, tf.int64))
    self.skipped_steps.assign_add(skipped)
    self.end_step(flags)
    return self.with_counters(outputs, skipped, tf.math.is_finite(outputs['loss']))


class ReshuffledOwnSkip(Reshuffled):
  def build_train_step(self):
    return OwnSkipStep(self)


def test_a_custom_step_without_apply_or_skip_still_keeps_the_skipped_batch(tmp_path):
  config = tiny_config(
    **{
      'precision.policy': 'mixed_float16',
      'train.steps': 48,
      'train.steps_per_loop': 8,
      'train.log_every': 8,
      'train.checkpoint_every': 48,
      'numerics.forensics_first': 3,
      'numerics.forensics_every': 0,
      'precision.max_consecutive_skips': 0,
    }
  )
  trainer = ReshuffledOwnSkip(config, str(tmp_path / 'w'))
  try:
    trainer.train()
  except Exception:  # pylint: disable=broad-except  (an inf input may leave a NaN eval)
    pass
  folders = sorted(glob.glob(os.path.join(str(tmp_path / 'w'), 'forensics', 'step-*')))
  assert len(folders) == 3, folders  # one corrupt example per 16-step epoch
  assert int(trainer.train_step.skipped_steps.numpy()) == 3
  for folder in folders:  # each is its own step's batch, with the corrupt example in it
    assert np.isinf(forensics.load(folder).batch[0]).sum() == 1, folder
