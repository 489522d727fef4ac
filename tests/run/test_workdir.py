"""The run folder (trainer/run/workdir.py): eval, export, sampling and init_from only read it; the
config record survives resumes; bad workdir contents are one-line errors that write nothing;
writes never follow a symlink out of it; a missing, empty or garbled checkpoint state file falls
back to the checkpoints on disk; one training process per workdir (trainer/run/lock.py)."""

import hashlib
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tiny import TinyTrainer, tiny_config
from trainer.run import lifecycle
from trainer.run import lock as workdir_lock
from trainer.errors import ConfigError, UserError

from conftest import ROOT


def snapshot(folder) -> dict[str, str]:
  """{relative path: sha256} of every file (and 'dir' for every folder) under `folder`."""
  result = {}
  for root, dirs, files in os.walk(folder):
    for d in dirs:
      result[os.path.relpath(os.path.join(root, d), folder)] = 'dir'
    for name in files:
      path = os.path.join(root, name)
      with open(path, 'rb') as f:
        result[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
  return result


def set_writable(folder, writable: bool):
  for root, dirs, files in os.walk(folder):
    for name in dirs + files + ['.']:
      path = os.path.join(root, name)
      mode = os.stat(path).st_mode
      os.chmod(
        path,
        mode | stat.S_IWUSR if writable else mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH),
      )


def train(workdir, **overrides):
  trainer = TinyTrainer(tiny_config(**{'train.steps': 10, **overrides}), str(workdir))
  metrics = trainer.train()
  trainer.runner.workdir.close()  # flushes the events and releases the lock, as an exit does
  return metrics


@pytest.fixture
def run(tmp_path):
  workdir = tmp_path / 'run'
  return workdir, train(workdir)


# ---- reading only ------------------------------------------------------------------------------
def test_eval_export_and_init_from_leave_a_read_only_run_byte_identical(run, tmp_path):
  workdir, metrics = run
  before = snapshot(workdir)
  assert 'train.lock' not in before  # released
  set_writable(workdir, False)
  try:
    again = lifecycle.evaluate_checkpoint(TinyTrainer(tiny_config(), str(workdir)))
    assert again == pytest.approx(metrics, rel=1e-6)
    # An override on eval is not recorded anywhere (it used to rewrite config.json).
    lifecycle.evaluate_checkpoint(
      TinyTrainer(tiny_config(**{'optimizer.learning_rate': 0.5}), str(workdir))
    )
    paths = lifecycle.export(TinyTrainer(tiny_config(), str(workdir)), str(tmp_path / 'out'))
    assert os.path.exists(paths['keras'])
    warm = TinyTrainer(tiny_config(**{'train.init_from': str(workdir)}), str(tmp_path / 'warm'))
    assert warm.runner.restore() == 0
    assert warm.evaluate() == pytest.approx(metrics, rel=1e-6)
  finally:
    set_writable(workdir, True)
  assert snapshot(workdir) == before


def test_default_export_folder_is_next_to_the_run(run):
  workdir, _ = run
  before = snapshot(workdir)
  paths = lifecycle.export(TinyTrainer(tiny_config(), str(workdir)))
  assert os.path.dirname(paths['keras']) == str(workdir) + '-export'
  assert snapshot(workdir) == before


# ---- the config record -------------------------------------------------------------------------
def test_resume_keeps_the_first_record_and_adds_one_per_change(run, caplog):
  workdir, _ = run
  first = (workdir / 'config.json').read_bytes()
  train(workdir)  # same config: nothing new
  assert (workdir / 'config.json').read_bytes() == first
  assert not list(workdir.glob('config-step-*.json'))
  caplog.clear()
  train(workdir, **{'train.steps': 20})  # run length: allowed, recorded
  assert (workdir / 'config.json').read_bytes() == first
  assert json.loads((workdir / 'config-step-10.json').read_text())['train']['steps'] == 20
  assert 'recorded as config-step-10.json' in caplog.text  # the file's real name
  # The newest record is what the next resume compares with.
  train(workdir, **{'train.steps': 20})
  assert sorted(p.name for p in workdir.glob('config-step-*.json')) == ['config-step-10.json']


