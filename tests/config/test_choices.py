"""One source of truth for choices: trainer/config.py defines the policies, loss-scale modes and
strategies that precision, loss_scale and distribute implement; the schema reads the optimizer
registry (issue 10 item 7)."""

import keras
import numpy as np
import pytest

import trainer
from tiny import TinyTrainer, tiny_config
from trainer import config as config_lib
from trainer.distribute import strategy as distribute
from trainer.step import loss_scale
from trainer import registry
from trainer.optim import optimizers
from trainer.step import precision
from trainer.errors import ConfigError


def valid(key, value):
  config = config_lib.defaults()
  config_lib.set_dotted(config, key, value)
  return config_lib.validate(config)


@pytest.mark.parametrize(
  'key, choices',
  [
    ('precision.policy', precision.POLICIES),
    ('distribute.strategy', distribute.STRATEGIES),
    ('precision.loss_scale', [m for m in loss_scale.MODES if m != 'static']),
  ],
)
def test_every_implemented_choice_validates(key, choices):
  for choice in choices:
    assert config_lib.flatten(valid(key, choice))[key] == choice


def test_every_loss_scale_choice_builds_its_mode():
  for mode in loss_scale.MODES:
    text = '128' if mode == 'static' else mode
    scaler = loss_scale.LossScaler.from_config(
      valid('precision.loss_scale', text).precision, 'mixed_float16'
    )
    assert scaler.mode == mode


def test_unregistered_optimizer_names_the_registered_ones():
  with pytest.raises(ConfigError) as info:
    valid('optimizer.name', 'lion')
  message = str(info.value)
  assert "config.optimizer.name='lion'" in message
  assert 'adam, adamw, sgd' in message and 'register_optimizer' in message


def test_registered_optimizer_validates_and_trains(tmp_path, monkeypatch):
  monkeypatch.setattr(registry, '_REGISTRY', dict(registry._REGISTRY))  # undone after
  calls = []

  def lion(opt_config, learning_rate):
    calls.append(opt_config.name)
    return keras.optimizers.Lion(learning_rate=learning_rate, beta_1=0.9)

  trainer.register_optimizer('lion', lion)
  assert 'lion' in registry.names()
  run = TinyTrainer(
    tiny_config(**{'optimizer.name': 'lion', 'optimizer.learning_rate': 1e-4, 'train.steps': 10}),
    str(tmp_path / 'run'),
  )
  assert isinstance(run.optimizer, keras.optimizers.Lion) and calls == ['lion']
  before = [w.copy() for w in run.model.get_weights()]
  metrics = run.train()
  run.runner.workdir.close()
  assert np.isfinite(metrics['loss'])
  assert any(not np.array_equal(a, b) for a, b in zip(before, run.model.get_weights()))


def test_register_optimizer_rejects_a_non_callable():
  with pytest.raises(TypeError, match='register_optimizer'):
    trainer.register_optimizer('broken', 'not a function')


@pytest.mark.parametrize('name', ['adam', 'adamw', 'sgd'])
def test_default_optimizers_are_registered(name):
  built = optimizers.build(valid('optimizer.name', name).optimizer, 1e-3)
  assert isinstance(built, keras.optimizers.Optimizer)
  assert type(built).__name__.lower().endswith(name)
