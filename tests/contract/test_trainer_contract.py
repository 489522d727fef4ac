"""The Trainer's public contract: checkpoint_items (and old checkpoints), the finite gate, the
forward-pass state on skipped steps, finite-only saves, non-finite losses, actions."""

import json
import os
import shutil

import keras
import ml_collections
import numpy as np
import pytest
import tensorflow as tf

from conftest import ROOT
from tiny import TinyTrainer, tiny_config
from trainer import Datasets, config as config_lib
from trainer.errors import CollapseError, NonFiniteError

LEGACY = os.path.join(ROOT, 'tests', 'fixtures', 'legacy_tiny_run')


def run(trainer, n):
  iterator = getattr(trainer, '_it', None)
  if iterator is None:
    trainer.runner.restore()
    iterator = trainer._it = iter(
      trainer.strategy.experimental_distribute_dataset(trainer.datasets.train)
    )
  return trainer.runner._run_steps(iterator, n)


def test_checkpoint_written_before_checkpoint_items_still_restores(tmp_path):
  """tests/fixtures/legacy_tiny_run was written by the trainer before checkpoint_items() and
  the saved collapse counter existed (see tests/fixtures/README.md)."""
  workdir = tmp_path / 'legacy'
  shutil.copytree(LEGACY, workdir)
  saved = json.load(open(workdir / 'config.json'))
  trainer = TinyTrainer(config_lib.validate(ml_collections.ConfigDict(saved)), str(workdir))
  assert trainer.runner.restore() == 10
  assert int(trainer.train_step.skipped_steps.numpy()) == 1
  assert float(trainer.loss_scaler.scale.numpy()) == 16.0
  assert int(trainer.train_step.state.guard.consecutive.numpy()) == 0  # absent: its initial value
  reader = tf.train.load_checkpoint(str(workdir / 'checkpoints' / 'ckpt-10'))
  kernel = trainer.model.trainable_variables[0]
  stored = [
    reader.get_tensor(n)
    for n, shape in tf.train.list_variables(str(workdir / 'checkpoints' / 'ckpt-10'))
    if list(shape) == list(kernel.shape)
  ]
  assert any(np.array_equal(s, kernel.numpy()) for s in stored)


def test_collapse_counter_is_checkpointed(tiny_trainer):
  trainer = tiny_trainer(**{'debug.inject_nonfinite_steps': '8,9', 'train.steps': 10})
  assert run(trainer, 10) == 10
  assert int(trainer.train_step.state.guard.consecutive.numpy()) == 2
  trainer.runner.save()
  fresh = tiny_trainer(**{'debug.inject_nonfinite_steps': '8,9', 'train.steps': 10})
  assert fresh.runner.restore() == 10
  assert int(fresh.train_step.state.guard.consecutive.numpy()) == 2


def test_nonfinite_learning_rate_skips_the_step(tmp_path):
  class InfRate(TinyTrainer):
    def build_optimizer(self, learning_rate):
      step = lambda: self.global_step  # noqa: E731
      return keras.optimizers.SGD(lambda: tf.where(step() == 3, np.inf, 0.1))

  trainer = InfRate(tiny_config(), str(tmp_path / 'w'))
  run(trainer, 3)
  before = [v.numpy().copy() for v in trainer.model.weights]
  run(trainer, 1)  # step 3: finite gradients, infinite rate
  assert int(trainer.train_step.skipped_steps.numpy()) == 1
  for a, v in zip(before, trainer.model.weights):
    np.testing.assert_array_equal(a, v.numpy())
  run(trainer, 1)
  assert all(np.isfinite(v.numpy()).all() for v in trainer.model.weights)


class BatchNormTrainer(TinyTrainer):
  """Dense -> BatchNormalization -> Dense; the train batch of step 3 (and only it) is huge, so
  under float16 its forward pass overflows (inf in the BatchNorm input)."""

  def build_model(self):
    return keras.Sequential(
      [
        keras.Input((8,)),
        keras.layers.Dense(16),
        keras.layers.BatchNormalization(),
        keras.layers.Activation('relu'),
        keras.layers.Dense(4, dtype='float32'),
      ],
      name='bn',
    )

  def build_datasets(self):
    datasets = super().build_datasets()
    huge = datasets.train.enumerate().map(lambda i, b: (tf.where(i == 3, b[0] * 1e6, b[0]), b[1]))
    return Datasets(train=huge, eval=datasets.eval, train_examples=datasets.train_examples)


