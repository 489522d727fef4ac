"""Ctrl-C twice through launch.py: the second SIGINT ends the process at once (exit 130, one line)
even in the middle of a compiled call far too long to finish; no checkpoint is written. One
SIGINT (save at the loop boundary, exit 0, resume) is tests/test_reliability_resume.py."""

import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
