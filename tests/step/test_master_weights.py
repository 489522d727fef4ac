"""16-bit master weights (config.precision.master_weights; trainer/optim/low_precision.py and
rounding.py): the rounding against NumPy references, the optimizers' updates against a float64
Adam/SGD, skipped steps, resumes, MirroredStrategy and the config errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import low_precision_runs as runs
from tiny import TinyTrainer, tiny_config
from trainer.optim import low_precision, rounding
from trainer.errors import ConfigError

from conftest import ROOT


def bf16_neighbours(x: np.ndarray):
  """(down, up): the bfloat16 values either side of float32 x, towards and away from zero, by
  bit arithmetic on the float32 pattern (up == down when x is a bfloat16 value)."""
  bits = np.asarray(x, np.float32).view(np.uint32)
  down = bits & np.uint32(0xFFFF0000)
  up = np.where(bits == down, down, down + np.uint32(0x10000))
  return down.view(np.float32), up.view(np.float32)


def stochastic_round(x: np.ndarray, seed) -> tf.Tensor:
  """rounding.stochastic_round with 16-bit noise drawn from `seed`, as the optimizer draws it."""
  bits = rounding.random_bits(tf.constant(seed, tf.int64), x.size, 1)
  return rounding.stochastic_round(tf.constant(x), tf.reshape(rounding.noise(bits, 0), x.shape))


def as_f64(t) -> np.ndarray:
  return tf.cast(t, tf.float64).numpy()


def test_stochastic_rounding_is_unbiased_and_lands_on_a_neighbour():
  rng = np.random.default_rng(0)
  values = np.concatenate([rng.normal(size=6), [1 + 2**-10, -3.0 - 2**-9, 1e-20, 0.999]])
  values = values.astype(np.float32)
  draws = 4000
  x = np.repeat(values[:, None], draws, axis=1)  # each value rounded `draws` times
  out = as_f64(stochastic_round(x, [1, 2]))
  down, up = bf16_neighbours(x)
  assert np.all((out == down) | (out == up))
  mean = out.mean(axis=1)
  gap = np.abs(up[:, 0].astype(np.float64) - down[:, 0])
  p = np.abs(values.astype(np.float64) - down[:, 0]) / np.where(gap > 0, gap, 1)
  sigma = gap * np.sqrt(p * (1 - p) / draws)
  # the mean of the draws is the float32 value within 5 standard errors (and a float32 ulp)
  assert np.all(np.abs(mean - values) <= 5 * sigma + np.abs(values) * 2**-23)
  # and the rounding is stochastic: both neighbours occur for a value in between
  assert len(set(out[-1])) == 2


def test_random_bits_depend_on_the_seed_only_and_each_chunk_is_uniform():
  draws = {
    seed: rounding.random_bits(tf.constant(seed, tf.int64), 20000, 3) for seed in ((5, 7), (5, 8))
  }
  again = rounding.random_bits(tf.constant((5, 7), tf.int64), 20000, 3)
  assert draws[(5, 7)].numpy().tobytes() == again.numpy().tobytes()
  assert draws[(5, 7)].numpy().tobytes() != draws[(5, 8)].numpy().tobytes()
  chunks = [rounding.noise(draws[(5, 7)], j).numpy() for j in range(3)]
  for chunk in chunks:  # uniform on [0, 2^16): mean 32767.5, sd 18918 / sqrt(n)
    assert chunk.min() >= 0 and chunk.max() < 2**16
    assert abs(chunk.mean() - 32767.5) < 5 * 18918 / np.sqrt(chunk.size)
  # the chunks are different bits of the draw, not copies
  assert abs(np.corrcoef(chunks[0], chunks[1])[0, 1]) < 0.05
  assert abs(np.corrcoef(chunks[1], chunks[2])[0, 1]) < 0.05


def test_kahan_error_stays_below_plain_bfloat16_rounding():
  rng = np.random.default_rng(1)
  updates = rng.uniform(0, 2e-4, size=(5000, 64)).astype(np.float32)  # << bfloat16 ulp of 1
  exact = 1.0 + updates.astype(np.float64).sum(axis=0)
  w = tf.ones([64], tf.bfloat16)
  c = tf.zeros([64], tf.bfloat16)
  plain = tf.ones([64], tf.bfloat16)
  for u in updates:
    w, c = rounding.kahan_add(w, c, tf.constant(u))
    plain = tf.cast(tf.cast(plain, tf.float32) + u, tf.bfloat16)  # round to nearest
  kahan_error = np.abs(as_f64(w) + as_f64(c) - exact).max()
  plain_error = np.abs(as_f64(plain) - exact).max()
  assert plain_error > 0.4  # every update rounds away: plain bfloat16 stays at 1.0
  # the compensation's own bfloat16 rounding (<= 2^-9 of |c| <= 2^-9) adds up as a random walk
  assert kahan_error < 1e-2 * plain_error
  # the weight alone is the exact sum rounded to bfloat16, within one bfloat16 ulp (2^-7 at 2)
  assert np.abs(as_f64(w) - exact).max() <= 2**-7


def adam_reference(w, g, m, v, t, lr, b1=0.9, b2=0.999, eps=1e-7, wd=0.0):
  """Keras's AdamW formula in float64."""
  m = m + (g - m) * (1 - b1)
  v = v + (g * g - v) * (1 - b2)
  alpha = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
  return w - w * wd * lr - m * alpha / (np.sqrt(v) + eps), m, v