def moving_stats(trainer):
  return [v.numpy().copy() for v in trainer.model.non_trainable_variables]


def test_skipped_step_leaves_batchnorm_statistics_bit_identical(tmp_path):
  trainer = BatchNormTrainer(
    tiny_config(**{'debug.inject_nonfinite_steps': '2'}), str(tmp_path / 'w')
  )
  run(trainer, 2)
  before = moving_stats(trainer)
  run(trainer, 1)  # step 2: injected skip (float32: the forward pass itself is fine)
  assert int(trainer.train_step.skipped_steps.numpy()) == 1
  for a, b in zip(before, moving_stats(trainer)):
    np.testing.assert_array_equal(a, b)
  run(trainer, 1)  # step 3 applies and moves them
  assert any(not np.array_equal(a, b) for a, b in zip(before, moving_stats(trainer)))


def test_float16_forward_overflow_leaves_statistics_finite_and_eval_sane(tmp_path):
  trainer = BatchNormTrainer(
    tiny_config(
      **{
        'precision.policy': 'mixed_float16',
        'train.steps': 60,
        'train.steps_per_loop': 10,
        'train.log_every': 10,
        'train.checkpoint_every': 60,
        'optimizer.learning_rate': 1e-2,
      }
    ),
    str(tmp_path / 'w'),
  )
  metrics = trainer.train()
  assert int(trainer.train_step.skipped_steps.numpy()) >= 1  # the huge batch was skipped
  assert all(np.isfinite(s).all() for s in moving_stats(trainer))
  assert np.isfinite(metrics['loss']) and metrics['accuracy'] > 0.5  # 4 classes: chance 0.25


def test_nonfinite_state_is_never_saved(tiny_trainer, tmp_path):
  trainer = tiny_trainer()
  run(trainer, 5)
  good = trainer.runner.save()
  kernel = trainer.model.trainable_variables[0]
  kernel.assign(tf.fill(kernel.shape, np.nan))
  with pytest.raises(NonFiniteError, match=r'step 5: .*not finite.*' + kernel.path):
    trainer.runner.save()
  assert tf.train.latest_checkpoint(str(tmp_path / 'work' / 'checkpoints')) == good


class InfLoss(TinyTrainer):
  """From step 5 on the loss is inf while its gradients stay finite (stop_gradient)."""

  def compute_loss(self, batch, *, training):
    loss, metrics = super().compute_loss(batch, training=training)
    if training:
      loss = loss + tf.stop_gradient(tf.where(self.global_step >= 5, np.inf, 0.0))
    return loss, metrics


def test_nonfinite_loss_shows_and_stops_the_run(tmp_path, caplog):
  """The first line (steps 0-9, the loss inf from step 5) shows the mean of the finite steps
  and, right after it, that 5 of its 10 steps are left out (it was said after the scale)."""
  config = tiny_config(
    **{
      'precision.max_consecutive_skips': 8,
      'train.steps': 30,
      'train.steps_per_loop': 10,
      'train.log_every': 10,
      'train.checkpoint_every': 10,
    }
  )
  trainer = InfLoss(config, str(tmp_path / 'w'))
  with caplog.at_level('INFO'), pytest.raises(CollapseError, match='loss was not'):
    trainer.train()
  assert int(trainer.train_step.skipped_steps.numpy()) == 0  # applied: gradients were finite
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith('step 10/')]
  metrics = lines[0].split(' | ')[1]
  assert metrics.endswith(' (non-finite loss in 5 of 10 steps; means of the other 5)'), lines
  assert np.isfinite(float(metrics.split()[1])), lines  # the loss: the mean of steps 0-4


def test_stateful_metrics_leave_out_nonfinite_loss_steps(tmp_path):
  class Counted(InfLoss):
    def build_metrics(self):
      return {'examples': keras.metrics.Sum()}

    def compute_loss(self, batch, *, training):
      loss, metrics = super().compute_loss(batch, training=training)
      return loss, {**metrics, 'examples': (tf.ones_like(loss),)}

  trainer = Counted(tiny_config(**{'train.steps': 10}), str(tmp_path / 'w'))
  run(trainer, 10)
  outputs = trainer.runner.train_loop.read_outputs()
  assert outputs['nonfinite_loss'] == 5
  assert outputs['examples'] == 5 * 32  # the 5 steps before the loss became inf


