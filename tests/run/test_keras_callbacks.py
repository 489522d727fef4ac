"""Keras callbacks returned by build_actions (issue 58): fit's protocol and log keys, a stop that
is checkpointed and recorded, a learning rate set by ReduceLROnPlateau that the step applies."""

import csv
import logging
import os

import keras
import numpy as np
import pytest

import docblocks

from tiny import TinyTrainer, tiny_config, weights
from trainer.errors import UserError

HOOKS = (
  'on_train_begin',
  'on_epoch_begin',
  'on_train_batch_begin',
  'on_train_batch_end',
  'on_test_begin',
  'on_test_end',
  'on_epoch_end',
  'on_train_end',
)


class Recorder(keras.callbacks.Callback):
  """Every hook Keras calls, in order, with the keys of its logs."""

  def __init__(self):
    super().__init__()
    self.calls = []
    for hook in HOOKS:
      setattr(self, hook, self._recording(hook))

  def _recording(self, hook):
    def record(*args):
      logs = args[-1] if args and isinstance(args[-1], dict) else {}
      self.calls.append((hook, sorted(logs)))

    return record


def _callbacks(folder):
  return [
    # min_delta=10: no epoch after the first improves, so each waits and reduces or stops.
    keras.callbacks.ReduceLROnPlateau(monitor='val_loss', factor=0.5, patience=1, min_delta=10),
    keras.callbacks.EarlyStopping(monitor='val_loss', patience=3, min_delta=10),
    keras.callbacks.CSVLogger(os.path.join(folder, 'log.csv')),
    keras.callbacks.TensorBoard(log_dir=os.path.join(folder, 'tb')),
    Recorder(),
  ]


def _trainer(callbacks, workdir, **overrides):
  class WithCallbacks(TinyTrainer):
    def build_actions(self):
      return super().build_actions() + callbacks

  keys = {'train.steps': 100, 'train.eval_every': 10, **overrides}
  return WithCallbacks(tiny_config(**keys), workdir)


def test_early_stopping_plateau_csv_and_hooks_as_in_fit(tmp_path, caplog):
  caplog.set_level(logging.INFO)
  callbacks = _callbacks(str(tmp_path))
  trainer = _trainer(callbacks, str(tmp_path / 'w'))
  history = trainer.train()

  # EarlyStopping: epochs end at the evals (every 10 steps); it stops at the fourth, step 40,
  # which is checkpointed.
  assert int(trainer.global_step.numpy()) == 40
  assert os.path.exists(tmp_path / 'w' / 'checkpoints' / 'ckpt-40.index')
  assert history.epoch == [0, 1, 2, 3] and set(history) == {'loss', 'accuracy'}
  assert len(history.history['val_loss']) == 4
  # ReduceLROnPlateau halves the rate at the end of epochs 1, 2, 3 (steps 20, 30, 40): the
  # progress lines show what the optimizer applies.
  rates = {
    int(r.getMessage().split()[1].split('/')[0]): r.getMessage().split('| lr ')[1].split()[0]
    for r in caplog.records
    if r.getMessage().startswith('step ') and '| lr ' in r.getMessage()
  }
  assert rates == {
    5: '1.00e-03',
    10: '1.00e-03',
    15: '1.00e-03',
    20: '1.00e-03',
    25: '5.00e-04',
    30: '5.00e-04',
    35: '2.50e-04',
    40: '2.50e-04',
  }
  assert history.history['learning_rate'] == pytest.approx([1e-3, 1e-3, 5e-4, 2.5e-4])
  # CSVLogger: one row per epoch with the logged metrics.
  with open(tmp_path / 'log.csv') as f:
    rows = list(csv.DictReader(f))
  assert [r['epoch'] for r in rows] == ['0', '1', '2', '3']
  assert set(rows[0]) == {'epoch', 'loss', 'accuracy', 'val_loss', 'val_accuracy', 'learning_rate'}
  assert float(rows[3]['val_loss']) == pytest.approx(history.history['val_loss'][3])
  assert os.listdir(tmp_path / 'tb' / 'train') and os.listdir(tmp_path / 'tb' / 'validation')
  # Every hook, in fit's order: two progress lines (batches) per epoch, the eval before the
  # epoch's end.
  epoch = [
    ('on_epoch_begin', []),
    ('on_train_batch_begin', []),
    ('on_train_batch_end', ['accuracy', 'loss']),
    ('on_train_batch_begin', []),
    ('on_train_batch_end', ['accuracy', 'loss']),
    ('on_test_begin', []),
    ('on_test_end', ['accuracy', 'loss']),
    ('on_epoch_end', ['accuracy', 'learning_rate', 'loss', 'val_accuracy', 'val_loss']),
  ]
  last = ['accuracy', 'learning_rate', 'loss', 'val_accuracy', 'val_loss']
  assert callbacks[-1].calls == [('on_train_begin', []), *epoch * 4, ('on_train_end', last)]

  # The applied rate is the factor's: at a factor of 0 the step changes no weight.
  trainer.learning_rate.factor.assign(0.0)
  before = weights(trainer)
  trainer.runner.train_steps(5)
  assert all(np.array_equal(a, b) for a, b in zip(before, weights(trainer)))

  # The rerun restores step 40 and the reduced rate, and trains no further.
  caplog.clear()
  again = _trainer(_callbacks(str(tmp_path / 'again')), str(tmp_path / 'w'))
  metrics = again.train()
  assert int(again.global_step.numpy()) == 40
  assert float(again.optimizer.learning_rate) == pytest.approx(1.25e-4)
  assert metrics['loss'] == pytest.approx(history['loss'], rel=1e-5)
  assert any('the run stopped at step 40' in r.getMessage() for r in caplog.records)


def test_a_schedule_that_owns_the_rate_refuses_reduce_lr_on_plateau(tmp_path):
  with pytest.raises(UserError, match="config.optimizer.schedule='cosine' owns it"):
    _trainer(
      [keras.callbacks.ReduceLROnPlateau()],
      str(tmp_path / 'w'),
      **{'optimizer.schedule': 'cosine'},
    )


def test_a_monitor_no_log_has_is_one_line(tmp_path):
  with pytest.raises(UserError, match="did you mean 'val_accuracy'"):
    _trainer([keras.callbacks.EarlyStopping(monitor='val_acuracy')], str(tmp_path / 'w'))


def test_a_seed_set_before_the_trainer_is_named(tmp_path, caplog):
  keras.utils.set_random_seed(7)
  _trainer([], str(tmp_path / 'w'))
  assert any(
    'keras.utils.set_random_seed(7) is overridden by config.seed=0' in r.getMessage()
    for r in caplog.records
  )


def test_the_guide_example_runs(tmp_path, monkeypatch):
  """docs/guides/coming-from-fit.md's example: History and CSV agree epoch by epoch."""
  monkeypatch.chdir(tmp_path)
  (tmp_path / 'fit_callbacks.py').write_text(docblocks.block('runs this block as fit_callbacks.py'))
  monkeypatch.syspath_prepend(str(tmp_path))
  import fit_callbacks  # pylint: disable=import-outside-toplevel

  history = fit_callbacks.main(str(tmp_path / 'runs' / 'fit-callbacks'))
  with open(tmp_path / 'runs' / 'fit-callbacks.csv') as f:
    rows = list(csv.DictReader(f))
  assert [int(r['epoch']) for r in rows] == history.epoch
  assert [float(r['val_loss']) for r in rows] == pytest.approx(history.history['val_loss'])
  assert history['loss'] == pytest.approx(history.history['val_loss'][-1])
