"""Checkpoint paths stay inside the run, and what is restored or saved is finite.

A copied (`cp -r`) or moved run resumes from its own files and never touches the original's,
also when its state file names checkpoints by absolute path (as an older repair wrote it); a
state file naming another run's checkpoint is not followed. Every variable of
checkpoint_items() is checked before a save (the loss scale, plain tf.Variables, the actions'
state), and the best-checkpoint save too. A restored non-finite checkpoint falls back to the
previous finite one for training and is a one-line error for eval, export and init_from. Eval of
a run whose checkpoints rotate away while it reads goes back to the state file for the newer
ones."""

import glob
import hashlib
import json
import logging as py_logging
import os
import shutil
import time

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.checkpoint import checkpoint_management

from trainer.run import actions, checkpoints, lifecycle
from trainer.errors import ConfigError, NonFiniteError, UserError

import test_reliability_checkpoints as checkpoint_tests
from tiny import TinyTrainer, tiny_config, weights


def files(folder) -> dict[str, str]:
  """{relative path: sha256} of every file under `folder`."""
  found = {}
  for root, _, names in os.walk(folder):
    for name in names:
      path = os.path.join(root, name)
      with open(path, 'rb') as f:
        found[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
  return found


def state_names(workdir) -> list[str]:
  """The names in the state file as written (not joined with the folder)."""
  text = open(os.path.join(workdir, 'checkpoints', 'checkpoint')).read()
  return [line.split('"')[1] for line in text.splitlines() if '"' in line]


def absolute_state(workdir, steps):
  """Rewrites the state file naming ckpt-<steps> by absolute path (what an older repair_state
  and tf.compat.v1 write)."""
  folder = os.path.join(workdir, 'checkpoints')
  paths = [os.path.join(folder, f'ckpt-{s}') for s in steps]
  checkpoint_management.update_checkpoint_state_internal(
    folder, paths[-1], all_model_checkpoint_paths=paths, save_relative_paths=False
  )
  assert all(os.path.isabs(n) for n in state_names(workdir))


def config(**overrides):
  return tiny_config(**{'train.deterministic': True, **overrides})


def trained(workdir, steps=15):
  """A deterministic run with checkpoints every 5 steps (max_to_keep 3); returns {step: weights
  there} (test_reliability_checkpoints.trained)."""
  return checkpoint_tests.trained(workdir, steps, **{'train.deterministic': True})


# ---- 1. paths inside the run -------------------------------------------------------------------
def test_repair_writes_relative_names(tmp_path):
  trained(tmp_path, steps=15)
  os.remove(tmp_path / 'checkpoints' / 'checkpoint')
  TinyTrainer(config(**{'train.steps': 15}), str(tmp_path)).runner.restore()
  names = state_names(tmp_path)
  assert names and all(n == os.path.basename(n) for n in names), names


def test_copied_run_with_absolute_state_resumes_from_its_own_files(tmp_path):
  original, copy = tmp_path / 'a', tmp_path / 'b'
  TinyTrainer(config(**{'train.steps': 10}), str(original)).train()  # ckpt-5, ckpt-10
  absolute_state(original, (5, 10))
  shutil.copytree(original, copy)  # cp -r a b
  before = files(original)
  trainer = TinyTrainer(config(**{'train.steps': 25, 'train.max_to_keep': 2}), str(copy))
  assert trainer.runner.restore() == 10
  assert trainer.runner.workdir.latest_checkpoint == str(copy / 'checkpoints' / 'ckpt-10')
  trainer.train()  # saves 15, 20, 25; max_to_keep=2 rotates out 5, 10, 15: b's own
  assert files(original) == before  # a untouched: ckpt-5 and ckpt-10 still there, bytes equal
  assert sorted(os.path.basename(p) for p in glob.glob(str(copy / 'checkpoints' / '*.index'))) == [
    'ckpt-20.index',
    'ckpt-25.index',
  ]
  assert all(n == os.path.basename(n) for n in state_names(copy))
  # The same 25 steps uninterrupted (deterministic ops): the copy resumed a's step-10 state.
  reference = TinyTrainer(
    config(**{'train.steps': 25, 'train.max_to_keep': 2}), str(tmp_path / 'ref')
  )
  reference.train()
  for a, b in zip(weights(trainer), weights(reference), strict=True):
    np.testing.assert_array_equal(a, b)


def test_moved_run_is_evaluated_and_resumed(tmp_path):
  original, moved = tmp_path / 'a', tmp_path / 'moved'
  snapshots = trained(original, steps=15)
  absolute_state(original, (5, 10, 15))
  shutil.move(original, moved)
  reader = TinyTrainer(config(**{'train.steps': 15}), str(moved))
  assert lifecycle.restore(reader, '--mode=eval') == 15
  for a, b in zip(weights(reader), snapshots[15], strict=True):
    np.testing.assert_array_equal(a, b)
  trainer = TinyTrainer(config(**{'train.steps': 20}), str(moved))
  assert trainer.runner.restore() == 15
  trainer.train()
  assert os.path.exists(moved / 'checkpoints' / 'ckpt-20.index')


def test_state_naming_another_runs_checkpoint_is_not_followed(tmp_path, caplog):
  other, ours = tmp_path / 'other', tmp_path / 'ours'
  TinyTrainer(config(**{'train.steps': 20}), str(other)).train()  # ckpt-10, 15, 20
  snapshots = trained(ours, steps=10)  # ckpt-5, ckpt-10 (max_to_keep 3)
  folder = str(ours / 'checkpoints')
  paths = [
    os.path.join(folder, 'ckpt-5'),
    os.path.join(folder, 'ckpt-10'),
    str(other / 'checkpoints' / 'ckpt-20'),
  ]  # an edit, or a bad merge of two runs
  checkpoint_management.update_checkpoint_state_internal(
    folder, paths[-1], all_model_checkpoint_paths=paths, save_relative_paths=False
  )
  before = files(other)
  trainer = TinyTrainer(config(**{'train.steps': 30}), str(ours))
  with caplog.at_level(py_logging.WARNING):
    assert trainer.runner.restore() == 10
  for a, b in zip(weights(trainer), snapshots[10], strict=True):
    np.testing.assert_array_equal(a, b)
  warned = ' '.join(r.getMessage() for r in caplog.records if r.levelno >= py_logging.WARNING)
  assert 'outside this run' in warned and str(other / 'checkpoints' / 'ckpt-20') in warned
  trainer.train()
  assert files(other) == before
  assert all(n == os.path.basename(n) for n in state_names(ours))


def test_state_file_that_is_a_folder_is_one_line(tmp_path):
  trained(tmp_path, steps=5)
  state = tmp_path / 'checkpoints' / 'checkpoint'
  os.remove(state)
  os.mkdir(state)
  with pytest.raises(UserError) as info:
    TinyTrainer(config(**{'train.steps': 10}), str(tmp_path)).train()
  assert '\n' not in str(info.value) and f'{state} is a folder' in str(info.value)
  reader = TinyTrainer(config(**{'train.steps': 10}), str(tmp_path))
  assert lifecycle.restore(reader, '--mode=eval') == 5  # read-only: the files on disk


# ---- 2. every variable checked before a save ---------------------------------------------------
def test_nan_loss_scale_is_not_saved(tmp_path):
  trainer = TinyTrainer(config(**{'precision.policy': 'mixed_float16'}), str(tmp_path))
  trainer.runner.restore()
  trainer.loss_scaler.scale.assign(float('nan'))
  with pytest.raises(NonFiniteError) as info:
    trainer.runner.save()
  assert trainer.loss_scaler.scale.name.split(':')[0] in str(info.value)
  assert not glob.glob(str(tmp_path / 'checkpoints' / 'ckpt-*'))


class ExtraTrainer(TinyTrainer):
  """A custom step's own plain tf.Variable among the checkpoint items."""

  def checkpoint_items(self):
    if not hasattr(self, 'ema_decay'):
      self.ema_decay = tf.Variable(0.99, name='ema_decay')
    return {**super().checkpoint_items(), 'ema_decay': self.ema_decay}


def test_plain_variable_and_actions_state_are_checked(tmp_path):
  trainer = ExtraTrainer(config(), str(tmp_path))
  trainer.runner.restore()
  names = {v.name for v in checkpoints.variables(trainer.runner.items)}
  assert {'ema_decay:0', 'global_step:0', 'scale:0'} <= names
  trainer.ema_decay.assign(float('inf'))
  with pytest.raises(NonFiniteError, match='ema_decay'):
    trainer.runner.save()
  trainer.ema_decay.assign(0.99)
  best = TinyTrainer(
    config(**{'best_checkpoint.metric': 'loss', 'train.eval_every': 5}), str(tmp_path / 'best')
  )
  best.runner.restore()
  best.runner.actions[1]._best.assign(float('nan'))  # pylint: disable=protected-access
  with pytest.raises(NonFiniteError, match='best'):
    best.runner.save()


def test_best_checkpoint_refuses_a_non_finite_model(tmp_path, caplog):
  trainer = TinyTrainer(
    config(**{'best_checkpoint.metric': 'loss', 'train.eval_every': 5}), str(tmp_path)
  )
  trainer.runner.restore()
  action = trainer.runner.actions[1]
  bias = trainer.model.layers[0].bias
  bias.assign(np.full(bias.shape, np.nan, np.float32))
  # an eval that looked fine
  with caplog.at_level(py_logging.WARNING):
    action(actions.Event('eval', 5, {'loss': 0.5}, trainer, None, trainer.runner))
  assert not os.path.exists(tmp_path / 'best')
  assert action.best == float('inf')  # no best recorded either
  assert any('not saved: the model is not finite' in r.getMessage() for r in caplog.records)


# ---- 3. restores are checked -------------------------------------------------------------------
def plant_nan(workdir, step):
  """Rewrites ckpt-<step> with a NaN in the first kernel (bypassing the save's check)."""
  trainer = TinyTrainer(config(**{'train.steps': step}), str(workdir))
  trainer.runner.restore()
  kernel = trainer.model.layers[0].kernel
  value = kernel.numpy()
  value[0, 0] = np.nan
  kernel.assign(value)
  trainer.runner.workdir.save(step)
  trainer.runner.workdir.close()
  return kernel.path


def test_nan_checkpoint_falls_back_on_resume(tmp_path, caplog):
  snapshots = trained(tmp_path, steps=15)
  name = plant_nan(tmp_path, 15)
  trainer = TinyTrainer(config(**{'train.steps': 15}), str(tmp_path))
  with caplog.at_level(py_logging.WARNING):
    assert trainer.runner.restore() == 10
  for a, b in zip(weights(trainer), snapshots[10], strict=True):
    np.testing.assert_array_equal(a, b)
  warned = ' '.join(r.getMessage() for r in caplog.records if r.levelno >= py_logging.WARNING)
  # (the layer's number differs between the two trainers of one process: the variable's name)
  assert 'ckpt-15 holds a non-finite state' in warned and name.split('/')[-1] in warned
  trainer.train()  # redoes 10..15, a finite ckpt-15 over the NaN one
  reader = tf.train.load_checkpoint(str(tmp_path / 'checkpoints' / 'ckpt-15'))
  values = [
    reader.get_tensor(k) for k in reader.get_variable_to_shape_map() if 'OBJECT_GRAPH' not in k
  ]
  assert all(np.isfinite(v).all() for v in values if np.issubdtype(v.dtype, np.floating))


def test_nan_checkpoint_is_refused_by_eval_export_and_init_from(tmp_path):
  trained(tmp_path / 'run', steps=10)
  plant_nan(tmp_path / 'run', 10)
  before = files(tmp_path / 'run')
  for call in (
    lifecycle.evaluate_checkpoint,
    lambda t: lifecycle.export(t, str(tmp_path / 'export')),
  ):
    trainer = TinyTrainer(config(**{'train.steps': 10}), str(tmp_path / 'run'))
    with pytest.raises(UserError) as info:
      call(trainer)
    message = str(info.value)
    assert '\n' not in message and 'ckpt-10 holds a non-finite state' in message
    assert 'delete' not in message
  assert not os.path.exists(tmp_path / 'export')
  assert files(tmp_path / 'run') == before
  trainer = TinyTrainer(config(**{'train.init_from': str(tmp_path / 'run')}), str(tmp_path / 'new'))
  with pytest.raises(ConfigError) as info:
    trainer.train()
  assert '\n' not in str(info.value) and 'non-finite weights' in str(info.value)
  assert not os.path.exists(tmp_path / 'new')


def test_eval_retries_when_checkpoints_rotate_away(tmp_path, monkeypatch):
  """While eval reads ckpt-20, the training process saves 25 and 30 and rotates 10 to 20 out."""
  trained(tmp_path, steps=20)  # ckpt-10, 15, 20 (max_to_keep 3)
  folder = str(tmp_path / 'checkpoints')
  real = checkpoints.restore
  rotated = []

  def restore(items, path):
    if not rotated:
      rotated.append(path)
      for step in (25, 30):  # the new ones: the step-20 state under the later names
        for name in glob.glob(os.path.join(folder, 'ckpt-20.*')):
          shutil.copy(name, name.replace('ckpt-20', f'ckpt-{step}'))
      for step in (10, 15, 20):
        for name in glob.glob(os.path.join(folder, f'ckpt-{step}.*')):
          os.remove(name)
      checkpoint_management.update_checkpoint_state_internal(
        folder,
        os.path.join(folder, 'ckpt-30'),
        save_relative_paths=True,
        all_model_checkpoint_paths=[os.path.join(folder, f'ckpt-{s}') for s in (25, 30)],
      )
    return real(items, path)

  monkeypatch.setattr(checkpoints, 'restore', restore)
  reader = TinyTrainer(config(**{'train.steps': 20}), str(tmp_path))
  assert reader.runner.workdir.restore_read_only() == os.path.join(folder, 'ckpt-30')
  assert rotated == [os.path.join(folder, 'ckpt-20')]
  assert int(reader.global_step.numpy()) == 20


def test_read_only_failure_never_advises_deleting(tmp_path):
  from test_reliability_checkpoints import damage

  trained(tmp_path, steps=10)
  for step in (5, 10):
    damage(tmp_path, step, 'garbage index')
  reader = TinyTrainer(config(**{'train.steps': 10}), str(tmp_path))
  with pytest.raises(UserError) as info:
    lifecycle.evaluate_checkpoint(reader)
  assert 'delete' not in str(info.value) and 'can be restored' in str(info.value)


# ---- 5. asynchronous saves ---------------------------------------------------------------------
def test_async_checkpoints_hold_the_state_at_their_step_and_resume_identically(tmp_path):
  """Each background write holds the weights of its step although training went on while it
  was written; a resumed async run ends bit-identical to a synchronous uninterrupted one."""
  snapshots = trained(tmp_path / 'async', steps=15)  # the synchronous reference snapshots
  trainer = TinyTrainer(
    config(**{'train.steps': 15, 'train.async_checkpoint': True}), str(tmp_path / 'a2')
  )
  trainer.train()
  for step in (5, 10, 15):
    fresh = TinyTrainer(config(**{'train.steps': 15}), str(tmp_path / 'reader'))
    checkpoints.restore(fresh.runner.items, str(tmp_path / 'a2' / 'checkpoints' / f'ckpt-{step}'))
    for a, b in zip(weights(fresh), snapshots[step], strict=True):
      np.testing.assert_array_equal(a, b)
  assert json.loads((tmp_path / 'a2' / 'checkpoints' / 'healthy.json').read_text())['step'] == 15
  longer = TinyTrainer(
    config(**{'train.steps': 25, 'train.async_checkpoint': True}), str(tmp_path / 'a2')
  )
  assert longer.runner.restore() == 15
  longer.train()
  reference = TinyTrainer(config(**{'train.steps': 25}), str(tmp_path / 'sync25'))
  reference.train()
  for a, b in zip(weights(longer), weights(reference), strict=True):
    np.testing.assert_array_equal(a, b)


def test_best_checkpoint_state_naming_another_runs_files_deletes_nothing_of_it(tmp_path, caplog):
  """Issue 35: best/checkpoints/checkpoint naming another run's ckpt-10 (a copied run, a crafted
  file) made the best_checkpoint action's CheckpointManager (max_to_keep=1) delete that run's
  files at its next best save: best/ skipped the state-file repair the main folder has."""
  best = {'best_checkpoint.metric': 'loss', 'train.eval_every': 5, 'train.steps': 10}
  other, ours = tmp_path / 'other', tmp_path / 'ours'
  TinyTrainer(config(**best), str(other)).train()
  other_best = other / 'best' / 'checkpoints'
  (step,) = [int(p.split('-')[-1].split('.')[0]) for p in glob.glob(str(other_best / '*.index'))]
  folder = ours / 'best' / 'checkpoints'
  folder.mkdir(parents=True)
  now = time.time()  # with the times a manager writes: it then rotates the file as its own
  checkpoint_management.update_checkpoint_state_internal(
    str(folder),
    str(other_best / f'ckpt-{step}'),
    all_model_checkpoint_paths=[str(other_best / f'ckpt-{step}')],
    all_model_checkpoint_timestamps=[now - 10],
    last_preserved_timestamp=now - 100,
    save_relative_paths=False,
  )
  before = files(other)
  with caplog.at_level(py_logging.WARNING):
    TinyTrainer(config(**best), str(ours)).train()
  assert files(other) == before  # the other run's best checkpoint is still there
  warned = ' '.join(r.getMessage() for r in caplog.records if r.levelno >= py_logging.WARNING)
  assert 'outside this run' in warned
  text = open(folder / 'checkpoint').read()  # our own best, by relative name
  assert glob.glob(str(folder / '*.index')) and str(other) not in text and '"ckpt-' in text


def test_a_temp_folder_left_by_a_killed_save_is_removed_at_the_next_start(tmp_path, caplog):
  """Issue 35: a killed asynchronous save leaves ckpt-N_temp/ (TensorFlow writes into it, then
  renames), and it stayed for ever, even after the resumed run saved ckpt-N again."""
  trained(tmp_path, steps=10)  # ckpt-5, ckpt-10
  stale = tmp_path / 'checkpoints' / 'ckpt-15_temp'
  stale.mkdir()
  (stale / 'part-00000-of-00001.index').write_bytes(b'partial')
  best_stale = tmp_path / 'best' / 'checkpoints' / 'ckpt-5_temp'
  best_stale.mkdir(parents=True)
  with caplog.at_level(py_logging.WARNING):
    TinyTrainer(
      config(
        **{
          'train.steps': 20,
          'best_checkpoint.metric': 'loss',
          'train.eval_every': 5,
          'train.accept_config_change': True,
        }
      ),
      str(tmp_path),
    ).train()
  assert not stale.exists() and not best_stale.exists()
  assert os.path.exists(tmp_path / 'checkpoints' / 'ckpt-15.index')
  warned = ' '.join(r.getMessage() for r in caplog.records if r.levelno >= py_logging.WARNING)
  assert 'ckpt-15_temp, left by an interrupted save' in warned
