"""A careful user's worst day, part two: planted symlinks in forensics/, damaged forensic folders,
an empty or garbled train.lock, and writes into a run that cannot be written. Each is refused
(nothing written outside the run) or one line; an empty lock is taken over once it is older
than the grace period."""

import json
import logging
import os
import time

import numpy as np
import pytest

from trainer.errors import ConfigError, UserError
from trainer.insight import advisor, files, forensics
from trainer.run import lock as workdir_lock

from tiny import TinyTrainer, tiny_config


def one_line(error) -> str:
  message = str(error)
  assert message and '\n' not in message
  return message


def outside(tmp_path):
  """A folder outside the run with one file in it; returns (folder, its listing)."""
  folder = tmp_path / 'outside'
  folder.mkdir()
  (folder / 'meta.json').write_text('precious')
  return folder


SKIPS = {'debug.inject_nonfinite_steps': '3', 'train.steps': 10, 'numerics.forensics_first': 3}


# ---- symlinks ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
  'where',
  ['forensics', 'forensics/step-3', 'forensics/step-3/meta.json', 'forensics/step-3/weights'],
)
def test_training_never_writes_through_a_planted_symlink(tmp_path, caplog, where):
  target = outside(tmp_path)
  run = tmp_path / 'run'
  link = run / where
  link.parent.mkdir(parents=True, exist_ok=True)
  os.symlink(target / 'meta.json' if where.endswith('.json') else target, link)
  trainer = TinyTrainer(tiny_config(**SKIPS), str(run))
  with caplog.at_level(logging.WARNING):
    trainer.train()  # diagnostics never end a run
  assert int(trainer.global_step.numpy()) == 10
  assert sorted(os.listdir(target)) == ['meta.json']
  assert (target / 'meta.json').read_text() == 'precious'
  warned = ' '.join(r.getMessage() for r in caplog.records)
  if where.endswith('.json'):  # the rename replaced the link: the folder is complete
    assert not os.path.islink(link) and json.loads(link.read_text())['step'] == 3
  else:
    assert 'is a symlink' in warned and 'nothing written' in warned


def test_diagnose_record_into_a_symlink_is_one_line(tmp_path):
  target = outside(tmp_path)
  trainer = TinyTrainer(tiny_config(), str(tmp_path / 'run'))
  os.makedirs(tmp_path / 'run')
  os.symlink(target, tmp_path / 'run' / 'forensics')
  batch = next(iter(trainer.datasets.train))
  with pytest.raises(UserError) as info:
    forensics.record(trainer, batch, 0)
  assert 'is a symlink' in one_line(info.value)
  assert sorted(os.listdir(target)) == ['meta.json']


def test_advice_into_a_symlink_or_an_unwritable_run(tmp_path):
  target = outside(tmp_path)
  run = tmp_path / 'run'
  run.mkdir()
  os.symlink(target / 'meta.json', run / 'advice.md')
  files.write(str(run / 'advice.md'), 'text', '--advise')
  assert (target / 'meta.json').read_text() == 'precious' and (
    run / 'advice.md'
  ).read_text() == 'text'
  blocker = tmp_path / 'a_file'
  blocker.write_text('')  # a folder cannot be made under a file, even as root
  with pytest.raises(UserError) as info:
    advisor.report(TinyTrainer, tiny_config(), str(blocker / 'run'), steps=1)
  assert one_line(info.value).startswith('--advise: cannot write')


# ---- damaged forensic folders ------------------------------------------------------------------
def recorded(tmp_path):
  trainer = TinyTrainer(tiny_config(), str(tmp_path / 'run'))
  batch = next(iter(trainer.datasets.train))
  forensics.record(trainer, batch, 4)
  return trainer, forensics.folder_for(str(tmp_path / 'run'), 4)


DAMAGE = {
  'meta.json not JSON': lambda f: open(f + '/meta.json', 'w').write('{not json'),
  'meta.json a list': lambda f: open(f + '/meta.json', 'w').write('[1, 2]'),
  'meta.json empty': lambda f: open(f + '/meta.json', 'w').write(''),
  'meta.json without step': lambda f: _edit(f, lambda m: m.pop('step')),
  'meta.json step a word': lambda f: _edit(f, lambda m: m.update(step='four')),
  'meta.json config a string': lambda f: _edit(f, lambda m: m.update(config='x')),
  'structure names a missing leaf': lambda f: _edit(
    f, lambda m: m.update(batch_structure={'leaf': 'leaf_99'})
  ),
  'batch.npz missing': lambda f: os.remove(f + '/batch.npz'),
  'batch.npz garbage': lambda f: open(f + '/batch.npz', 'w').write('garbage'),
  'batch.npz a folder': lambda f: (os.remove(f + '/batch.npz'), os.mkdir(f + '/batch.npz')),
  'weights missing': lambda f: __import__('shutil').rmtree(f + '/weights'),
  'batch of another shape': lambda f: np.savez(
    f + '/batch.npz', leaf_0=np.zeros((2, 3)), leaf_1=np.zeros(2, np.int32)
  ),
}


def _edit(folder, change):
  with open(folder + '/meta.json') as f:
    meta = json.load(f)
  change(meta)
  with open(folder + '/meta.json', 'w') as f:
    json.dump(meta, f)


