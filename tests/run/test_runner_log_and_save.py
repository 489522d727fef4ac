"""What the Runner logs is what runs, and what it saves is saved first (issues 34 and 35): the
learning rate read from the optimizer (a schedule of its own included), the recovery factor in
the schedule every optimizer reads, the final checkpoint written before the final eval, a long
eval's progress and its stop between batches."""

import logging
import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorboard.backend.event_processing import event_accumulator

from tiny import TinyTrainer, tiny_config
from trainer.run import runner as runner_lib
from trainer.optim import optimizers


def scalars(workdir, tag) -> dict[int, float]:
  """{step: value} of TensorBoard scalar `tag` in the run folder's event files."""
  events = event_accumulator.EventAccumulator(
    os.path.join(workdir, 'tensorboard'), size_guidance={'tensors': 0}
  )
  events.Reload()
  return {e.step: float(tf.make_ndarray(e.tensor_proto)) for e in events.Tensors(tag)}


def messages(caplog) -> list[str]:
  return [r.getMessage() for r in caplog.records]


class LionWithItsOwnSchedule(TinyTrainer):
  def build_optimizer(self, learning_rate):
    del learning_rate  # the optimizer's own schedule instead
    schedule = keras.optimizers.schedules.CosineDecay(3e-4, decay_steps=20, alpha=0.1)
    return keras.optimizers.Lion(learning_rate=schedule)


def test_the_logged_rate_is_the_optimizers_own_schedule(tmp_path, caplog):
  """It logged config.optimizer's 1e-3 on every line while Lion used its own schedule."""
  workdir = str(tmp_path / 'w')
  trainer = LionWithItsOwnSchedule(tiny_config(**{'train.steps': 10}), workdir)
  with caplog.at_level(logging.INFO):
    trainer.train()
  assert int(trainer.optimizer.iterations.numpy()) == 10  # no skip: one update per step

  def cosine_decay(updates):  # Keras's CosineDecay, written out
    return 3e-4 * ((1 - 0.1) * 0.5 * (1 + math.cos(math.pi * min(updates, 20) / 20)) + 0.1)

  logged = scalars(workdir, 'train/learning_rate')
  assert sorted(logged) == [5, 10]
  for step, value in logged.items():  # the rate of the next update, after `step` updates
    assert value == pytest.approx(cosine_decay(step), rel=1e-5)
    line = next(m for m in messages(caplog) if m.startswith(f'step {step}/10 '))
    assert f'| lr {cosine_decay(step):.2e} |' in line
  assert 'lr 1.00e-03' not in '\n'.join(messages(caplog))


def test_the_recovery_factor_reaches_a_custom_optimizer(tmp_path):
  """The recovery factor is a checkpointed variable of the schedule build_optimizer gets, so
  an optimizer of the user's follows it; the trainer's attributes are not replaced."""

  class Lion(TinyTrainer):
    def build_optimizer(self, learning_rate):
      return keras.optimizers.Lion(learning_rate=learning_rate)

  trainer = Lion(tiny_config(**{'train.recover_lr_factor': 0.1}), str(tmp_path / 'w'))
  schedule = trainer.learning_rate
  assert isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule)
  assert trainer.runner.items['lr_factor'] is schedule.factor  # saved in every checkpoint
  plain = optimizers.schedule(trainer.config.optimizer, trainer.total_steps)
  schedule.factor.assign(1e-3)  # what a recovery does
  trainer.global_step.assign(7)
  assert float(trainer.optimizer.learning_rate) == pytest.approx(1e-3 * float(plain(7)))
  assert trainer.learning_rate is schedule