class NanEval(TinyTrainer):
  def compute_loss(self, batch, *, training):
    loss, metrics = super().compute_loss(batch, training=training)
    return (loss if training else loss * np.nan), metrics


def test_nonfinite_final_eval_is_an_error(tmp_path):
  trainer = NanEval(tiny_config(), str(tmp_path / 'w'))
  with pytest.raises(NonFiniteError, match='final eval at step 20'):
    trainer.train()


def test_early_stopping_ends_the_run_with_a_checkpoint(tiny_trainer, tmp_path):
  trainer = tiny_trainer(
    **{
      'train.steps': 40,
      'train.eval_every': 5,
      'early_stopping.metric': 'loss',
      'early_stopping.patience': 2,
      'early_stopping.min_delta': 100.0,
    }
  )
  trainer.train()
  # Eval at 5 sets the best; 10 and 15 do not improve by 100: stop at 15.
  assert int(trainer.global_step.numpy()) == 15
  assert tf.train.latest_checkpoint(str(tmp_path / 'work' / 'checkpoints')).endswith('ckpt-15')


def test_early_stopping_counts_on_across_a_resume(tiny_trainer):
  keys = {
    'train.eval_every': 5,
    'early_stopping.metric': 'loss',
    'early_stopping.patience': 3,
    'early_stopping.min_delta': 100.0,
  }
  tiny_trainer(**keys, **{'train.steps': 10}).train()  # evals at 5 (best) and 10 (1 without)
  trainer = tiny_trainer(**keys, **{'train.steps': 40})
  trainer.train()
  # 15 and 20 are the 2nd and 3rd evals without improvement; counting from scratch after the
  # restart would have gone on to 30.
  assert int(trainer.global_step.numpy()) == 20


def test_best_checkpoint_keeps_its_best_across_a_resume(tiny_trainer, tmp_path):
  keys = {'train.eval_every': 5, 'best_checkpoint.metric': 'loss'}
  tiny_trainer(**keys, **{'train.steps': 10}).train()
  record = json.loads((tmp_path / 'work' / 'best' / 'best.json').read_text())
  trainer = tiny_trainer(**keys, **{'train.steps': 20})
  trainer.runner.restore()
  (best,) = [a for a in trainer.runner.actions if type(a).__name__ == 'BestCheckpoint']
  assert best.best == record['value']  # not +inf: a worse eval after the restart is not kept


def test_calls_return_to_the_steps_per_loop_grid_after_an_off_grid_resume(tiny_trainer):
  seen = []

  class Watched(TinyTrainer):
    def build_actions(self):
      return [lambda e: seen.append((e.kind, e.step))]

  tiny_trainer(
    **{
      'train.steps': 6,
      'train.steps_per_loop': 3,
      'train.log_every': 3,
      'train.checkpoint_every': 3,
    }
  ).train()
  trainer = tiny_trainer(
    **{
      'train.steps': 16,
      'train.steps_per_loop': 4,
      'train.log_every': 4,
      'train.checkpoint_every': 8,
      'train.eval_every': 8,
    }
  )
  Watched(trainer.config, trainer.workdir).train()
  # From step 6 the first call runs 2 steps, so the eval and the checkpoint at 8 happen.
  assert [s for k, s in seen if k == 'log'] == [8, 12, 16]
  assert [s for k, s in seen if k == 'save'] == [8, 16]
  assert [s for k, s in seen if k == 'eval'] == [8, 16]


def test_early_stopping_needs_evals():
  config = tiny_config(**{'early_stopping.metric': 'loss'})
  with pytest.raises(config_lib.ConfigError, match='config.train.eval_every'):
    config_lib.validate(config)


def test_an_action_sees_every_boundary(tmp_path):
  seen = []

  class Watched(TinyTrainer):
    def build_actions(self):
      return [lambda e: seen.append((e.kind, e.step, sorted(e.metrics), e.checkpoint))]

  Watched(tiny_config(**{'train.steps': 10, 'train.eval_every': 5}), str(tmp_path / 'w')).train()
  kinds = [(k, s) for k, s, _, _ in seen]
  assert kinds == [
    ('log', 5),
    ('save', 5),
    ('eval', 5),
    ('log', 10),
    ('save', 10),
    ('eval', 10),
  ]  # the save before the eval: an eval that fails or hangs loses no trained step
  assert seen[0][2] == ['accuracy', 'loss']
  assert seen[1][3].endswith('ckpt-5')
