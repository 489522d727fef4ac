"""config.distribute and the TPU rules, in this process (no device split, no TPU needed)."""

from __future__ import annotations

import json
import socket

import pytest
import tensorflow as tf

from configs import mnist
from trainer import config as config_lib
from trainer.distribute import strategy as distribute
from trainer.run import build
from trainer.errors import ConfigError, UserError


def _config(**overrides):
  c = mnist.get_config()
  for key, value in overrides.items():
    section, leaf = key.split('.')
    c[section][leaf] = value
  return config_lib.validate(c)


def test_mnist_config_spells_out_the_distribute_keys():
  c = mnist.get_config()
  assert c.distribute.strategy == 'default'
  assert c.distribute.devices == '' and c.distribute.tpu == ''
  assert c.debug.inject_nonfinite_replica == -1
  defaults = config_lib.defaults()
  for key in (
    'distribute.strategy',
    'distribute.devices',
    'distribute.tpu',
    'debug.inject_nonfinite_replica',
  ):
    assert key in config_lib.flatten(defaults)


def test_unknown_strategy_names_the_key():
  with pytest.raises(ConfigError, match=r"config\.distribute\.strategy='gpus'.*mirrored"):
    _config(**{'distribute.strategy': 'gpus'})


def test_inject_replica_below_minus_one_is_rejected():
  with pytest.raises(ConfigError, match=r'config\.debug\.inject_nonfinite_replica=-2'):
    _config(**{'debug.inject_nonfinite_replica': -2})


@pytest.mark.parametrize('policy', ['float32', 'mixed_bfloat16', 'auto'])
@pytest.mark.parametrize('loss_scale', ['auto', 'none'])
def test_tpu_allows_float32_and_bfloat16_without_loss_scale(policy, loss_scale):
  distribute.check_precision(
    _config(
      **{
        'distribute.strategy': 'tpu',
        'precision.policy': policy,
        'precision.loss_scale': loss_scale,
      }
    )
  )


def test_tpu_rejects_float16():
  c = _config(**{'distribute.strategy': 'tpu', 'precision.policy': 'mixed_float16'})
  with pytest.raises(ConfigError, match=r"config\.precision\.policy='mixed_float16'.*TPU"):
    distribute.build(c)


@pytest.mark.parametrize('loss_scale', ['dynamic', '128'])
def test_tpu_rejects_a_loss_scale(loss_scale):
  c = _config(
    **{
      'distribute.strategy': 'tpu',
      'precision.policy': 'mixed_bfloat16',
      'precision.loss_scale': loss_scale,
    }
  )
  with pytest.raises(ConfigError, match=rf"config\.precision\.loss_scale='{loss_scale}'"):
    distribute.build(c)


def test_float16_is_fine_off_tpu():
  distribute.check_precision(
    _config(**{'precision.policy': 'mixed_float16', 'precision.loss_scale': 'dynamic'})
  )


def test_tpu_precision_is_checked_before_the_trainer_touches_data(tmp_path):
  from models.mnist_cnn import MnistCnnTrainer

  c = _config(
    **{
      'distribute.strategy': 'tpu',
      'precision.policy': 'mixed_float16',
      'data.dir': str(tmp_path / 'no-such-folder'),
    }
  )
  with pytest.raises(ConfigError, match='mixed_float16'):  # not the DataError of data.dir
    MnistCnnTrainer(c, str(tmp_path / 'work'))


def test_tpu_address_not_listening_is_a_clear_error():
  with socket.socket() as s:  # a loopback port nobody listens on once closed
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  c = _config(**{'distribute.strategy': 'tpu', 'distribute.tpu': f'grpc://127.0.0.1:{port}'})
  with pytest.raises(
    UserError,
    match=rf"config\.distribute\.tpu='grpc://127\.0\.0\.1:{port}'"
    r': no TPU reachable',
  ):
    distribute.build(c)


def test_no_local_tpu_is_a_clear_error():
  c = _config(**{'distribute.strategy': 'tpu'})
  with pytest.raises(UserError, match=r"config\.distribute\.tpu='': no TPU reachable"):
    distribute.build(c)
  assert float(tf.function(lambda: tf.constant(1.0) + 1.0)()) == 2.0  # TF still usable here


def test_multi_worker_without_tf_config(monkeypatch):
  monkeypatch.delenv('TF_CONFIG', raising=False)
  with pytest.raises(UserError, match='TF_CONFIG'):
    distribute.build(_config(**{'distribute.strategy': 'multi_worker'}))


def test_multi_worker_with_bad_tf_config(monkeypatch):
  monkeypatch.setenv('TF_CONFIG', '{"cluster": {"worker": ["127.0.0.1:1"]}}')  # no task
  with pytest.raises(UserError, match=r'TF_CONFIG is not valid.*"task"'):
    distribute.build(_config(**{'distribute.strategy': 'multi_worker'}))


@pytest.mark.parametrize('address', ['my host:2222', 'host:0', ':2222', 'host'])
def test_tf_config_addresses_follow_the_cluster_flag_rule(monkeypatch, address):
  """One host:port rule (trainer.config.is_address) for TF_CONFIG and --cluster: an address
  with a space passed TF_CONFIG's own copy of the check and was refused by --cluster's."""
  from trainer.launch import cluster

  tf_config = json.dumps({'cluster': {'worker': [address]}, 'task': {'type': 'worker', 'index': 0}})
  monkeypatch.setenv('TF_CONFIG', tf_config)
  with pytest.raises(UserError, match='is not an address'):
    distribute.build(_config(**{'distribute.strategy': 'multi_worker'}))
  with pytest.raises(UserError, match='is not an address'):
    cluster.parse(address)


def test_default_strategy_is_one_replica_and_chief():
  strategy = distribute.build(_config())
  assert strategy.num_replicas_in_sync == 1
  assert distribute.is_chief(strategy)
  c = _config(**{'train.batch_size': 7})  # divides among 1 replica, not 2 (run/build.py)
  build.check_config(c, replicas=1, policy='float32', total_steps=10, train_examples=None)
  with pytest.raises(ConfigError, match=r'batch_size=7 does not divide among 2 replicas; .*8\)'):
    build.check_config(c, replicas=2, policy='float32', total_steps=10, train_examples=None)


def test_mirrored_unknown_device_lists_the_known_ones():
  c = _config(**{'distribute.strategy': 'mirrored', 'distribute.devices': 'GPU:7'})
  with pytest.raises(ConfigError, match=r"no device 'GPU:7' here; available: .*CPU:0"):
    distribute.build(c)


def test_device_names_are_normalised():
  assert distribute._short('/job:localhost/replica:0/task:0/device:GPU:1') == 'GPU:1'
  assert distribute._short('/gpu:1') == 'GPU:1'
  assert distribute._short('cpu:0') == 'CPU:0'


def test_devices_without_the_mirrored_strategy_are_named_as_ignored(caplog):
  """They were ignored without a word: one replica, where the user asked for two devices."""
  config = config_lib.defaults()
  config.distribute.devices = 'CPU:0,CPU:1'
  assert distribute.build(config).num_replicas_in_sync == 1
  assert (
    "config.distribute.devices='CPU:0,CPU:1' is ignored: only the mirrored strategy reads "
    "it, and config.distribute.strategy is 'default'"
  ) in caplog.text
