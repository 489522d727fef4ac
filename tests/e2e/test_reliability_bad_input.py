"""Bad input: each case is a one-line error naming the culprit, a non-zero exit code, nothing
written to the workdir and no traceback. Config and data cases go through the Python API (fast);
the launcher's own cases, and a few of the others end to end, through launch.py."""

import gzip
import os
import struct

import numpy as np
import pytest

from trainer import config as config_lib
from trainer.data import mnist
from trainer.errors import ConfigError, DataError

# tests/conftest.py puts every test folder on sys.path
from test_reliability_bad_config import invalid, launch

from conftest import ROOT

MNIST_DIR = os.path.join(ROOT, '..', 'shared', 'data', 'mnist')


def one_line(error) -> str:
  message = str(error)
  assert message and '\n' not in message
  return message


# ---- config values (trainer.config.validate) ---------------------------------------------------
def test_unknown_model_name():
  import models

  with pytest.raises(ConfigError) as info:
    models.get_trainer_class('resnet9000')
  message = one_line(info.value)
  assert "config.model='resnet9000'" in message and 'mnist_cnn' in message  # lists the choices


def test_unknown_policy():
  assert 'mixed_bfloat16' in invalid('precision.policy', 'mixed_int8')


@pytest.mark.parametrize('value', ['0', '-4', '0.0'])
def test_loss_scale_not_positive(value):
  assert 'positive' in invalid('precision.loss_scale', value)


@pytest.mark.parametrize('value', ['nan', 'inf'])
def test_loss_scale_not_finite(value):
  assert 'finite' in invalid('precision.loss_scale', value)


def test_loss_scale_not_a_number():
  assert "'dynamic'" in invalid('precision.loss_scale', 'lots')


def test_growth_interval_below_one():
  assert '>= 1' in invalid('precision.growth_interval', 0)


def test_min_scale_above_max_scale():
  config = config_lib.defaults()
  config.precision.min_scale, config.precision.max_scale = 1024.0, 2.0
  with pytest.raises(ConfigError) as info:
    config_lib.validate(config)
  message = one_line(info.value)
  assert 'config.precision.min_scale=1024.0' in message and 'config.precision.max_scale' in message


@pytest.mark.parametrize('value', [0, -32])
def test_batch_size_not_positive(value):
  assert '> 0' in invalid('train.batch_size', value)


def test_negative_steps():
  assert '>= 0' in invalid('train.steps', -1)


def test_value_of_wrong_type_in_a_config_file():
  assert 'must be int' in invalid('train.batch_size', '128')


# ---- data files (trainer.data.mnist) -----------------------------------------------------------
def write_idx(path, magic, dims, payload_bytes=None):
  body = bytes(int(np.prod(dims))) if payload_bytes is None else bytes(payload_bytes)
  with gzip.open(path, 'wb') as f:
    f.write(struct.pack('>i', magic) + struct.pack(f'>{len(dims)}i', *dims) + body)


def write_mnist(folder, *, train_images, train_labels, test=2):
  """The four MNIST files in `folder`, with these counts and all-zero pixels."""
  write_idx(folder / 'train-images-idx3-ubyte.gz', 2051, (train_images, 28, 28))
  write_idx(folder / 'train-labels-idx1-ubyte.gz', 2049, (train_labels,))
  write_idx(folder / 't10k-images-idx3-ubyte.gz', 2051, (test, 28, 28))
  write_idx(folder / 't10k-labels-idx1-ubyte.gz', 2049, (test,))


def test_data_folder_missing(tmp_path):
  with pytest.raises(DataError) as info:
    mnist.load(str(tmp_path / 'no-such-folder'))
  assert 'config.data.dir=' in one_line(info.value) and 'no-such-folder' in str(info.value)


def test_idx_wrong_magic(tmp_path):
  path = tmp_path / 'train-images-idx3-ubyte.gz'
  write_idx(path, 2049, (2, 28, 28))  # a labels magic on an images file
  with pytest.raises(DataError) as info:
    mnist.read_idx(str(path), 2051, (None, 28, 28))
  message = one_line(info.value)
  assert str(path) in message and 'magic number 2049' in message and '2051' in message


def test_idx_truncated_payload(tmp_path):
  path = tmp_path / 'train-images-idx3-ubyte.gz'
  write_idx(path, 2051, (3, 28, 28), payload_bytes=2 * 28 * 28)  # header says 3, holds 2
  with pytest.raises(DataError) as info:
    mnist.read_idx(str(path), 2051, (None, 28, 28))
  message = one_line(info.value)
  assert str(path) in message and 'truncated' in message


def test_idx_truncated_gzip_stream(tmp_path):
  good = tmp_path / 'full.gz'
  write_idx(good, 2051, (3, 28, 28))
  path = tmp_path / 'train-images-idx3-ubyte.gz'
  path.write_bytes(good.read_bytes()[:-12])  # a download cut short
  with pytest.raises(DataError) as info:
    mnist.read_idx(str(path), 2051, (None, 28, 28))
  assert str(path) in one_line(info.value)


def test_images_and_labels_of_different_counts(tmp_path):
  write_mnist(tmp_path, train_images=5, train_labels=4)
  with pytest.raises(DataError) as info:
    mnist.load(str(tmp_path))
  message = one_line(info.value)
  assert 'train' in message and '5 images' in message and '4 labels' in message


# ---- through launch.py -------------------------------------------------------------------------


MNIST = ['--config=configs/mnist.py', f'--config.data.dir={MNIST_DIR}']


def test_launch_config_file_missing(tmp_path):
  line = launch(tmp_path, '--config=configs/no_such.py')
  assert '--config=configs/no_such.py' in line and 'no such file' in line.lower()


def test_launch_config_file_without_get_config(tmp_path):
  path = tmp_path / 'empty_config.py'
  path.write_text('BATCH = 128\n')
  line = launch(tmp_path, f'--config={path}')
  assert str(path) in line and 'get_config' in line


def test_launch_unknown_config_key(tmp_path):
  line = launch(tmp_path, *MNIST, '--config.train.batch_sise=64')
  assert '--config.train.batch_sise' in line and 'batch_size' in line  # with a suggestion


def test_launch_value_of_wrong_type(tmp_path):
  line = launch(tmp_path, *MNIST, '--config.train.batch_size=big')
  assert '--config.train.batch_size=big' in line


def test_launch_unwritable_workdir(tmp_path):
  blocker = tmp_path / 'a_file'
  blocker.write_text('')  # a folder cannot be made under a file, even as root
  line = launch(
    tmp_path,
    *MNIST,
    '--config.train.steps=1',
    '--config.train.steps_per_loop=1',
    '--config.train.log_every=1',
    '--config.train.checkpoint_every=1',
    workdir=str(blocker / 'run'),
  )
  assert 'workdir' in line and str(blocker / 'run') in line
  assert blocker.read_text() == ''


def test_launch_bad_value_names_the_key(tmp_path):
  line = launch(tmp_path, *MNIST, '--config.precision.loss_scale=-1')
  assert 'config.precision.loss_scale' in line


def test_launch_data_folder_missing(tmp_path):
  line = launch(tmp_path, '--config=configs/mnist.py', f'--config.data.dir={tmp_path / "nowhere"}')
  assert 'config.data.dir' in line
