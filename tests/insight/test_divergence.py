"""Divergence is never silent: a loss far above its running minimum prints one line naming the
step, the loss and the learning rate; numerics.divergence_stop ends the run, the newest
checkpoint (written before) kept."""

import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import MNIST_DIR, ROOT
from tiny import TinyTrainer, tiny_config
from trainer import config as config_lib
from trainer.errors import DivergenceError
from trainer.insight.divergence import DivergenceMonitor


def test_monitor_rule():
  monitor = DivergenceMonitor(10.0)
  monitor.start(2.3)  # the floor is 0.23: small losses later do not make 0.5 "divergence"
  assert [monitor.update(s, l) for s, l in enumerate([1.0, 0.1, 0.01, 0.5, 2.2])] == [None] * 5
  line = monitor.update(5, 2.31, learning_rate=50.0)
  assert line.startswith(
    'divergence at step 5: loss 2.31 is 10x 0.23 (1/10 of its first loss; '
    'running minimum 0.01), learning rate 50'
  ), line
  monitor = DivergenceMonitor(10.0)
  monitor.start(2.3)
  assert monitor.update(1, 22.0) is None
  assert monitor.update(2, 23.5).startswith(
    'divergence at step 2: loss 23.5 is 10.2x its running minimum 2.3;'
  )
  assert DivergenceMonitor(0.0).update(1, math.inf) is None  # off
  negative = DivergenceMonitor(10.0)
  negative.start(-3.0)  # a log-density: no ratio to speak of
  assert negative.update(1, -1.0) is None and negative.update(2, 5.0) is None
  assert 'loss nan' in DivergenceMonitor(10.0).update(3, math.nan)


def mlp_config(**overrides):
  config = config_lib.load_file(os.path.join(ROOT, 'configs', 'mnist_mlp.py'))
  config.data.dir = MNIST_DIR
  for key, value in overrides.items():
    config_lib.set_dotted(config, key, value)
  return config


def test_learning_rate_50_prints_the_divergence_line(tmp_path, caplog):
  from models.mnist_mlp import MnistMlpTrainer

  config = mlp_config(
    **{
      'optimizer.learning_rate': 50.0,
      'optimizer.schedule': 'constant',
      'train.steps': 100,
      'train.steps_per_loop': 50,
      'train.log_every': 50,
      'train.checkpoint_every': 100,
    }
  )
  with caplog.at_level('WARNING'):
    try:
      MnistMlpTrainer(config, str(tmp_path / 'w')).train()
    except Exception:  # pylint: disable=broad-except  (the final eval may be non-finite)
      pass
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith('divergence')]
  assert lines and lines[0].startswith('divergence at step 50: loss '), lines
  assert 'learning rate 50' in lines[0]


class Jump(TinyTrainer):
  """SGD at 0.1 for 20 steps, then at 1e4."""

  def build_optimizer(self, learning_rate):
    return keras.optimizers.SGD(learning_rate=lambda: tf.where(self.global_step < 20, 0.1, 1e4))


def test_divergence_stop_ends_the_run_and_keeps_the_checkpoint_before(tmp_path):
  workdir = tmp_path / 'w'
  trainer = Jump(
    tiny_config(
      **{
        'train.steps': 40,
        'numerics.divergence_stop': True,
        'train.checkpoint_every': 20,
        'train.steps_per_loop': 5,
      }
    ),
    str(workdir),
  )
  with pytest.raises(DivergenceError, match=r'divergence at step 2\d: .*ckpt-20'):
    trainer.train()
  checkpoints = sorted(f for f in os.listdir(workdir / 'checkpoints') if f.endswith('.index'))
  assert checkpoints == ['ckpt-20.index']
  reader = tf.train.load_checkpoint(str(workdir / 'checkpoints' / 'ckpt-20'))
  for name in reader.get_variable_to_shape_map():
    value = reader.get_tensor(name)
    if np.issubdtype(np.asarray(value).dtype, np.floating):
      assert np.isfinite(value).all(), name