def sr_check(variable, ref_w):
  """Every element of `variable` is one of float64 `ref_w`'s bfloat16 neighbours, and the mean is
  `ref_w` within 5 standard errors."""
  out = as_f64(variable).reshape(-1)
  down, up = bf16_neighbours(np.float32(ref_w))
  assert set(np.unique(out)) <= {float(down), float(up)}
  p = (ref_w - down) / (up - down)
  assert abs(out.mean() - ref_w) <= 5 * (up - down) * np.sqrt(p * (1 - p) / out.size)


def one_update(cls, master_weights, w0, grads, **kwargs):
  variable = keras.Variable(w0, dtype='bfloat16')
  optimizer = cls(learning_rate=1e-3, master_weights=master_weights, seed=3, **kwargs)
  optimizer.build([variable])
  for g in grads:
    optimizer.apply_gradients([(tf.constant(g), variable)])
  return variable, optimizer


@pytest.mark.parametrize('cls', [low_precision.LowPrecisionAdam, low_precision.LowPrecisionAdamW])
def test_adam_sr_update_equals_float64_adam_in_expectation(cls):
  n = 8192
  w0 = np.full(n, 1.0, np.float32)
  g = np.full(n, 0.5, np.float32)
  variable, optimizer = one_update(cls, 'bfloat16_sr', w0, [g], weight_decay=0.1)
  ref_w, ref_m, ref_v = adam_reference(1.0, 0.5, 0.0, 0.0, 1, 1e-3, wd=0.1)
  sr_check(variable, ref_w)
  for slot, ref in ((optimizer._momentums[0], ref_m), (optimizer._velocities[0], ref_v)):
    assert slot.dtype == 'bfloat16'
    values = as_f64(slot)
    lo, hi = bf16_neighbours(np.float32(ref))
    assert set(np.unique(values)) <= {float(lo), float(hi)}
    assert abs(values.mean() - ref) <= 0.02 * (hi - lo) + 5 * (hi - lo) / np.sqrt(n)


