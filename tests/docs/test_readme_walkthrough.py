"""The README's "Write your own model" walk-through runs verbatim on a copy of the repository, and
the same model with its pipeline written out (docs/guides/model-and-data.md) trains."""

import importlib
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import docblocks
from trainer import config as config_lib

from conftest import ROOT


def walkthrough():
  """[(file path or None, language, code)] for the walk-through's code blocks, in order."""
  blocks = []
  for prose, lang, code in docblocks.section('runs the blocks below in order, verbatim'):
    # The file a block is written to is the first path named in the paragraph before it.
    named = re.search(r'`((?:models|configs)/\w+\.py)`', prose)
    blocks.append((named.group(1) if named else None, lang, code))
  return blocks


def test_walkthrough_has_files_and_commands():
  blocks = walkthrough()
  assert [b[0] for b in blocks if b[0]] == ['models/my_mlp.py', 'configs/my_mlp.py']
  assert sum(lang == 'bash' for _, lang, _ in blocks) == 3 and len(blocks) == 5


@pytest.mark.slow
def test_walkthrough_runs_verbatim(tmp_path):
  repo = tmp_path / 'repo'
  repo.mkdir()
  for name in ('trainer', 'models', 'configs'):
    shutil.copytree(
      os.path.join(ROOT, name), repo / name, ignore=shutil.ignore_patterns('__pycache__')
    )
  shutil.copy(os.path.join(ROOT, 'launch.py'), repo)
  os.symlink(os.path.realpath(os.path.join(ROOT, '..', 'shared')), tmp_path / 'shared')
  env = {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2', 'PYTHONPATH': str(repo)}
  outputs = []
  for path, lang, code in walkthrough():
    if path:
      (repo / path).write_text(code)
      continue
    command = code.replace('\\\n', ' ').strip().replace('python ', f'{sys.executable} ', 1)
    result = subprocess.run(
      command, shell=True, cwd=repo, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f'{command}\n{result.stderr[-3000:]}'
    outputs.append(result.stdout)
  audit, train, _ = outputs
  assert 'No hazards' in audit
  assert '| my_mlp/dense_2 | Dense | float32 | float32 | float32 |' in audit  # by its path
  accuracy = float(re.search(r'accuracy: ([\d.]+)', train).group(1))
  assert accuracy > 0.97
  assert (repo / 'runs' / 'my_mlp' / 'curves.png').stat().st_size > 10_000


def test_pipeline_written_out_trains(tmp_path, monkeypatch, mnist_dir):
  """The walk-through's model with its tf.data pipeline written out: the eval set is the whole
  test set once, and 60 steps train it far above chance (accuracy checked against NumPy)."""
  code = docblocks.block('runs this block as models/my_mlp.py with its own pipeline')
  (tmp_path / 'my_mlp_pipeline.py').write_text(code)
  monkeypatch.syspath_prepend(str(tmp_path))
  sys.modules.pop('my_mlp_pipeline', None)
  module = importlib.import_module('my_mlp_pipeline')
  config = config_lib.defaults()
  config.model = 'my_mlp_pipeline'
  config.data.dir = mnist_dir
  config.train.update(steps=60, steps_per_loop=20, log_every=20, checkpoint_every=60)
  config.precision.policy = 'float32'
  try:
    trainer = module.MyMlpTrainer(config, str(tmp_path / 'w'))
    metrics = trainer.train()
  finally:
    sys.modules.pop('my_mlp_pipeline', None)
  from trainer.data import mnist

  _, (x_test, y_test) = mnist.load(mnist_dir)
  labels, right = [], 0
  for images, batch_labels in trainer.datasets.eval:
    labels.append(batch_labels.numpy())
    predicted = np.argmax(trainer.model(images).numpy(), -1)
    right += int((predicted == batch_labels.numpy()).sum())
  labels = np.concatenate(labels)
  np.testing.assert_array_equal(labels, y_test)  # every test example once, in order
  assert metrics['accuracy'] == pytest.approx(right / len(y_test), abs=1e-6)
  assert metrics['accuracy'] > 0.8  # chance is 0.1
