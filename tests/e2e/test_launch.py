"""launch.py: a bad command is one line naming the culprit, exit 2, and nothing written."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT


def launch(*args, cwd=ROOT):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  return subprocess.run(
    [sys.executable, os.path.join(ROOT, 'launch.py'), *args],
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )


def error_lines(result):
  """Lines on stderr that are ours (TF prints its own start-up noise before absl takes over)."""
  return [l for l in result.stderr.splitlines() if l.startswith('error:')]


@pytest.mark.parametrize(
  'override, culprit',
  [
    (
      '--config.train.batchsize=3',
      '--config.train.batchsize=3: the config has no key train.batchsize; did you mean '
      'train.batch_size?',
    ),
    ('--config.train.batch_size=abc', 'config.train.batch_size'),
    ('--config.train.batch_size=0', 'config.train.batch_size=0: must be > 0'),
    ('--config.precision.loss_scale=-4', 'config.precision.loss_scale'),
  ],
)
def test_bad_override_is_one_line(override, culprit, tmp_path):
  workdir = tmp_path / 'work'
  result = launch('--config=configs/mnist.py', override, f'--workdir={workdir}')
  assert result.returncode == 2
  assert 'Traceback' not in result.stderr
  lines = error_lines(result)
  assert len(lines) == 1 and culprit in lines[0], result.stderr[-2000:]
  assert not workdir.exists()


def test_missing_config_file_is_one_line(tmp_path):
  result = launch('--config=configs/no_such.py')
  assert result.returncode == 2 and 'Traceback' not in result.stderr
  assert error_lines(result) == [
    'error: --config=configs/no_such.py: no such file; pass a config file such as configs/mnist.py'
  ]


def test_config_file_whose_get_config_returns_none(tmp_path):
  """It said '--config is required', although --config was given."""
  path = tmp_path / 'no_return.py'
  path.write_text(
    'from trainer import config as config_lib\n\n\ndef get_config():\n'
    '  config = config_lib.defaults()\n'
  )
  result = launch(f'--config={path}', f'--workdir={tmp_path / "work"}')
  assert result.returncode == 2 and 'Traceback' not in result.stderr
  assert error_lines(result) == [
    f'error: --config={path}: get_config() returned None; end it with `return config` (see '
    'configs/mnist.py)'
  ]
  assert not (tmp_path / 'work').exists()


def test_launch_trains_and_prints_accuracy(mnist_dir, tmp_path):
  result = launch(
    '--config=configs/mnist.py',
    f'--config.data.dir={mnist_dir}',
    '--config.train.steps=20',
    '--config.train.steps_per_loop=10',
    '--config.train.log_every=10',
    '--config.train.checkpoint_every=10',
    f'--workdir={tmp_path}',
  )
  assert result.returncode == 0, result.stderr[-3000:]
  accuracy = [l for l in result.stdout.splitlines() if l.startswith('accuracy: ')]
  assert len(accuracy) == 1 and 0.5 < float(accuracy[0].split()[1]) <= 1.0
  assert (tmp_path / 'config.json').exists()
  assert sorted(os.listdir(tmp_path / 'checkpoints'))[0] == 'checkpoint'


def test_tensorflows_tf_data_options_warning_is_hidden_and_others_are_not():
  """A mirrored eval printed TensorFlow's 'To make it possible to preserve tf.data options ...'
  UserWarning, raised inside its own distributed-dataset reduce; other warnings still show."""
  code = (
    'import warnings, launch; launch.quiet_tensorflow(); '
    'warnings.warn("To make it possible to preserve tf.data options across '
    'serialization boundaries, ..."); warnings.warn("a warning of the user\'s own")'
  )
  result = subprocess.run(
    [sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
  )
  assert 'preserve tf.data options' not in result.stderr
  assert "a warning of the user's own" in result.stderr
