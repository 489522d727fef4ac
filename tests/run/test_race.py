"""--race: float32 against the mixed policies, XLA off and on, on the user's own config: every
row measured, the loss each reports is the loss a plain run of as many steps logs, and the
command runs on the shipped MNIST config."""

import math
import os
import subprocess
import sys

import pytest

from configs import shakespeare as shakespeare_config
from conftest import DATA, ROOT
from models.transformer_lm import TransformerLmTrainer
from trainer.errors import UserError
from trainer.run import race

SETTINGS = [f'{p}, XLA {x}' for p in race.POLICIES for x in ('off', 'on')]


def _tiny_lm(steps=5):
  config = shakespeare_config.get_config()
  config.data.dir = os.path.join(DATA, 'tinyshakespeare')
  m = config.model_config
  m.context, m.d_model, m.num_heads, m.num_layers = 64, 32, 2, 1
  m.attention_chunk = 16  # the memory-efficient attention's blocks, as at a long context
  config.train.batch_size, config.train.steps = 4, steps
  config.optimizer.warmup_steps = 2
  return config


def test_race_on_the_lm_measures_every_setting_and_reports_a_plain_runs_loss(tmp_path):
  steps = 5
  rows = race.race(TransformerLmTrainer, _tiny_lm(steps), steps=steps)
  assert [r.label for r in rows] == SETTINGS
  for r in rows:
    assert not r.error and r.steps_per_sec > 0 and math.isfinite(r.loss), r
    assert r.memory_mib is not None and r.memory_mib >= 0, r
  # The reference: the same config trained `steps` steps as a plain run, float32 without XLA,
  # logging at the race's call boundaries: the last logged loss is the race's float32 row's.
  c = race._setting(_tiny_lm(steps), 'float32', False, call=1)
  trainer = TransformerLmTrainer(c, str(tmp_path / 'plain'))
  logged = []
  trainer.runner.actions.append(lambda e: e.kind == 'log' and logged.append(e.metrics['loss']))
  trainer.train()
  assert logged[-1] == rows[0].loss
  text = race.markdown(rows, steps)
  assert all(f'| {s} |' in text for s in SETTINGS) and 'Use: --config.precision.policy=' in text


def test_race_refuses_fewer_than_two_steps_before_building_anything():
  """One step would leave the untimed call none: the timed one would trace and compile."""
  with pytest.raises(UserError, match=r'--race=1: race at least 2 steps'):
    race.race(None, None, steps=1)


def test_choice_is_the_fastest_whose_loss_is_float32s():
  rows = [
    race.Row('float32', False, 10.0, 100, 2.0),
    race.Row('float32', True, 12.0, 100, 2.0),
    race.Row('mixed_bfloat16', False, 30.0, 60, 2.5),  # fastest, but its loss is off by 25 %
    race.Row('mixed_bfloat16', True, 15.0, 60, 2.02),
    race.Row('mixed_float16', False, 0.0, None, float('nan'), error='XlaError: x'),
  ]
  assert race.choice(rows) is rows[3]
  text = race.markdown(rows, 10)
  assert '| mixed_bfloat16, XLA on | 15.0 | 1.50 | 60 | 0.60 | 2.0200 |' in text
  assert '| mixed_float16, XLA off | XlaError: x |' in text


def test_race_command_on_mnist_prints_the_table_and_trains_nothing_in_the_workdir(
  mnist_dir, tmp_path
):
  workdir = tmp_path / 'w'
  result = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, 'launch.py'),
      '--config=configs/mnist.py',
      f'--config.data.dir={mnist_dir}',
      '--race=5',
      f'--workdir={workdir}',
    ],
    cwd=ROOT,
    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3'),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  assert all(f'| {s} | ' in result.stdout for s in SETTINGS), result.stdout
  assert 'Use: --config.precision.policy=' in result.stdout
  assert os.listdir(workdir) == ['race.md']  # no checkpoint, no record: nothing trained there
  assert (workdir / 'race.md').read_text() in result.stdout
