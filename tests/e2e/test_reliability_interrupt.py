"""Ctrl-C twice through launch.py: the second SIGINT ends the process at once (exit 130, one line)
even in the middle of a compiled call far too long to finish; no checkpoint is written. One
SIGINT (save at the loop boundary, exit 0, resume) is tests/e2e/test_reliability_resume.py."""

import os
import signal
import subprocess
import sys

from conftest import ROOT

MNIST_DIR = os.path.join(ROOT, '..', 'shared', 'data', 'mnist')
# One compiled call of a million steps: it cannot end before the test's timeout, so an exit
# means the signal was acted on during the call.
STEPS = 1_000_000
ARGS = [
  '--config=configs/mnist.py',
  f'--config.data.dir={MNIST_DIR}',
  f'--config.train.steps={STEPS}',
  f'--config.train.steps_per_loop={STEPS}',
  f'--config.train.log_every={STEPS}',
  f'--config.train.checkpoint_every={STEPS}',
  '--config.train.batch_size=32',
  '--config.precision.policy=float32',
  '--config.train.jit_compile=false',
]


def wait_for(process, text, seen):
  for line in process.stderr:
    seen.append(line)
    if text in line:
      return
  raise AssertionError(f'{text!r} never appeared:\n' + ''.join(seen)[-3000:])


def test_second_ctrl_c_interrupts_a_long_compiled_call_at_once(tmp_path):
  workdir = tmp_path / 'run'
  process = subprocess.Popen(
    [sys.executable, 'launch.py', *ARGS, f'--workdir={workdir}'],
    cwd=ROOT,
    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'),
    stderr=subprocess.PIPE,
    stdout=subprocess.DEVNULL,
    text=True,
  )
  seen = []
  try:
    wait_for(process, 'a second Ctrl-C stops at once', seen)  # the handlers are installed
    process.send_signal(signal.SIGINT)
    wait_for(process, 'received SIGINT', seen)  # handled while the call runs
    process.send_signal(signal.SIGINT)
    seen.extend(process.stderr)
    code = process.wait(timeout=120)
  finally:
    if process.poll() is None:
      process.kill()
      process.wait()
  log = ''.join(seen)
  assert code == 130, log[-3000:]
  assert 'Traceback' not in log
  lines = [l for l in log.splitlines() if l.strip()]
  assert lines[-1] == (  # what is on disk: nothing, the call never finished
    'interrupted by a second SIGINT: exiting at once without saving; no checkpoint is on '
    'disk: the same command starts again from step 0'
  )
  assert f'step {STEPS}/' not in log and 'stopped by' not in log
  assert not (workdir / 'train.lock').exists()  # released before os._exit
  checkpoints = workdir / 'checkpoints'  # the call never finished: nothing saved
  assert not checkpoints.exists() or not os.listdir(checkpoints)


SLOW_EVAL = '''
import time

import numpy as np
import tensorflow as tf

from tiny import TinyTrainer


def _pause(x):
  time.sleep(0.5)
  return x


class SlowEvalTrainer(TinyTrainer):
  """TinyTrainer whose eval pass takes 0.5 s a batch, 320 batches: 160 s."""

  def build_datasets(self):
    datasets = super().build_datasets()
    slow = datasets.eval.repeat(20).map(
      lambda x, y: (tf.numpy_function(_pause, [x], tf.float32, stateful=True), y)
    )
    return datasets._replace(eval=slow.map(lambda x, y: (tf.ensure_shape(x, [None, 8]), y)))
'''

SLOW_CONFIG = """
from tiny import tiny_config


def get_config():
  return tiny_config(**{
    'model': 'slowpkg.slow',
    'train.steps': 10,
    'train.checkpoint_every': 1000,
  })
"""


def test_ctrl_c_during_a_slow_final_eval_keeps_the_trained_steps(tmp_path):
  """Issue 35: the final checkpoint was written after the final eval, so with checkpoint_every
  above the run's length a final eval that hung lost every trained step, and Ctrl-C waited for
  it. Now the last step is saved first, and the eval stops between batches on Ctrl-C."""
  (tmp_path / 'slowpkg').mkdir()
  (tmp_path / 'slowpkg' / '__init__.py').write_text('')
  (tmp_path / 'slowpkg' / 'slow.py').write_text(SLOW_EVAL)
  (tmp_path / 'config.py').write_text(SLOW_CONFIG)
  workdir = tmp_path / 'run'
  path = os.pathsep.join([ROOT, os.path.join(ROOT, 'tests'), str(tmp_path)])
  process = subprocess.Popen(
    [sys.executable, 'launch.py', f'--config={tmp_path / "config.py"}', f'--workdir={workdir}'],
    cwd=ROOT,
    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', PYTHONPATH=path),
    stderr=subprocess.PIPE,
    stdout=subprocess.DEVNULL,
    text=True,
  )
  seen = []
  try:
    wait_for(process, 'ckpt-10', seen)  # the last step saved: the final eval starts
    process.send_signal(signal.SIGINT)
    seen.extend(process.stderr)
    code = process.wait(timeout=120)
  finally:
    if process.poll() is None:
      process.kill()
      process.wait()
  log = ''.join(seen)
  assert code == 0, log[-3000:]
  assert 'eval at step 10 interrupted' in log, log[-3000:]
  assert 'eval at step 10: loss' not in log  # it did not run to its end
  assert 'stopped by SIGINT at step 10/10' in log and 'ckpt-10' in log.splitlines()[-1]
  assert 'ckpt-10.index' in os.listdir(workdir / 'checkpoints')
