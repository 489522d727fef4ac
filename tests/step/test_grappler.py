"""config.train.grappler: TensorFlow's graph optimizer on the train and eval loops, or not
(trainer/step/grappler.py). Whether grappler ran on a function is read from its own log
(TF_CPP_VMODULE=meta_optimizer=1 names each function it optimizes), in a fresh process."""

import os
import re
import subprocess
import sys

import pytest
import tensorflow as tf

from trainer import config as config_lib
from trainer.run import build
from trainer.step import grappler

from conftest import ROOT


def _optimized(script: str) -> tuple[list[str], str]:
  """(the functions grappler optimized, stdout) of `script` run in a fresh process."""
  done = subprocess.run(
    [sys.executable, '-c', script],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(
      os.environ,
      TF_CPP_MIN_LOG_LEVEL='0',
      TF_CPP_VMODULE='meta_optimizer=1',
      PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, 'tests')]),
    ),
  )
  assert done.returncode == 0, done.stderr[-3000:]
  item = r'Starting optimization for grappler item: __inference_(\w+?)_\d+'
  return re.findall(item, done.stderr), done.stdout


def test_passes_off_leaves_the_calls_inside_unoptimized_and_the_others_alone():
  items, out = _optimized(
    'import tensorflow as tf\n'
    'from trainer.step import grappler\n'
    '@tf.function\n'
    'def inside(x):\n'
    '  return tf.reduce_sum(x * 2.0 + 1.0)\n'
    '@tf.function\n'
    'def outside(x):\n'
    '  return tf.reduce_sum(x * 3.0 + 1.0)\n'
    'with grappler.passes(False):\n'
    '  a = float(inside(tf.ones([3])))\n'
    '  a += float(inside(tf.ones([3])))\n'
    'with grappler.passes(True):\n'
    '  b = float(outside(tf.ones([3])))\n'
    'print(a, b)\n'
  )
  assert out.split() == ['18.0', '12.0']
  assert 'inside' not in items
  assert items.count('outside') == 1  # TensorFlow's default, once for its one instantiation


@pytest.mark.parametrize('setting', ['false', 'true'])
def test_the_train_and_eval_loops_follow_the_setting(tmp_path, setting):
  items, out = _optimized(
    'from tiny import TinyTrainer, tiny_config\n'
    f"config = tiny_config(**{{'train.grappler': {setting!r}}})\n"
    f'print(TinyTrainer(config, {str(tmp_path)!r}).train()["loss"])\n'
  )
  assert float(out.split()[-1]) > 0
  loops = sorted({item for item in items if item in ('_loop', '_add')})
  assert loops == ([] if setting == 'false' else ['_add', '_loop'])


def test_auto_is_off_on_this_cpu_and_the_switches_are_kept():
  assert not tf.config.list_physical_devices('GPU')
  assert build.grappler('auto') is False
  assert build.grappler('true') is True and build.grappler('false') is False
  assert config_lib.defaults().train.grappler == 'auto'


def test_a_bad_setting_names_the_key():
  config = config_lib.defaults()
  config.train.grappler = 'off'
  with pytest.raises(config_lib.ConfigError, match=r"config.train.grappler='off': must be one of"):
    config_lib.validate(config)


def test_the_options_are_restored_after_the_block():
  from tensorflow.python.eager import context

  before = context.context().function_call_options.config_proto_serialized
  with grappler.passes(False):
    pass
  assert context.context().function_call_options.config_proto_serialized == before