def test_diagnostics_frequency_may_change_on_resume(run, caplog):
  """numerics.every and the forensics rate only set how often diagnostics run."""
  workdir, _ = run
  caplog.clear()
  train(workdir, **{'train.steps': 20, 'numerics.every': 7, 'numerics.forensics_every': 3})
  assert 'numerics.every' in caplog.text and 'numerics.forensics_every' in caplog.text
  assert 'cosine learning-rate schedule' not in caplog.text  # tiny's schedule is constant
  assert json.loads((workdir / 'config-step-10.json').read_text())['numerics']['every'] == 7


def test_a_longer_run_under_a_cosine_schedule_says_the_rate_follows_the_new_curve(tmp_path, caplog):
  workdir = tmp_path / 'run'
  train(workdir, **{'optimizer.schedule': 'cosine'})
  caplog.clear()
  train(workdir, **{'optimizer.schedule': 'cosine', 'train.steps': 20})
  assert 'the cosine learning-rate schedule now spans the new run length' in caplog.text


def test_an_older_spelling_of_float8_is_no_change(run, caplog):
  """A record from before the float8 recipes says precision.float8=false: resuming it as 'none'
  (and reading it) changes nothing, so no error, no warning and no new record."""
  workdir, _ = run
  record = json.loads((workdir / 'config.json').read_text())
  assert record['precision']['float8'] == 'none'
  record['precision']['float8'] = False
  (workdir / 'config.json').write_text(json.dumps(record))
  caplog.clear()
  train(workdir, **{'train.steps': 10})
  TinyTrainer(tiny_config(**{'train.steps': 10}), str(workdir)).runner.workdir.restore_read_only()
  assert 'changed config' not in caplog.text and 'another config' not in caplog.text
  assert not list(workdir.glob('config-step-*.json'))


@pytest.mark.parametrize(
  'old, new, changed',
  [(False, 'none', []), (True, 'delayed', []), ('false', 'none', []), (True, 'none', ['f8'])],
)
def test_changed_keys_compares_float8_as_validation_spells_it(old, new, changed):
  from trainer.run.config_record import changed_keys

  record = lambda v: {'precision': {'float8': v, 'policy': 'float32'}}
  keys = changed_keys(record(old), record(new))
  assert keys == [k.replace('f8', 'precision.float8') for k in changed]


def test_changed_config_is_an_error_naming_the_keys_and_writes_nothing(run):
  workdir, _ = run
  before = snapshot(workdir)
  trainer = TinyTrainer(tiny_config(**{'optimizer.learning_rate': 0.01}), str(workdir))
  with pytest.raises(ConfigError) as info:
    trainer.train()
  message = str(info.value)
  assert '\n' not in message and 'config.optimizer.learning_rate: 0.001 -> 0.01' in message
  assert 'new workdir' in message and 'config.train.accept_config_change=True' in message
  assert snapshot(workdir) == before


def test_accepted_change_resumes_and_is_recorded(run):
  workdir, _ = run
  first = (workdir / 'config.json').read_bytes()
  train(
    workdir,
    **{'optimizer.learning_rate': 0.01, 'train.steps': 15, 'train.accept_config_change': True},
  )
  record = json.loads((workdir / 'config-step-10.json').read_text())
  assert record['optimizer']['learning_rate'] == 0.01
  assert (workdir / 'config.json').read_bytes() == first


def test_failed_resume_with_another_model_replaces_nothing(run):
  workdir, _ = run
  before = snapshot(workdir)

  class Wider(TinyTrainer):
    def build_model(self):
      import keras

      return keras.Sequential(
        [
          keras.Input((8,)),
          keras.layers.Dense(32, activation='relu'),
          keras.layers.Dense(4, dtype='float32'),
        ],
        name='tiny',
      )

  with pytest.raises(UserError, match='no checkpoint .* can be restored'):
    Wider(tiny_config(**{'train.accept_config_change': True, 'seed': 3}), str(workdir)).train()
  assert snapshot(workdir) == before


def test_a_workdir_without_checkpoints_takes_the_new_config(tmp_path):
  workdir = tmp_path / 'run'
  workdir.mkdir()
  (workdir / 'config.json').write_text(json.dumps(tiny_config(seed=5).to_dict()))
  train(workdir)
  assert json.loads((workdir / 'config.json').read_text())['seed'] == 0