@pytest.mark.parametrize('compiled', [False, True])
def test_updates_in_several_calls_give_each_variable_its_own_bits(compiled):
  """With fewer elements per compiled call than the model has, the variables are updated in
  several calls (in a tf.function: each after the previous one's assigns); each is still Adam's
  update rounded stochastically, and identical variables in different calls round with
  different bits."""
  variables = [keras.Variable(np.ones((30, 10), np.float32), dtype='bfloat16') for _ in range(4)]
  optimizer = low_precision.LowPrecisionAdam(
    learning_rate=1e-3, master_weights='bfloat16_sr', seed=3
  )
  optimizer.CALL_ELEMENTS = 512  # 300 elements pad to 512: one variable per call
  optimizer.build(variables)
  g = tf.constant(np.full((30, 10), 0.5, np.float32))
  apply = lambda: optimizer.apply_gradients([(g, v) for v in variables])
  (tf.function(apply) if compiled else apply)()
  ref_w, _, _ = adam_reference(1.0, 0.5, 0.0, 0.0, 1, 1e-3)
  for v in variables:
    sr_check(v, ref_w)
  outputs = {as_f64(v).tobytes() for v in variables}
  assert len(outputs) == 4


def test_update_step_called_directly_gives_each_variable_its_own_bits():
  variables = [keras.Variable(np.ones(4096, np.float32), dtype='bfloat16') for _ in range(2)]
  optimizer = low_precision.LowPrecisionAdam(
    learning_rate=1e-3, master_weights='bfloat16_sr', seed=3
  )
  optimizer.build(variables)
  for v in variables:
    optimizer.update_step(
      tf.constant(np.full(4096, 0.5, np.float32)), v, tf.constant(1e-3, tf.float32)
    )
  ref_w, _, _ = adam_reference(1.0, 0.5, 0.0, 0.0, 1, 1e-3)
  for v in variables:
    sr_check(v, ref_w)
  assert as_f64(variables[0]).tobytes() != as_f64(variables[1]).tobytes()


def test_an_optimizer_stream_draws_other_bits_and_stream_0_the_usual_ones():
  """Two optimizers with the same seed round identical weights with the same bits unless their
  streams differ (an update group's index, set by the step); stream 0 is the seed as before."""

  def after_one_update(stream=None):
    variable = keras.Variable(np.ones(4096, np.float32), dtype='bfloat16')
    optimizer = low_precision.LowPrecisionAdam(
      learning_rate=1e-3, master_weights='bfloat16_sr', seed=3
    )
    if stream is not None:
      optimizer.stream = stream
    optimizer.build([variable])
    optimizer.apply_gradients([(tf.constant(np.full(4096, 0.5, np.float32)), variable)])
    return as_f64(variable)

  ref_w, _, _ = adam_reference(1.0, 0.5, 0.0, 0.0, 1, 1e-3)
  default, zero, one = after_one_update(), after_one_update(0), after_one_update(1)
  assert default.tobytes() == zero.tobytes()
  assert one.tobytes() != default.tobytes()
  sr_check(one, ref_w)  # still Adam's update, rounded stochastically


def two_group_trainer(make_second, second: int):
  """A TinyTrainer whose step has two update groups: the trainer's optimizer on one of its two
  Dense layers, `make_second(trainer)` on layer `second` (0 or 1)."""
  from trainer import TrainStep, UpdateGroup

  class TwoGroups(TrainStep):
    def __init__(self, trainer):
      self.second = make_second(trainer)
      super().__init__(trainer)

    @property
    def groups(self):
      layers = self.model.layers
      return [
        UpdateGroup(self.optimizer, layers[1 - second].trainable_variables, self.loss_scaler),
        UpdateGroup(self.second, layers[second].trainable_variables, self.loss_scaler),
      ]

  class TwoGroupTrainer(TinyTrainer):
    def build_train_step(self):
      return TwoGroups(self)

  return TwoGroupTrainer


def test_each_update_group_gets_its_own_stream(tmp_path):
  """A step with two update groups, both optimizers made by build_optimizer (one config.seed):
  build_optimizers gives them streams 0 and 1, and the step trains."""
  trainer_class = two_group_trainer(lambda trainer: trainer.build_optimizer(lambda: 1e-3), 1)
  trainer = trainer_class(
    tiny_config(**runs.overrides('bfloat16_sr'), **{'train.steps': 2}), str(tmp_path / 'work')
  )
  groups = trainer.train_step.groups
  assert isinstance(groups[1].optimizer, low_precision.LowPrecisionAdamW)
  assert [group.optimizer.stream for group in groups] == [0, 1]
  before = as_f64(trainer.model.layers[0].kernel)
  trainer.train()
  assert not np.array_equal(as_f64(trainer.model.layers[0].kernel), before)