def test_a_failing_final_eval_loses_no_trained_step(tmp_path):
  """The final checkpoint came after the final eval: with checkpoint_every above the run's
  length, an eval that failed (or hung) lost every trained step."""
  trainer = TinyTrainer(
    tiny_config(**{'train.steps': 10, 'train.checkpoint_every': 1000}), str(tmp_path / 'w')
  )

  def broken(*args, **kwargs):
    raise RuntimeError('the eval broke')

  trainer.runner.eval_loop.evaluate = broken
  with pytest.raises(RuntimeError, match='the eval broke'):
    trainer.train()
  names = os.listdir(tmp_path / 'w' / 'checkpoints')
  assert 'ckpt-10.index' in names, names
  assert trainer.runner.on_disk().startswith('the newest checkpoint on disk is ')
  assert '(step 10)' in trainer.runner.on_disk()


def test_a_non_chief_worker_names_the_chiefs_checkpoint(tmp_path):
  """Under --workers=2 worker 1's last line named its own copy, /tmp/mpt-worker1-.../ckpt-20, in
  a scratch folder that is removed: the same command resumes from the chief's."""
  trainer = TinyTrainer(tiny_config(**{'train.steps': 10}), str(tmp_path / 'w'))
  trainer.train()
  workdir = trainer.runner.workdir
  scratch = str(tmp_path / 'mpt-worker1-x')  # as a non-chief worker's Workdir._open sets it up
  workdir.scratch = scratch
  workdir._manager = tf.train.CheckpointManager(workdir.checkpoint, scratch, max_to_keep=1)
  workdir._manager.save(checkpoint_number=10)
  chiefs = os.path.join(str(tmp_path / 'w'), 'checkpoints', 'ckpt-10')
  assert trainer.runner.on_disk().startswith(f'the newest checkpoint on disk is {chiefs} (step 10)')


def test_what_the_final_eval_records_is_saved_with_the_last_step(tmp_path):
  """The save comes before the eval now; what the eval's actions record (best eval, evals
  without improvement) is saved again with the same step, so a longer run resumes with it."""
  config = tiny_config(
    **{'train.steps': 10, 'train.eval_every': 5, 'early_stopping.metric': 'loss'}
  )
  config.early_stopping.patience = 100
  trainer = TinyTrainer(config, str(tmp_path / 'w'))
  seen = []
  trainer.runner.actions.append(lambda e: seen.append((e.kind, e.step)))
  trainer.train()
  stopping = trainer.runner.actions[1]
  assert seen[-3:] == [('save', 10), ('eval', 10), ('save', 10)]
  again = TinyTrainer(config, str(tmp_path / 'w'))
  again.runner.restore()
  restored = again.runner.actions[1]
  assert (restored.best, restored.waited) == (stopping.best, stopping.waited)
  assert math.isfinite(restored.best)


def test_an_early_stop_is_recorded_and_the_rerun_trains_no_further(tmp_path, caplog):
  """Before the record a rerun trained on to the next eval, and stopped again there."""
  keys = {'train.steps': 40, 'train.eval_every': 5, 'early_stopping.metric': 'loss'}
  config = tiny_config(**keys, **{'early_stopping.min_delta': 10.0, 'early_stopping.patience': 1})
  trainer = TinyTrainer(config, str(tmp_path / 'w'))
  trainer.train()
  assert int(trainer.global_step.numpy()) == 10  # no eval after the first improves by 10
  again = TinyTrainer(config, str(tmp_path / 'w'))
  with caplog.at_level(logging.INFO):
    again.train()
  assert int(again.global_step.numpy()) == 10
  assert any('the run stopped at step 10 (early stopping: ' in m for m in messages(caplog))


def test_a_long_eval_prints_its_progress(tmp_path, caplog, monkeypatch):
  monkeypatch.setattr(runner_lib, 'EVAL_REPORT_SECONDS', 0.0)  # every batch
  trainer = TinyTrainer(tiny_config(**{'train.steps': 5}), str(tmp_path / 'w'))
  with caplog.at_level(logging.INFO):
    trainer.train()
  lines = [m for m in messages(caplog) if m.startswith('eval at step 5: ')]
  assert any(' 1 batches of 16 in ' in m for m in lines), lines  # 512 examples, batch 32
  assert any(' 16 batches of 16 in ' in m for m in lines), lines