# ---- bad workdir contents ----------------------------------------------------------------------
@pytest.mark.parametrize(
  'case', ['checkpoints file', 'tensorboard file', 'garbage config', 'config list', 'workdir file']
)
def test_bad_workdir_contents_are_one_line_and_write_nothing(tmp_path, case):
  workdir = tmp_path / 'run'
  workdir.mkdir()
  if case == 'checkpoints file':
    (workdir / 'checkpoints').write_text('x')
  elif case == 'tensorboard file':
    (workdir / 'tensorboard').write_text('x')
  elif case == 'garbage config':
    (workdir / 'config.json').write_bytes(b'\x00{not json')
  elif case == 'config list':
    (workdir / 'config.json').write_text('[1, 2]')
  else:
    workdir.rmdir()
    workdir.write_text('x')
  before = snapshot(tmp_path)
  with pytest.raises(UserError) as info:
    train(workdir)
  message = str(info.value)
  assert '\n' not in message and str(workdir) in message
  assert snapshot(tmp_path) == before


def test_a_url_workdir_is_one_line_and_creates_no_local_folder(tmp_path, monkeypatch):
  # os.path.abspath('gs://b/run') is '<cwd>/gs:/b/run': training there would look like it wrote
  # to the bucket while it wrote a local folder.
  monkeypatch.chdir(tmp_path)
  with pytest.raises(ConfigError, match=r'^--workdir=gs://bucket/run: .*gcsfuse') as info:
    TinyTrainer(tiny_config(), 'gs://bucket/run')
  assert '\n' not in str(info.value)
  assert os.listdir(tmp_path) == []


def test_a_url_export_dir_is_one_line(run):
  workdir, _ = run
  with pytest.raises(ConfigError, match=r'^--export_dir=s3://b/x: '):
    lifecycle.export(TinyTrainer(tiny_config(), str(workdir)), 's3://b/x')


def test_launch_garbage_config_json_exits_2(tmp_path):
  workdir = tmp_path / 'run'
  workdir.mkdir()
  (workdir / 'config.json').write_text('garbage')
  result = subprocess.run(
    [
      sys.executable,
      'launch.py',
      '--config=configs/mnist_mlp.py',
      f'--workdir={workdir}',
      f'--config.data.dir={os.path.join(ROOT, "..", "shared", "data", "mnist")}',
      '--config.train.steps=1',
      '--config.train.steps_per_loop=1',
      '--config.train.log_every=1',
      '--config.train.checkpoint_every=1',
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '3'},
  )
  assert result.returncode == 2, result.stderr[-2000:]
  lines = [l for l in result.stderr.splitlines() if l.startswith('error:')]
  assert len(lines) == 1 and 'config.json' in lines[0] and 'Traceback' not in result.stderr
  assert sorted(os.listdir(workdir)) == ['config.json']


def test_writes_never_follow_a_symlink_out_of_the_workdir(tmp_path):
  outside = tmp_path / 'precious'
  outside.write_text('keep me')
  workdir = tmp_path / 'run'
  workdir.mkdir()
  for name in ('.write_test', 'config.json.tmp', 'train.lock.tmp'):
    os.symlink(outside, workdir / name)
  train(workdir)
  assert outside.read_text() == 'keep me'
  # A config.json that links out (a fresh run replaces it) is replaced, not written through.
  other = tmp_path / 'other_run'
  other.mkdir()
  record = tmp_path / 'record.json'
  record.write_text(json.dumps(tiny_config(seed=5).to_dict()))
  os.symlink(record, other / 'config.json')
  train(other)
  assert json.loads(record.read_text())['seed'] == 5
  assert not os.path.islink(other / 'config.json')
  assert json.loads((other / 'config.json').read_text())['seed'] == 0


