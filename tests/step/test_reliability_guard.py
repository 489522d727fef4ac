"""The collapse guard (precision.max_consecutive_skips) and the skip-branch overflow report."""

import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from trainer.errors import CollapseError, UserError

from conftest import ROOT, TESTS
from tiny import TinyTrainer, tiny_config, weights

STORM = ','.join(str(s) for s in range(7, 40))  # every step from 7 on is non-finite


def test_collapse_stops_with_step_scale_and_variable(tmp_path, capfd):
  config = tiny_config(
    **{
      'precision.policy': 'mixed_float16',
      'precision.initial_scale': 1024.0,
      'precision.max_consecutive_skips': 4,
      'train.steps': 30,
      'debug.inject_nonfinite_steps': STORM,
    }
  )
  trainer = TinyTrainer(config, str(tmp_path))
  with pytest.raises(CollapseError) as info:
    trainer.train()
  message = str(info.value)
  assert isinstance(info.value, UserError)
  # Steps 7, 8, 9, 10 skipped: the loop stops early after step 10 (global step 11), not at 15.
  assert int(trainer.global_step.numpy()) == 11
  assert 'collapsed at step 11' in message and 'steps 7 to 10' in message
  assert 'loss scale 64' in message  # 1024 halved four times
  assert trainer.model.trainable_variables[0].path in message  # injection poisons the first
  assert 'ckpt-10' in message and '\n' not in message  # saved at step 10, mid-storm
  # One line for the storm's first skip, from the skip branch, naming the variable (the skips
  # right after it are summed up at the progress line of step 10; the error names them all).
  err = capfd.readouterr().err
  lines = [l for l in err.splitlines() if l.startswith('skipped step')]
  assert [l.split()[2] for l in lines] == ['7']
  assert 'loss scale 1024' in lines[0] and trainer.model.trainable_variables[0].path in lines[0]


def test_a_collapse_from_step_0_says_the_rate_is_not_the_cause_and_goodput_counts_skips(
  tmp_path, caplog
):
  """Every step non-finite from the first: no update was ever applied, so the advice is not to
  lower the learning rate; the goodput line counts the collapsed call's steps as skipped (it
  said 'startup 100%': the call was never recorded)."""
  config = tiny_config(
    **{
      'precision.max_consecutive_skips': 4,
      'train.steps': 30,
      'debug.inject_nonfinite_steps': ','.join(map(str, range(30))),
    }
  )
  trainer = TinyTrainer(config, str(tmp_path))
  with pytest.raises(CollapseError) as info:
    trainer.train()
  message = str(info.value)
  assert 'steps 0 to 3' in message and 'No update was ever applied' in message
  assert 'Lower config.optimizer.learning_rate' not in message
  line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith('goodput'))
  assert line.startswith('goodput 0% of the wall time in train steps'), line
  assert 'startup 100%' not in line and 'skipped 0%' not in line, line


def test_a_static_loss_scale_too_large_is_named_at_collapse(tmp_path):
  """A static scale of 1e30 overflows every float16 gradient from the first step: the error
  blamed only the model or the data, never config.precision.loss_scale."""
  config = tiny_config(
    **{
      'precision.policy': 'mixed_float16',
      'precision.loss_scale': '1e30',
      'precision.max_consecutive_skips': 4,
      'train.steps': 30,
    }
  )
  with pytest.raises(CollapseError) as info:
    TinyTrainer(config, str(tmp_path)).train()
  assert (
    'not the cause: the static loss scale 1e+30 (config.precision.loss_scale) overflows '
    "the gradients (lower it, or set it to 'dynamic'), or the model"
  ) in str(info.value)


