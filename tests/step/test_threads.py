"""config.train.intra_op_threads / inter_op_threads reach TensorFlow's thread pools."""

import os
import subprocess
import sys

import pytest
import tensorflow as tf

from trainer import ConfigError
from trainer.distribute import strategy as distribute
from trainer import config as config_lib

from conftest import ROOT


def test_a_fresh_process_gets_the_configured_pools():
  script = (
    'from trainer import config\nfrom trainer.distribute import strategy as distribute\n'
    'c = config.defaults(); c.train.intra_op_threads = 1; c.train.inter_op_threads = 3\n'
    'distribute.set_threads(config.validate(c))\n'
    'import tensorflow as tf\n'
    'tf.constant(1.0) + 1.0  # the runtime starts with the pools set\n'
    't = tf.config.threading\n'
    'print(t.get_intra_op_parallelism_threads(), t.get_inter_op_parallelism_threads())\n'
  )
  done = subprocess.run(
    [sys.executable, '-c', script],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'),
  )
  assert done.returncode == 0, done.stderr[-2000:]
  assert done.stdout.split()[-2:] == ['1', '3']


def test_zero_leaves_tensorflow_alone_and_a_late_change_names_the_key():
  tf.constant(1.0) + 1.0  # this process's runtime has started
  before = tf.config.threading.get_intra_op_parallelism_threads()
  distribute.set_threads(config_lib.defaults())  # 0 and 0: nothing to do, no error
  assert tf.config.threading.get_intra_op_parallelism_threads() == before
  config = config_lib.defaults()
  config.train.intra_op_threads = before + 1
  with pytest.raises(
    ConfigError, match=f'config.train.intra_op_threads={before + 1}: TensorFlow already started'
  ):
    distribute.set_threads(config)
