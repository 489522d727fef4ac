"""Checkpoints: a crash mid-save leaves the previous one usable; an unreadable newest one falls
back to the previous with a warning; none readable is one clear error."""

import glob
import os

import numpy as np
import pytest
from tensorflow.python.checkpoint import checkpoint_management

from trainer.errors import UserError

from tiny import TinyTrainer, tiny_config, weights


def trained(workdir, steps=15, **overrides):
  """A run with checkpoints every 5 steps; returns {step: weights at that step}."""
  trainer = TinyTrainer(tiny_config(**{'train.steps': steps, **overrides}), str(workdir))
  snapshots = {}
  original = trainer.runner.save

  def save():
    snapshots[int(trainer.global_step.numpy())] = weights(trainer)
    return original()

  trainer.runner.save = save
  trainer.train()
  return snapshots


def damage(workdir, step, how):
  prefix = os.path.join(workdir, 'checkpoints', f'ckpt-{step}')
  if how == 'garbage index':
    with open(prefix + '.index', 'wb') as f:
      f.write(b'not a checkpoint index')
  elif how == 'truncated data':
    (data,) = glob.glob(prefix + '.data-*')
    size = os.path.getsize(data)
    with open(data, 'r+b') as f:
      f.truncate(size // 2)
  elif how == 'flipped data':
    (data,) = glob.glob(prefix + '.data-*')
    with open(data, 'r+b') as f:
      f.seek(os.path.getsize(data) // 2)
      byte = f.read(1)
      f.seek(-1, os.SEEK_CUR)
      f.write(bytes([byte[0] ^ 0xFF]))
  elif how == 'missing index':
    os.remove(prefix + '.index')
  else:
    raise ValueError(how)


@pytest.mark.parametrize(
  'how', ['garbage index', 'truncated data', 'flipped data', 'missing index']
)
def test_unreadable_newest_falls_back_to_previous(tmp_path, how, caplog):
  snapshots = trained(tmp_path)
  damage(tmp_path, 15, how)
  fresh = TinyTrainer(tiny_config(**{'train.steps': 15}), str(tmp_path))
  with caplog.at_level('WARNING'):
    assert fresh.runner.restore() == 10
  assert all(np.array_equal(a, b) for a, b in zip(weights(fresh), snapshots[10]))
  warned = ' '.join(r.getMessage() for r in caplog.records if r.levelname == 'WARNING')
  assert 'ckpt-15' in warned and 'unreadable' in warned


def test_training_continues_after_fallback(tmp_path):
  trained(tmp_path)
  damage(tmp_path, 15, 'truncated data')
  fresh = TinyTrainer(tiny_config(**{'train.steps': 15}), str(tmp_path))
  fresh.train()  # redoes steps 10..15 and writes a good ckpt-15 over the damaged one
  again = TinyTrainer(tiny_config(**{'train.steps': 15}), str(tmp_path))
  assert again.runner.restore() == 15
  assert all(np.array_equal(a, b) for a, b in zip(weights(again), weights(fresh)))


def test_no_readable_checkpoint_is_one_clear_error(tmp_path):
  trained(tmp_path)
  for step in (5, 10, 15):
    damage(tmp_path, step, 'garbage index')
  fresh = TinyTrainer(tiny_config(**{'train.steps': 15}), str(tmp_path))
  with pytest.raises(UserError, match='no checkpoint in .* can be restored') as info:
    fresh.runner.restore()
  assert '\n' not in str(info.value)


def test_crash_during_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
  """A crash after the data files are written but before the manager's state file is updated
  (the last thing a save does, with an atomic rename): the state still names the previous
  checkpoint, which loads."""
  trainer = TinyTrainer(tiny_config(**{'train.steps': 10}), str(tmp_path))
  iterator = iter(trainer.datasets.train)
  trainer.runner.train_loop.run(iterator, 5)
  trainer.runner.save()
  at_5 = weights(trainer)
  trainer.runner.train_loop.run(iterator, 5)

  class Crash(BaseException):
    pass

  def crash(*args, **kwargs):
    raise Crash()

  monkeypatch.setattr(checkpoint_management, 'update_checkpoint_state_internal', crash)
  with pytest.raises(Crash):
    trainer.runner.save()
  monkeypatch.undo()
  assert glob.glob(str(tmp_path / 'checkpoints' / 'ckpt-10.index'))  # data written, not named
  fresh = TinyTrainer(tiny_config(**{'train.steps': 10}), str(tmp_path))
  assert fresh.runner.restore() == 5
  assert all(np.array_equal(a, b) for a, b in zip(weights(fresh), at_5))


def test_state_file_is_written_by_atomic_rename(tmp_path, monkeypatch):
  """What makes the above hold: the state file goes through file_io.atomic_write_string_to_file
  (write to a temporary name, then rename)."""
  from tensorflow.python.lib.io import file_io

  written = []
  real = file_io.atomic_write_string_to_file

  def spy(filename, contents, *args, **kwargs):
    written.append(os.path.basename(filename))
    return real(filename, contents, *args, **kwargs)

  monkeypatch.setattr(file_io, 'atomic_write_string_to_file', spy)
  trainer = TinyTrainer(tiny_config(**{'train.steps': 5}), str(tmp_path))
  trainer.runner.save()
  assert 'checkpoint' in written
