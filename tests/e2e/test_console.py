"""What a user sees on the console of launch.py: no TensorFlow C++ start-up lines by default
(--tf_logs shows them), and the process ends promptly after the final eval."""

import datetime
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import MNIST_DIR, ROOT

# absl C++ lines ("I0000 00:00:1795356088.549091 5321 port.cc:153] ...", "E1122 ...
# cuda_platform.cc:52] failed call to cuInit") and the notice absl prints before them.
CPP_LINE = re.compile(
  r'^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [\w.]+\.cc:\d+\]|'
  r'absl::InitializeLog|cuInit|oneDNN custom operations'
)


def launch(*args, tf_env=None):
  env = {
    k: v for k, v in os.environ.items() if k not in ('TF_CPP_MIN_LOG_LEVEL', 'ABSL_MIN_LOG_LEVEL')
  }
  env['PYTHONPATH'] = ROOT
  return subprocess.run(
    [sys.executable, os.path.join(ROOT, 'launch.py'), *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
  )


def short_run(tmp_path, *extra):
  return launch(
    '--config=configs/mnist_mlp.py',
    f'--config.data.dir={MNIST_DIR}',
    '--config.train.steps=20',
    '--config.train.steps_per_loop=10',
    '--config.train.log_every=10',
    '--config.train.checkpoint_every=20',
    f'--workdir={tmp_path / "work"}',
    *extra,
  )


def test_default_launch_prints_no_tensorflow_start_up_lines(tmp_path):
  result = short_run(tmp_path)
  assert result.returncode == 0, result.stderr[-3000:]
  noise = [l for l in result.stderr.splitlines() if CPP_LINE.search(l)]
  assert noise == []
  assert 'step 20/20' in result.stderr and result.stdout.startswith('final eval:')


def test_tf_logs_flag_shows_them(tmp_path):
  result = short_run(tmp_path, '--tf_logs')
  assert result.returncode == 0, result.stderr[-3000:]
  assert any(CPP_LINE.search(l) for l in result.stderr.splitlines())


def absl_time(line: str, today: datetime.date) -> float:
  """The wall time of an absl Python log line 'I1122 14:01:46.152052 ...'."""
  clock = datetime.datetime.strptime(line[6:21], '%H:%M:%S.%f').time()
  return datetime.datetime.combine(today, clock).timestamp()


@pytest.mark.slow  # a full epoch of the MNIST CNN
def test_full_epoch_exits_within_5_seconds_of_its_final_eval(tmp_path):
  """The final eval used to be followed by a long interpreter shutdown (garbage collection of
  TensorFlow's object graph) and tf.data teardown before the process ended. A behavioural
  bound on what the user waits for, not a performance claim."""
  result = launch(
    '--config=configs/mnist.py',
    f'--config.data.dir={MNIST_DIR}',
    '--config.train.epochs=1',
    f'--workdir={tmp_path / "work"}',
  )
  ended = time.time()
  assert result.returncode == 0, result.stderr[-3000:]
  final = [l for l in result.stderr.splitlines() if 'eval at step 468:' in l]
  assert len(final) == 1, result.stderr[-3000:]
  waited = ended - absl_time(final[0], datetime.date.today())
  assert 0 <= waited < 5.0, f'{waited:.1f} s from the final eval to the exit'
  assert result.stdout.splitlines()[-1].startswith('accuracy: ')