@pytest.mark.parametrize('how', list(DAMAGE))
def test_damaged_forensic_folder_is_one_line(tmp_path, how):
  trainer, folder = recorded(tmp_path)
  DAMAGE[how](folder)
  with pytest.raises(UserError) as info:
    forensics.replay_folder(trainer, folder)
  assert folder in one_line(info.value)


# ---- the lock ----------------------------------------------------------------------------------
@pytest.mark.parametrize('content', [b'', b'\x00garbage{'])
def test_an_old_empty_or_garbled_lock_is_taken_over(tmp_path, caplog, content):
  path = tmp_path / workdir_lock.NAME
  path.write_bytes(content)
  old = time.time() - workdir_lock.GRACE_SECONDS - 5
  os.utime(path, (old, old))
  with caplog.at_level(logging.WARNING):
    taken = workdir_lock.acquire(str(tmp_path))
  assert json.loads(path.read_text())['pid'] == os.getpid()
  warnings = [r.getMessage() for r in caplog.records if 'stale lock' in r.getMessage()]
  assert len(warnings) == 1 and 'taking it over' in warnings[0]
  workdir_lock.release(taken)
  assert not path.exists()


def test_a_young_empty_lock_is_waited_for_then_taken_over(tmp_path, monkeypatch, caplog):
  monkeypatch.setattr(workdir_lock, 'GRACE_SECONDS', 1.0)
  path = tmp_path / workdir_lock.NAME
  path.write_bytes(b'')  # a holder that may be writing its record
  start = time.monotonic()
  with caplog.at_level(logging.WARNING):
    taken = workdir_lock.acquire(str(tmp_path))
  assert time.monotonic() - start >= 0.9  # waited for the grace period
  assert json.loads(path.read_text())['pid'] == os.getpid()
  workdir_lock.release(taken)


def test_a_young_lock_whose_record_arrives_is_respected(tmp_path, monkeypatch):
  """An empty lock that a live holder fills in during the grace period is that holder's."""
  import threading

  monkeypatch.setattr(workdir_lock, 'GRACE_SECONDS', 5.0)
  path = tmp_path / workdir_lock.NAME
  path.write_bytes(b'')
  record = {'pid': 1, 'host': 'another-host', 'start': None, 'since': 'now'}
  threading.Timer(0.3, lambda: path.write_text(json.dumps(record))).start()
  with pytest.raises(UserError) as info:
    workdir_lock.acquire(str(tmp_path))
  assert 'host another-host' in one_line(info.value)
  assert json.loads(path.read_text()) == record


# ---- raw tracebacks that are one line now ------------------------------------------------------
def test_warm_up_longer_than_the_run(tmp_path):
  with pytest.raises(ConfigError) as info:
    TinyTrainer(tiny_config(**{'optimizer.warmup_steps': 21}), str(tmp_path / 'run'))
  assert 'config.optimizer.warmup_steps=21 is longer than the run (20 steps)' in one_line(
    info.value
  )
  assert not (tmp_path / 'run').exists()
  TinyTrainer(tiny_config(**{'optimizer.warmup_steps': 20}), str(tmp_path / 'run'))  # fits


def test_fault_injection_aimed_at_a_replica_that_does_not_exist(tmp_path):
  with pytest.raises(ConfigError) as info:
    TinyTrainer(
      tiny_config(**{'debug.inject_nonfinite_steps': '3', 'debug.inject_nonfinite_replica': 1}),
      str(tmp_path / 'run'),
    )
  assert 'config.debug.inject_nonfinite_replica=1: the run has 1 replica(s)' in one_line(info.value)
  assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize(
  'address', ['nothost', '127.0.0.1:notaport', 123, '10.0.0.1:70000', ':2222']
)
def test_tf_config_address_that_is_not_one(tmp_path, monkeypatch, address):
  monkeypatch.setenv(
    'TF_CONFIG',
    json.dumps({'cluster': {'worker': [address]}, 'task': {'type': 'worker', 'index': 0}}),
  )
  with pytest.raises(UserError) as info:
    TinyTrainer(tiny_config(**{'distribute.strategy': 'multi_worker'}), str(tmp_path / 'run'))
  assert f'TF_CONFIG: {address!r} in cluster.worker is not an address' in one_line(info.value)
  assert not (tmp_path / 'run').exists()


@pytest.mark.parametrize('name', ['../x', '.mnist_mlp', 'models/mnist_mlp.py'])
def test_model_name_that_is_not_a_module_name(name):
  import models

  with pytest.raises(ConfigError) as info:
    models.get_trainer_class(name)
  assert f'config.model={name!r} is not a module name' in one_line(info.value)


@pytest.mark.parametrize(
  'args, expected',
  [
    (['--config=configs/mnist.py', '--config.model=../x'], "config.model='../x' is not a module"),
    (['--config=configs/mnist.py', '--config.model=.mnist_mlp'], "'.mnist_mlp' is not a module"),
    (['--config={none}', '--config.train.steps=3'], 'get_config() returned None'),
  ],
)
def test_through_launch(tmp_path, args, expected):
  from test_reliability_bad_config import launch

  none = tmp_path / 'none_config.py'
  none.write_text('def get_config():\n  config = None\n')
  line = launch(tmp_path, *[a.format(none=none) for a in args])
  assert expected in line