def test_a_group_with_a_plain_keras_optimizer_is_refused_under_16_bit_masters(tmp_path):
  """A Keras Adam on bfloat16 weights computes their update in bfloat16, where it rounds to
  nothing: the group's weights would stay frozen without a word. It is one ConfigError line."""
  trainer_class = two_group_trainer(lambda trainer: keras.optimizers.Adam(1e-3), 0)
  with pytest.raises(ConfigError, match="update group 1's optimizer is Adam") as info:
    trainer_class(tiny_config(**runs.overrides('bfloat16_sr')), str(tmp_path / 'work'))
  assert 'trainer.build_optimizer(learning_rate)' in str(info.value)


def test_a_bfloat16_layer_under_float32_masters_with_8_bit_state_rounds_stochastically():
  """A variable built in bfloat16 (precision.allow_low_precision_variables) under float32
  masters and 8-bit state: its update is rounded stochastically, as under bfloat16_sr."""
  variable = keras.Variable(np.ones(8192, np.float32), dtype='bfloat16')
  optimizer = low_precision.LowPrecisionAdam(learning_rate=1e-3, state_bits=8, seed=3)
  optimizer.build([variable])
  optimizer.apply_gradients([(tf.constant(np.full(8192, 0.5, np.float32)), variable)])
  sr_check(variable, adam_reference(1.0, 0.5, 0.0, 0.0, 1, 1e-3)[0])


def test_adam_kahan_tracks_float64_adam_over_many_steps():
  rng = np.random.default_rng(2)
  n, steps = 256, 200
  w0 = rng.uniform(1, 2, n).astype(np.float32)  # bfloat16 ulp 2^-7: lr 1e-3 steps round away
  w0 = as_f64(tf.cast(w0, tf.bfloat16)).astype(np.float32)
  grads = rng.normal(size=(steps, n)).astype(np.float32)
  variable, optimizer = one_update(low_precision.LowPrecisionAdam, 'bfloat16_kahan', w0, grads)
  w, m, v = w0.astype(np.float64), 0.0, 0.0
  for t, g in enumerate(grads, 1):
    w, m, v = adam_reference(w, g.astype(np.float64), m, v, t, 1e-3)
  comp = as_f64(optimizer._compensations[0])
  kahan_error = np.abs(as_f64(variable) + comp - w).max()
  # plain bfloat16 (round to nearest every step) from the same start, for comparison
  plain, pm, pv = w0.astype(np.float64), 0.0, 0.0
  for t, g in enumerate(grads, 1):
    plain, pm, pv = adam_reference(plain, g.astype(np.float64), pm, pv, t, 1e-3)
    plain = as_f64(tf.cast(plain, tf.bfloat16))
  plain_error = np.abs(plain - w).max()
  assert kahan_error < 0.1 * plain_error
  assert np.abs(as_f64(variable) - w).max() <= 2**-7  # within one bfloat16 ulp in [1, 2)


@pytest.mark.parametrize('nesterov', [False, True])
def test_sgd_sr_update_equals_float64_sgd_in_expectation(nesterov):
  n = 8192
  w0, g = np.full(n, 1.0, np.float32), np.full(n, 0.3, np.float32)
  variable, _ = one_update(
    low_precision.LowPrecisionSGD, 'bfloat16_sr', w0, [g, g], momentum=0.9, nesterov=nesterov
  )
  # Keras's SGD: m = momentum * m - lr * g; w += m (nesterov: w += momentum * m - lr * g)
  w, m = 1.0, 0.0
  for _ in range(2):
    m = 0.9 * m - 1e-3 * 0.3
    w += (0.9 * m - 1e-3 * 0.3) if nesterov else m
  out = as_f64(variable)
  # two stochastic roundings of the weight (and the momentum's): within 5 standard errors of
  # one bfloat16 gap at 1.0
  assert abs(out.mean() - w) <= 5 * 2**-8 / np.sqrt(n) * 2
  assert abs(out.mean() - w) < 0.1 * (1.0 - w)  # and far closer than the update itself