def test_an_eval_stops_between_batches(tmp_path):
  trainer = TinyTrainer(tiny_config(), str(tmp_path / 'w'))
  asked = []

  def stop():
    asked.append(1)
    return len(asked) == 3

  dataset = trainer.strategy.experimental_distribute_dataset(trainer.datasets.eval)
  assert trainer.runner.eval_loop.run(dataset, stop=stop) is None
  assert len(asked) == 3  # after each of the 3 batches it read, of 16
  means, count = trainer.runner.eval_loop.run(dataset)
  assert int(count) == 512 and np.isfinite(float(means['loss']))


COLLAPSING = """
from tiny import tiny_config


def get_config():
  return tiny_config(**{
    'model': 'tinypkg.model',
    'train.steps': 20,
    'debug.inject_nonfinite_steps': '10,11,12,13,14',
    'precision.max_consecutive_skips': 3,
  })
"""


def test_an_error_during_training_says_what_is_on_disk(tmp_path):
  """Issue 35: every exit line says what is on disk. A collapse at step 15 (ckpt-10 saved)."""
  import subprocess
  import sys

  from conftest import ROOT as root

  (tmp_path / 'tinypkg').mkdir()
  (tmp_path / 'tinypkg' / '__init__.py').write_text('')
  (tmp_path / 'tinypkg' / 'model.py').write_text(
    'from tiny import TinyTrainer\n\n\nclass Tiny(TinyTrainer):\n  pass\n'
  )
  (tmp_path / 'config.py').write_text(COLLAPSING)
  path = os.pathsep.join([root, os.path.join(root, 'tests'), str(tmp_path)])
  workdir = tmp_path / 'w'
  result = subprocess.run(
    [sys.executable, 'launch.py', f'--config={tmp_path / "config.py"}', f'--workdir={workdir}'],
    cwd=root,
    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', PYTHONPATH=path),
    capture_output=True,
    text=True,
    timeout=600,
  )
  last = result.stderr.strip().splitlines()[-1]
  assert result.returncode == 3, result.stderr[-3000:]  # a run that failed numerically
  assert last.startswith('error: training collapsed at step'), last
  assert last.endswith(
    f'the newest checkpoint on disk is {workdir / "checkpoints" / "ckpt-10"} (step 10): '
    'the same command resumes from it'
  ), last


def test_train_steps_trains_on_the_grid_with_the_progress_lines(tmp_path, caplog):
  """Runner.train_steps (the benchmarks' loop, issue 56): n more steps in calls ending on
  multiples of steps_per_loop, the progress lines and scalars train() writes, no checkpoint and
  no eval, the data carried on from call to call (and past total_steps)."""
  workdir = str(tmp_path / 'w')
  trainer = TinyTrainer(tiny_config(**{'train.steps': 10}), workdir)
  with caplog.at_level(logging.INFO):
    assert trainer.runner.train_steps(7) == 7  # calls of 5 and 2 steps
    assert trainer.runner.train_steps(8) == 15  # 3 (back on the grid), then 5
  assert int(trainer.optimizer.iterations.numpy()) == 15
  logged = [m.split()[1] for m in messages(caplog) if m.startswith('step ')]
  assert logged == ['5/10', '10/10', '15/10']  # the first call, then every log_every
  assert sorted(scalars(workdir, 'train/loss')) == [5, 10, 15]
  assert not any(m.startswith('eval at step') for m in messages(caplog))
  assert trainer.runner.workdir.latest_checkpoint is None
  assert not os.path.exists(os.path.join(workdir, 'checkpoints', 'ckpt-10.index'))
  at_once = TinyTrainer(tiny_config(**{'train.steps': 10}), str(tmp_path / 'once'))
  assert at_once.runner.train_steps(15) == 15
  for a, b in zip(trainer.model.weights, at_once.model.weights):  # the same batches, in order
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  trainer.runner.workdir.close()
  at_once.runner.workdir.close()