# ---- the checkpoint state file -----------------------------------------------------------------
@pytest.mark.parametrize('how', ['missing', 'empty', 'garbled'])
def test_damaged_state_file_falls_back_to_the_newest_checkpoint_on_disk(tmp_path, how, caplog):
  workdir = tmp_path / 'run'
  train(workdir, **{'train.steps': 15})  # ckpt-5, 10, 15
  state = workdir / 'checkpoints' / 'checkpoint'
  if how == 'missing':
    state.unlink()
  elif how == 'empty':
    state.write_text('')
  else:
    state.write_bytes(b'model_checkpoint_path: \x00\xff garbage {{')
  damaged = snapshot(workdir)
  caplog.set_level(logging.WARNING)
  reader = TinyTrainer(tiny_config(**{'train.steps': 15}), str(workdir))
  assert lifecycle.restore(reader) == 15  # read-only: the state file stays as it is
  assert snapshot(workdir) == damaged
  word = {'missing': 'is missing', 'empty': 'is empty', 'garbled': 'is unreadable'}[how]
  assert any(word in r.getMessage() and 'ckpt-15' in r.getMessage() for r in caplog.records)
  trainer = TinyTrainer(tiny_config(**{'train.steps': 20}), str(workdir))
  assert trainer.runner.restore() == 15  # not a restart from 0
  trainer.train()
  trainer.runner.workdir.close()
  # The repaired state file named the old checkpoints, so max_to_keep=3 rotated ckpt-5 out.
  names = sorted(p.name for p in (workdir / 'checkpoints').glob('ckpt-*.index'))
  assert names == ['ckpt-10.index', 'ckpt-15.index', 'ckpt-20.index']


# ---- one training process per workdir ----------------------------------------------------------
def test_a_second_training_process_is_refused_while_eval_reads(run):
  workdir, metrics = run
  holder = TinyTrainer(tiny_config(**{'train.steps': 10}), str(workdir))
  holder.runner.restore()  # this process holds the lock now
  record = json.loads((workdir / 'train.lock').read_text())
  assert record['pid'] == os.getpid() and record['host'] == socket.gethostname()
  script = textwrap.dedent(f"""
      import sys; sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})
      from tiny import TinyTrainer, tiny_config
      from trainer.run import lifecycle
      from trainer.errors import UserError
      print('eval', lifecycle.evaluate_checkpoint(
          TinyTrainer(tiny_config(**{{'train.steps': 10}}), {str(workdir)!r}))['loss'])
      try:
        TinyTrainer(tiny_config(**{{'train.steps': 20}}), {str(workdir)!r}).train()
      except UserError as e:
        print('error:', e)
      """)
  result = subprocess.run(
    [sys.executable, '-c', script],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, 'PYTHONPATH': ROOT},
  )
  assert result.returncode == 0, result.stderr[-2000:]
  (line,) = [l for l in result.stdout.splitlines() if l.startswith('eval ')]
  assert float(line.split()[1]) == pytest.approx(metrics['loss'], rel=1e-6)
  (error,) = [l for l in result.stdout.splitlines() if l.startswith('error:')]
  assert f'pid {os.getpid()} on this host' in error and 'in use by another training' in error
  holder.runner.workdir.close()
  assert not (workdir / 'train.lock').exists()


def test_lock_of_a_killed_process_is_taken_over(tmp_path, caplog):
  workdir = tmp_path / 'run'
  script = textwrap.dedent(f"""
      import sys, time; sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})
      from tiny import TinyTrainer, tiny_config
      trainer = TinyTrainer(tiny_config(**{{'train.steps': 10}}), {str(workdir)!r})
      trainer.runner.restore()
      print('locked', flush=True)
      time.sleep(600)
      """)
  process = subprocess.Popen(
    [sys.executable, '-c', script],
    cwd=ROOT,
    stdout=subprocess.PIPE,
    text=True,
    env={**os.environ, 'PYTHONPATH': ROOT},
  )
  try:
    assert process.stdout.readline().strip() == 'locked'
  finally:
    process.send_signal(signal.SIGKILL)
    process.wait()
  assert json.loads((workdir / 'train.lock').read_text())['pid'] == process.pid
  caplog.set_level(logging.WARNING)
  trainer = TinyTrainer(tiny_config(**{'train.steps': 10}), str(workdir))
  trainer.train()
  assert any('which is gone; taking it over' in r.getMessage() for r in caplog.records)
  assert json.loads((workdir / 'train.lock').read_text())['pid'] == os.getpid()
  trainer.runner.workdir.close()
  assert not (workdir / 'train.lock').exists()