def test_model_variables_are_bfloat16_and_logits_stay_float32(tiny_trainer):
  trainer = tiny_trainer(**runs.overrides('bfloat16_sr'))
  hidden, logits = trainer.model.layers
  assert hidden.kernel.dtype == 'bfloat16' and hidden.bias.dtype == 'bfloat16'
  assert hidden.compute_dtype == 'bfloat16'
  assert logits.kernel.dtype == 'float32'  # the layer built with dtype='float32'


@pytest.mark.parametrize('setting', ['bfloat16_sr', 'bfloat16_kahan'])
@pytest.mark.parametrize('optimizer', ['adamw', 'sgd'])
def test_skipped_step_leaves_every_stored_tensor_bit_identical(tmp_path, setting, optimizer):
  result = runs.skip_check(str(tmp_path), setting, optimizer)
  assert result['skipped'] == 1
  assert result['changed_by_skip'] == []
  assert result['changed_by_next']  # the comparison can fail: an applied step changes them
  assert 'bfloat16' in result['dtypes']


@pytest.mark.parametrize('setting', ['bfloat16_sr', 'bfloat16_kahan'])
def test_resume_is_bit_identical(tmp_path, setting):
  assert runs.resume_check(str(tmp_path), setting) == []


def test_grad_accumulation_equals_one_batch(tmp_path):
  """Accumulated micro-batch gradients give the update of the whole batch (same random bits);
  compared to 1e-6, as the summation order of the gradients differs."""
  out = []
  for k in (1, 2):
    config = tiny_config(**runs.overrides('bfloat16_kahan', 'sgd', **{'train.grad_accum_steps': k}))
    trainer = TinyTrainer(config, str(tmp_path / f'k{k}'))
    runs.run_steps(trainer, 3)
    out.append(
      [
        as_f64(v) + as_f64(c)
        for v, c in zip(
          [v for v in trainer.model.trainable_variables if v.dtype == 'bfloat16'],
          trainer.optimizer._compensations,
        )
      ]
    )
  for a, b in zip(*out):
    np.testing.assert_allclose(a, b, atol=2e-3)


def test_master_weights_needs_mixed_bfloat16():
  with pytest.raises(
    ConfigError,
    match=r"^config.precision.master_weights='bfloat16_sr' needs "
    r"config.precision.policy='mixed_bfloat16'",
  ):
    TinyTrainer(
      tiny_config(
        **{'precision.master_weights': 'bfloat16_sr', 'precision.policy': 'mixed_float16'}
      ),
      '/nonexistent',
    )


@pytest.mark.parametrize('resolved', ['mixed_bfloat16', 'float32'])
def test_master_weights_under_auto_follow_what_auto_resolves_to(tmp_path, monkeypatch, resolved):
  """policy='auto' is checked once resolved: it trains with bfloat16 masters where it resolves
  to mixed_bfloat16 (a CPU with AVX512_BF16, a TPU) and is a one-line error elsewhere."""
  from trainer.step import precision

  monkeypatch.setattr(precision, 'resolve', lambda name, float32_xla=False: (resolved, 'test'))
  config = tiny_config(**{'precision.master_weights': 'bfloat16_sr', 'precision.policy': 'auto'})
  if resolved == 'float32':
    with pytest.raises(
      ConfigError,
      match=r"needs config.precision.policy='mixed_bfloat16' "
      r"\(got 'auto', which resolved to 'float32' on this "
      r"machine\); or set master_weights='float32'\.$",
    ):
      TinyTrainer(config, str(tmp_path / 'work'))
    return
  trainer = TinyTrainer(config, str(tmp_path / 'work'))
  assert trainer.model.layers[0].kernel.dtype == 'bfloat16'


