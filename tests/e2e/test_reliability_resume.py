"""Crash resume and preemption through launch.py in subprocesses.

With train.deterministic, a run killed with SIGKILL at a random step and started again with the
same command ends with bit-identical weights, optimizer slots and loss-scale state to an
uninterrupted run; SIGTERM and SIGINT save a checkpoint at the end of the current loop and exit
with code 0, and the same command resumes (again bit-identical)."""

import os
import random
import re
import signal
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import ROOT, once_per_session

MNIST_DIR = os.path.join(ROOT, '..', 'shared', 'data', 'mnist')
STEPS = 30
ARGS = [
  '--config=configs/mnist.py',
  f'--config.data.dir={MNIST_DIR}',
  f'--config.train.steps={STEPS}',
  '--config.train.batch_size=32',
  '--config.train.steps_per_loop=5',
  '--config.train.log_every=5',
  '--config.train.checkpoint_every=10',
  '--config.train.deterministic=true',
  # mixed_float16: its dynamic loss scale (halved by the injected step) is state to resume, and
  # it runs near float32's speed here (bfloat16 is emulated on a CPU without AVX512_BF16: a CNN
  # step took 13 times float32's).
  '--config.precision.policy=mixed_float16',
  '--config.debug.inject_nonfinite_steps=12',
  '--config.seed=7',
]
PROGRESS = re.compile(rf'step (\d+)/{STEPS}')


def command(workdir):
  return [sys.executable, 'launch.py', *ARGS, f'--workdir={workdir}']


def env():
  return dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')


def run(workdir):
  result = subprocess.run(
    command(workdir), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=600
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stderr


def interrupt(workdir, at_step, send):
  """Starts a run; once the progress line for `at_step` appears, calls send(process); returns
  (exit code, stderr)."""
  process = subprocess.Popen(
    command(workdir),
    cwd=ROOT,
    env=env(),
    stderr=subprocess.PIPE,
    stdout=subprocess.DEVNULL,
    text=True,
  )
  seen = []
  try:
    for line in process.stderr:
      seen.append(line)
      match = PROGRESS.search(line)
      if match and int(match.group(1)) >= at_step:
        send(process)
        break
    seen.extend(process.stderr)
    return process.wait(timeout=300), ''.join(seen)
  finally:
    if process.poll() is None:
      process.kill()
      process.wait()


def final_state(workdir):
  """{variable name in the checkpoint: value} of the checkpoint at the last step."""
  reader = tf.train.load_checkpoint(os.path.join(workdir, 'checkpoints', f'ckpt-{STEPS}'))
  return {
    name: reader.get_tensor(name)  # save_counter differs: a preempted run saves once more
    for name in reader.get_variable_to_shape_map()
    if 'OBJECT_GRAPH' not in name and not name.startswith('save_counter')
  }


def assert_bit_identical(a, b):
  assert a.keys() == b.keys()
  different = [k for k in a if not np.array_equal(np.asarray(a[k]), np.asarray(b[k]))]
  assert not different, f'{len(different)} of {len(a)} tensors differ, e.g. {different[:3]}'


@pytest.fixture(scope='module')
def reference(tmp_path_factory):
  """The uninterrupted run."""
  return final_state(once_per_session(tmp_path_factory, 'uninterrupted_resume', run))


def test_kill_9_at_a_random_step_then_resume_is_bit_identical(reference, tmp_path):
  at_step = random.Random().choice(range(5, STEPS, 5))
  code, log = interrupt(tmp_path, at_step, lambda p: p.send_signal(signal.SIGKILL))
  assert code == -signal.SIGKILL, f'killed at step {at_step}: {log[-2000:]}'
  log = run(tmp_path)
  resumed = re.search(r'resumed from \S*ckpt-(\d+) at step', log)
  if at_step >= 15:  # a checkpoint (every 10 steps) was surely written before the kill
    assert resumed and int(resumed.group(1)) >= at_step - 10, (at_step, log[-3000:])
  assert_bit_identical(final_state(tmp_path), reference)


@pytest.mark.parametrize(
  'sig',
  [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
  ids=['SIGTERM', 'SIGINT'],
)
def test_signal_saves_at_loop_boundary_and_resumes(reference, tmp_path, sig):
  code, log = interrupt(tmp_path, 5, lambda p: p.send_signal(sig))
  assert code == 0, log[-3000:]
  assert 'Traceback' not in log
  match = re.search(
    rf'stopped by {sig.name} at step (\d+)/{STEPS}; checkpoint saved to (\S+);', log
  )
  assert match, log[-3000:]
  step = int(match.group(1))
  assert step % 5 == 0 and 5 <= step < STEPS  # a loop boundary, before the end
  assert os.path.exists(match.group(2) + '.index')
  log = run(tmp_path)
  assert re.search(rf'resumed from .*ckpt-{step} at step {step}', log), log[-3000:]
  assert_bit_identical(final_state(tmp_path), reference)


@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGKILL], ids=['SIGTERM', 'SIGKILL'])
def test_async_checkpoints_survive_a_signal_and_resume_bit_identical(
  reference, tmp_path, monkeypatch, sig
):
  """train.async_checkpoint: SIGTERM waits for the background write before exiting (code 0);
  kill -9 right after a save leaves the previous checkpoint named; both resume bit-identical."""
  monkeypatch.setattr(
    sys.modules[__name__], 'ARGS', ARGS + ['--config.train.async_checkpoint=true']
  )
  code, log = interrupt(tmp_path, 10, lambda p: p.send_signal(sig))  # ckpt-10 being written
  assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL), log[-3000:]
  assert 'Traceback' not in log
  run(tmp_path)
  assert_bit_identical(final_state(tmp_path), reference)