def test_lock_is_reentrant_in_one_process_and_released_by_the_last_holder(tmp_path):
  first = workdir_lock.acquire(str(tmp_path))
  second = workdir_lock.acquire(str(tmp_path))
  workdir_lock.release(first)
  assert os.path.exists(second)
  workdir_lock.release(second)
  assert not os.path.exists(second)


def test_stale_lock_removal_waits_for_the_folder_flock_and_spares_a_newer_lock(tmp_path):
  # Two processes took over the same stale lock: the later one read the stale record, then the
  # earlier one replaced the file. The later one's compare-and-remove must not remove it.
  import fcntl
  import threading

  path = tmp_path / workdir_lock.NAME
  stale = {'pid': 999999, 'host': socket.gethostname(), 'start': None, 'since': '?'}
  path.write_text(json.dumps(stale))
  guard = os.open(tmp_path, os.O_RDONLY)
  fcntl.flock(guard, fcntl.LOCK_EX)  # the other process is between its read and its create
  remover = threading.Thread(target=workdir_lock._remove_if, args=(str(path), stale))
  remover.start()
  remover.join(timeout=0.5)
  assert remover.is_alive()  # waits for the flock
  newer = {**stale, 'pid': os.getpid()}
  path.unlink()
  path.write_text(json.dumps(newer))
  os.close(guard)
  remover.join(timeout=10)
  assert json.loads(path.read_text()) == newer


def test_lock_without_hard_links(tmp_path, monkeypatch):
  def no_link(*args):
    raise PermissionError(1, 'Operation not permitted')  # as some FUSE mounts answer

  monkeypatch.setattr(os, 'link', no_link)
  path = workdir_lock.acquire(str(tmp_path))
  assert json.loads(open(path).read())['pid'] == os.getpid()
  assert os.listdir(tmp_path) == [workdir_lock.NAME]  # no temporary file left
  other = {'pid': 1, 'host': 'elsewhere', 'start': None, 'since': '?'}
  assert not workdir_lock._link_new(path, other)  # taken: refused, not overwritten
  workdir_lock.release(path)
  assert not os.path.exists(path)


def test_scalar_writes_are_the_same_eager_and_compiled(tmp_path):
  """A set of tags is written eagerly WRITES_BEFORE_COMPILING times, then by one compiled call
  (traced once): every write lands in the event file with its step and float32 value."""
  import tensorflow as tf

  from trainer.run import workdir as workdir_lib

  writer = tf.summary.create_file_writer(str(tmp_path))
  writes = workdir_lib._ScalarWrites(writer)
  tags = ('eval/loss', 'eval/accuracy')
  n = workdir_lib.WRITES_BEFORE_COMPILING + 3
  for step in range(n):
    writes.write(tags, [step + 0.1, -step / 3], step)
  writer.flush()
  call = writes._calls[tags]
  assert call.calls == n and call.compiled.experimental_get_tracing_count() == 1
  found = {}
  for name in os.listdir(tmp_path):
    for event in tf.compat.v1.train.summary_iterator(str(tmp_path / name)):
      for value in event.summary.value:
        found[(event.step, value.tag)] = float(tf.make_ndarray(value.tensor))
  expected = {
    (step, tag): float(np.float32(v))
    for step in range(n)
    for tag, v in zip(tags, [step + 0.1, -step / 3])
  }
  assert found == expected


@pytest.mark.parametrize('umask', [0o022, 0o077])
def test_the_run_records_follow_the_umask_as_checkpoints_do(tmp_path, umask):
  """Under umask 022 the JSON records were 0600 (mkstemp's mode) while checkpoints were 0644."""
  from trainer.insight import files
  from trainer.run.workdir import write_json

  previous = os.umask(umask)
  try:
    write_json(str(tmp_path / 'record.json'), {'a': 1})
    files.write(str(tmp_path / 'advice.md'), 'text', 'test')
    with open(tmp_path / 'plain', 'w'):
      pass  # what the umask gives an ordinary new file, as TensorFlow's writes get
  finally:
    os.umask(previous)
  plain = stat.S_IMODE(os.stat(tmp_path / 'plain').st_mode)
  assert plain == 0o666 & ~umask
  for name in ('record.json', 'advice.md'):
    assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == plain, name