def test_master_weights_needs_the_default_optimizer(tmp_path):

  class Custom(TinyTrainer):
    def build_optimizer(self, learning_rate):
      return keras.optimizers.Adam(learning_rate)

  with pytest.raises(ConfigError, match='build_optimizer returned Adam'):
    Custom(tiny_config(**runs.overrides('bfloat16_sr')), str(tmp_path))


@pytest.mark.slow
def test_mirrored_skip_and_resume(tmp_path):
  """Two logical CPU devices (a subprocess): skips bit-identical, replicas identical, resume
  bit-identical, for bfloat16_sr, bfloat16_kahan and state_bits=8."""
  env = {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2', 'PYTHONPATH': ROOT}
  proc = subprocess.run(
    [sys.executable, os.path.join(ROOT, 'tests', 'low_precision_runs.py'), str(tmp_path)],
    env=env,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=1200,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  results = json.loads((tmp_path / 'results.json').read_text())
  for setting, r in results.items():
    assert r['replicas'] == 2, setting
    assert r['skipped'] == 1, setting
    assert r['changed_by_skip'] == [], setting
    assert r['changed_by_next'], setting
    assert r['replicas_differ'] == [], setting
    assert r['resume_differs'] == [], setting


@pytest.mark.parametrize('name', ['adam', 'adamw', 'sgd'])
def test_built_from_the_config_with_its_hyperparameters(name):
  from trainer import config as config_lib
  from trainer.optim import optimizers

  config = config_lib.validate(
    tiny_config(
      **runs.overrides(
        'bfloat16_kahan',
        name,
        **{
          'optimizer.beta_1': 0.8,
          'optimizer.beta_2': 0.99,
          'optimizer.epsilon': 1e-6,
          'optimizer.momentum': 0.5,
        },
      )
    )
  )
  optimizer = optimizers.build(config.optimizer, 1e-3, master_weights='bfloat16_kahan')
  assert isinstance(optimizer, low_precision.CLASSES[name])
  assert optimizer.master_weights == 'bfloat16_kahan'
  assert optimizer.weight_decay == pytest.approx(0.01)
  if name == 'sgd':
    assert optimizer.momentum == 0.5
  else:
    assert (optimizer.beta_1, optimizer.beta_2, optimizer.epsilon) == (0.8, 0.99, 1e-6)


def test_the_numerics_probe_measures_a_conv_model_with_bfloat16_master_weights(tmp_path):
  """Issue 35: with master_weights=bfloat16_sr the probe's float32 reference pass fed float32
  inputs to a Conv2D whose kernel is stored in bfloat16 (Keras autocasts a layer's variables only
  when its policy's compute and variable dtypes differ): 'TypeError: ... kwargs=<class
  'inspect._empty'>', and numerics.every was turned off for the run."""
  from test_contract import FashionTrainer, config
  from trainer.insight import hooks, numerics

  trainer = FashionTrainer(
    config(**{'precision.policy': 'mixed_bfloat16', 'precision.master_weights': 'bfloat16_sr'}),
    str(tmp_path / 'work'),
  )
  conv = trainer.model.layers[0]
  assert conv.kernel.dtype == 'bfloat16'
  stats, overall = numerics.Probe(trainer, None).measure()
  assert any('conv2d' in name for name in stats) and 0 <= overall['grad_zero'] <= 1
  # The reference pass computes in float32 from the stored bfloat16 values.
  x = tf.random.stateless_uniform([2, 28, 28, 1], seed=[0, 1])
  with hooks.float32(conv):
    out = conv(x)
  expected = tf.nn.convolution(x, tf.cast(conv.kernel.value, tf.float32)) + tf.cast(
    conv.bias.value, tf.float32
  )
  assert out.dtype == tf.float32
  np.testing.assert_allclose(out.numpy(), tf.nn.relu(expected).numpy(), rtol=1e-5, atol=1e-6)