def test_last_good_checkpoint_is_intact_and_loads(tmp_path):
  overrides = {
    'precision.max_consecutive_skips': 4,
    'train.steps': 30,
    'debug.inject_nonfinite_steps': STORM,
  }
  trainer = TinyTrainer(tiny_config(**overrides), str(tmp_path))
  with pytest.raises(CollapseError):
    trainer.train()
  # Skipped steps never move the weights: those at the collapse are the weights after step 6.
  at_collapse = weights(trainer)
  manager = tf.train.CheckpointManager(trainer.runner.checkpoint, str(tmp_path / 'checkpoints'), 3)
  assert manager.latest_checkpoint.endswith('ckpt-10')  # the storm (3 skips) reached step 10
  fresh = TinyTrainer(tiny_config(**overrides), str(tmp_path))
  assert fresh.runner.restore() == 10
  assert int(fresh.train_step.skipped_steps.numpy()) == 3  # steps 7, 8, 9
  assert all(np.array_equal(a, b) for a, b in zip(weights(fresh), at_collapse))
  assert all(np.isfinite(w).all() for w in weights(fresh))


def test_guard_off_trains_through_the_storm(tmp_path):
  config = tiny_config(
    **{
      'precision.max_consecutive_skips': 0,
      'train.steps': 20,
      'debug.inject_nonfinite_steps': STORM,
    }
  )
  trainer = TinyTrainer(config, str(tmp_path))
  trainer.train()
  assert int(trainer.global_step.numpy()) == 20
  assert int(trainer.train_step.skipped_steps.numpy()) == 13  # steps 7..19


def test_isolated_skips_never_trip_the_guard(tmp_path):
  """Every other step non-finite: 10 skips in total, never 2 in a row, guard at 2."""
  config = tiny_config(
    **{'precision.max_consecutive_skips': 2, 'train.steps': 20, 'debug.inject_nonfinite_every': 2}
  )
  trainer = TinyTrainer(config, str(tmp_path))
  trainer.train()
  assert int(trainer.train_step.skipped_steps.numpy()) == 9  # 2, 4, ..., 18
  assert int(trainer.train_step.state.guard.consecutive.numpy()) == 0


def test_finite_steps_do_not_touch_the_overflow_record(tmp_path):
  """The per-variable check runs on the skip branch only: after finite steps it is still the
  record of the last skipped step, not overwritten by the good path."""
  config = tiny_config(**{'debug.inject_nonfinite_steps': '3', 'train.steps': 10})
  trainer = TinyTrainer(config, str(tmp_path))
  trainer.train()
  guard = trainer.train_step.state.guard
  assert guard.nonfinite_names() == [trainer.model.trainable_variables[0].path]
  assert list(guard.nonfinite.numpy()) == [1, 0, 0, 0]


def test_max_consecutive_skips_is_validated():
  from trainer import config as config_lib
  from trainer.errors import ConfigError

  config = config_lib.defaults()
  config.precision.max_consecutive_skips = -1
  with pytest.raises(ConfigError, match=r'config\.precision\.max_consecutive_skips=-1'):
    config_lib.validate(config)


MIRRORED = r"""
import os, sys
import tensorflow as tf
cpu = tf.config.list_physical_devices('CPU')[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
sys.path.insert(0, sys.argv[1])
from tiny import TinyTrainer, tiny_config
from trainer.errors import CollapseError
strategy = tf.distribute.MirroredStrategy(['/cpu:0', '/cpu:1'])
config = tiny_config(**{'precision.max_consecutive_skips': 3, 'train.steps': 20,
                        'debug.inject_nonfinite_steps': '7,8,9,10,11,12'})
trainer = TinyTrainer(config, sys.argv[2], strategy=strategy)
try:
  trainer.train()
except CollapseError as e:
  print('COLLAPSE', trainer.global_step.numpy(), trainer.train_step.skipped_steps.numpy(), e)
"""


def test_guard_under_mirrored_strategy_two_replicas(tmp_path):
  """Both replicas' gradients are poisoned; the guard and its report work across replicas."""
  import subprocess

  result = subprocess.run(
    [sys.executable, '-c', MIRRORED, TESTS, str(tmp_path)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'),
  )
  assert result.returncode == 0, result.stderr[-3000:]
  line = next(l for l in result.stdout.splitlines() if l.startswith('COLLAPSE'))
  assert line.startswith('COLLAPSE 10 3 training collapsed at step 10'), line
  assert 'tiny/dense/kernel' in line
  assert result.stderr.count('skipped step') == 1  # step 7's; 8 and 9 came right after a skip
  assert 'skipped step 7 (' in result.stderr
