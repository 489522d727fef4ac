"""config.optimizer's Adam moments (beta_1, beta_2, epsilon) and cosine floor (min_learning_rate)
reach the schedule and the optimizer: checked against values computed by hand and a NumPy Adam."""

import math

import keras
import numpy as np
import pytest

from trainer import ConfigError
from trainer import config as config_lib
from trainer.optim import fused_optimizers, optimizers


def _opt_config(**values):
  config = config_lib.defaults()
  for key, value in values.items():
    config.optimizer[key] = value
  return config_lib.validate(config).optimizer


def test_cosine_decays_to_the_floor():
  """nanoGPT's recipe: peak 1e-3, floor 1e-4, 100 warm-up steps, 2000 steps in all."""
  o = _opt_config(learning_rate=1e-3, min_learning_rate=1e-4, schedule='cosine', warmup_steps=100)
  rate = optimizers.schedule(o, total_steps=2000)
  # By hand: warm-up (step + 1) / 100 of the peak; then 1e-4 + 0.9e-3 * (1 + cos(pi * p)) / 2
  # with p = (step - 100) / 1900.
  expected = {
    0: 1e-5,
    49: 5e-4,
    99: 1e-3,
    100: 1e-3,
    1050: 1e-4 + 0.9e-3 * 0.5,  # half way: cos(pi / 2) = 0
    575: 1e-4 + 0.9e-3 * (1 + math.cos(math.pi / 4)) / 2,
    2000: 1e-4,
    5000: 1e-4,
  }  # the floor at the end, and after it
  for step, want in expected.items():
    assert float(rate(step)) == pytest.approx(want, rel=1e-5), step


def test_the_default_floor_is_zero():
  rate = optimizers.schedule(_opt_config(learning_rate=0.01, schedule='cosine'), 400)
  assert float(rate(0)) == pytest.approx(0.01)
  assert float(rate(100)) == pytest.approx(0.01 * (1 + math.cos(math.pi / 4)) / 2, rel=1e-5)
  assert float(rate(400)) == pytest.approx(0.0, abs=1e-9)


def test_a_floor_above_the_peak_is_an_error():
  with pytest.raises(ConfigError, match='config.optimizer.min_learning_rate=0.1 is above'):
    _opt_config(learning_rate=0.01, min_learning_rate=0.1)


@pytest.mark.parametrize('key, value', [('beta_1', 1.0), ('beta_2', -0.1), ('epsilon', 0.0)])
def test_bad_moments_name_the_key(key, value):
  with pytest.raises(ConfigError, match=f'config.optimizer.{key}='):
    _opt_config(**{key: value})


def _numpy_adamw(w, grads, lr, beta_1, beta_2, epsilon, weight_decay):
  """Adam(W) as its paper and Keras write it, in float64."""
  m, v = np.zeros_like(w), np.zeros_like(w)
  for t, g in enumerate(grads, start=1):
    w = w - lr * weight_decay * w
    m = beta_1 * m + (1 - beta_1) * g
    v = beta_2 * v + (1 - beta_2) * g * g
    alpha = lr * math.sqrt(1 - beta_2**t) / (1 - beta_1**t)
    w = w - alpha * m / (np.sqrt(v) + epsilon)
  return w


@pytest.mark.parametrize('fused', [True, False])
@pytest.mark.parametrize('name', ['adam', 'adamw'])
def test_moments_reach_the_optimizer(name, fused):
  """beta_1, beta_2 and epsilon far from Keras's defaults change the weights as a NumPy Adam
  with those values says (and not as one with the defaults)."""
  moments = dict(beta_1=0.5, beta_2=0.9, epsilon=0.1)
  weight_decay = 0.1 if name == 'adamw' else 0.0
  o = _opt_config(name=name, fused=fused, weight_decay=weight_decay, **moments)
  optimizer = optimizers.build(o, 0.01)
  assert isinstance(
    optimizer,
    fused_optimizers.FusedAdam
    if fused and name == 'adam'
    else fused_optimizers.FusedAdamW
    if fused
    else keras.optimizers.Adam,
  )
  assert (optimizer.beta_1, optimizer.beta_2, optimizer.epsilon) == (0.5, 0.9, 0.1)

  rng = np.random.default_rng(0)
  w0 = rng.normal(size=[5]).astype(np.float32)
  grads = [rng.normal(size=[5]).astype(np.float32) for _ in range(6)]
  variable = keras.Variable(w0)
  optimizer.build([variable])
  for g in grads:
    optimizer.apply_gradients([(g, variable)])
  want = _numpy_adamw(w0.astype(np.float64), grads, 0.01, weight_decay=weight_decay, **moments)
  np.testing.assert_allclose(variable.numpy(), want, rtol=1e-5, atol=1e-6)
  defaults = _numpy_adamw(w0.astype(np.float64), grads, 0.01, 0.9, 0.999, 1e-7, weight_decay)
  assert np.max(np.abs(variable.numpy() - defaults)) > 1e-3  # the moments made a difference
