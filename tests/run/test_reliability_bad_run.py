"""Bad input met after the config is valid: each is one line naming the culprit (a UserError, so
launch.py prints `error: ...` and exits 2), and nothing is written to a new workdir. A full disk
(a file-size limit, RLIMIT_FSIZE, makes the real writes fail in-process) during a checkpoint save
or the config write; a TF_CONFIG task not in its cluster; MNIST files with 0 images; init_from a
damaged checkpoint; --audit into an unwritable workdir."""

import contextlib
import glob
import json
import os
import resource
import signal

import numpy as np
import pytest

from trainer.insight import audit
from trainer.data import mnist
from trainer.errors import ConfigError, DataError, UserError

from test_reliability_bad_input import write_mnist
from test_reliability_checkpoints import damage
from tiny import TinyTrainer, tiny_config, weights


def one_line(error) -> str:
  message = str(error)
  assert message and '\n' not in message
  return message


@contextlib.contextmanager
def file_size_limit(nbytes):
  """Writes past `nbytes` in any file fail with EFBIG, as a full disk fails them with ENOSPC
  (SIGXFSZ ignored, so the write returns the error instead of killing the process)."""
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
  try:
    yield
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, previous)


# ---- a full disk -------------------------------------------------------------------------------
def test_disk_full_during_a_checkpoint_save(tmp_path):
  trainer = TinyTrainer(tiny_config(**{'train.steps': 10}), str(tmp_path))
  trainer.runner.restore()
  trainer.runner.train_loop.run(iter(trainer.datasets.train), 5)
  first = trainer.runner.save()
  saved = weights(trainer)
  trainer.runner.train_loop.run(iter(trainer.datasets.train), 5)
  with file_size_limit(1024), pytest.raises(UserError) as info:  # the data file is larger
    trainer.runner.save()
  message = one_line(info.value)
  prefix = os.path.join(tmp_path, 'checkpoints', 'ckpt-10')
  assert f'could not write checkpoint {prefix} at step 10 (File too large)' in message
  assert f'{first} is intact' in message
  assert not glob.glob(prefix + '*')  # the partial write was removed
  fresh = TinyTrainer(tiny_config(**{'train.steps': 10}), str(tmp_path))
  assert fresh.runner.restore() == 5  # the previous checkpoint loads
  for a, b in zip(weights(fresh), saved, strict=True):
    np.testing.assert_array_equal(a, b)


def test_disk_full_during_the_config_write(tmp_path):
  workdir = tmp_path / 'run'
  trainer = TinyTrainer(tiny_config(), str(workdir))
  # The lock file (written first, a few hundred bytes) fits; config.json does not.
  with file_size_limit(1024), pytest.raises(ConfigError) as info:
    trainer.train()
  message = one_line(info.value)
  assert str(workdir / 'config.json') in message and 'File too large' in message
  assert not workdir.exists() or os.listdir(workdir) == []  # no config.json, .tmp, checkpoint
  trainer = TinyTrainer(tiny_config(), str(workdir))  # space again: the same workdir works
  trainer.train()
  assert json.loads((workdir / 'config.json').read_text())['train']['steps'] == 20


# ---- TF_CONFIG ---------------------------------------------------------------------------------
CLUSTER = {'worker': ['127.0.0.1:2222', '127.0.0.1:2223']}


@pytest.mark.parametrize(
  'task,expected',
  [
    ({'type': 'worker', 'index': 2}, "task index 2 is not in the cluster: 'worker' has 2"),
    ({'type': 'worker', 'index': -1}, 'task index -1 is not in the cluster'),
    ({'type': 'chief', 'index': 0}, "task type 'chief' is not in the cluster (it has 'worker')"),
  ],
)
def test_tf_config_task_not_in_cluster(tmp_path, monkeypatch, task, expected):
  monkeypatch.setenv('TF_CONFIG', json.dumps({'cluster': CLUSTER, 'task': task}))
  workdir = tmp_path / 'run'
  with pytest.raises(UserError) as info:
    TinyTrainer(tiny_config(**{'distribute.strategy': 'multi_worker'}), str(workdir)).train()
  message = one_line(info.value)
  assert message.startswith('TF_CONFIG: ') and expected in message
  assert not workdir.exists()


# ---- data --------------------------------------------------------------------------------------
def test_mnist_files_with_zero_images(tmp_path):
  write_mnist(tmp_path, train_images=0, train_labels=0)
  with pytest.raises(DataError) as info:
    mnist.load(str(tmp_path))
  message = one_line(info.value)
  assert str(tmp_path / 'train-images-idx3-ubyte.gz') in message and '0 images' in message


# ---- init_from ---------------------------------------------------------------------------------
@pytest.mark.parametrize('how', ['garbage index', 'truncated data'])
def test_init_from_a_damaged_checkpoint(tmp_path, how):
  source = tmp_path / 'source'
  TinyTrainer(tiny_config(**{'train.steps': 5}), str(source)).train()
  damage(source, 5, how)
  workdir = tmp_path / 'run'
  trainer = TinyTrainer(tiny_config(**{'train.init_from': str(source)}), str(workdir))
  with pytest.raises(ConfigError) as info:
    trainer.train()
  message = one_line(info.value)
  assert f'config.train.init_from={str(source)!r}' in message and 'unreadable' in message
  assert not workdir.exists()


# ---- --audit -----------------------------------------------------------------------------------
def test_audit_into_an_unwritable_workdir(tmp_path):
  blocker = tmp_path / 'a_file'
  blocker.write_text('')  # a folder cannot be made under a file, even as root
  trainer = TinyTrainer(tiny_config(), str(blocker / 'run'))
  with pytest.raises(UserError) as info:
    audit.report(trainer)
  message = one_line(info.value)
  assert message.startswith('--audit: cannot write ') and str(blocker / 'run') in message
  assert blocker.read_text() == ''
