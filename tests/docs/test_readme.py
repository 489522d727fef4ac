"""The "From Python, without launch.py" example (docs/guides/model-and-data.md) runs as written
and learns."""

import os
import re
import subprocess
import sys

import docblocks
from conftest import ROOT


def test_readme_example_trains(tmp_path):
  block = docblocks.block('runs this block as sine.py')
  (tmp_path / 'sine.py').write_text(block)
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL='3')
  result = subprocess.run(
    [sys.executable, 'sine.py'], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
  )
  assert result.returncode == 0, result.stderr[-3000:]
  mse = float(re.search(r'eval mean squared error ([\d.]+)', result.stdout).group(1))
  assert mse < 0.02  # sin(x) has variance ~0.5 on [-3, 3]: the model really fit it
  assert (tmp_path / 'runs' / 'sine' / 'checkpoints').is_dir()
  # Run again after changing a hyperparameter: a one-line ConfigError, not the old result.
  record = (tmp_path / 'runs' / 'sine' / 'config.json').read_bytes()
  assert 'config.optimizer.learning_rate = 3e-3' in block
  (tmp_path / 'sine.py').write_text(
    block.replace('config.optimizer.learning_rate = 3e-3', 'config.optimizer.learning_rate = 1e-2')
  )
  again = subprocess.run(
    [sys.executable, 'sine.py'], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
  )
  assert again.returncode != 0 and 'eval mean squared error' not in again.stdout
  last = again.stderr.strip().splitlines()[-1]
  assert last.startswith('trainer.errors.ConfigError: workdir ')
  assert 'config.optimizer.learning_rate: 0.003 -> 0.01' in last and 'new workdir' in last
  assert (tmp_path / 'runs' / 'sine' / 'config.json').read_bytes() == record
