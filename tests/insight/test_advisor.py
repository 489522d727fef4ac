"""trainer/insight/advisor.py and precision.float32_layers: the advisor names the layers that
overflow float16, and with its suggestion the same model trains finite under mixed_float16, as
float32."""

import os
import subprocess
import sys

import keras
import pytest

import models
from trainer.insight import advisor
from trainer import config as config_lib
from trainer.step import precision
from trainer.errors import CollapseError, ConfigError

from conftest import ROOT

DATA = os.path.join(ROOT, '..', 'shared', 'data', 'mnist')


@pytest.fixture
def mixed_float16():
  keras.mixed_precision.set_global_policy('mixed_float16')
  yield
  keras.mixed_precision.set_global_policy('float32')


class Block(keras.layers.Layer):
  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.inner = keras.layers.Dense(4, name='inner')

  def call(self, x):
    return self.inner(x)


def _model():
  return keras.Sequential(
    [
      keras.Input((8,)),
      keras.layers.Dense(8, name='a'),
      keras.layers.Dense(8, name='keep'),
      Block(name='block'),
      keras.layers.Dense(3, dtype='float32', name='logits'),
    ],
    name='m',
  )


def _compute_dtypes(float32_layers: str) -> dict[str, str]:
  model = precision.build_model(_model, float32_layers)
  return {
    l.name: l.compute_dtype
    for l in model._flatten_layers(include_self=False)
    if not isinstance(l, keras.layers.InputLayer)
  }


def test_float32_layers_sets_the_named_layers_and_their_insides(mixed_float16):
  assert _compute_dtypes('keep, block') == {
    'a': 'float16',
    'keep': 'float32',
    'block': 'float32',
    'inner': 'float32',
    'logits': 'float32',
  }
  model = precision.build_model(_model, 'keep, block')
  out = model.layers[1](keras.ops.ones((2, 8)))
  assert keras.backend.standardize_dtype(out.dtype) == 'float32'  # computes in float32
  assert keras.config.dtype_policy().name == 'mixed_float16'  # the scope restored the policy
  plain = _model()  # built outside the scope: every layer follows the global policy
  assert plain.layers[1].compute_dtype == 'float16'


def test_float32_layers_takes_a_path_as_the_numerics_line_prints_it(mixed_float16):
  """The numerics line names layers by path ('m/keep'); float32_layers refused it."""
  assert _compute_dtypes('m/keep, m/block/inner') == {
    'a': 'float16',
    'keep': 'float32',
    'block': 'float16',
    'inner': 'float32',
    'logits': 'float32',
  }


def test_float32_layers_unknown_name_is_a_config_error(mixed_float16):
  with pytest.raises(ConfigError, match=r'config.precision.float32_layers=.*no layer named nope'):
    precision.build_model(_model, 'keep,nope')


def _demo_config(**overrides):
  config = config_lib.load_file(os.path.join(ROOT, 'configs', 'overflow_demo.py'))
  config.data.dir = DATA
  config.train.steps = 200
  config.train.steps_per_loop = 50
  config.train.log_every = 50
  config.train.checkpoint_every = 200
  for key, value in overrides.items():
    config_lib.set_dotted(config, key, value)
  return config


def test_advisor_names_the_culprit_and_its_suggestion_trains_like_float32(tmp_path):
  trainer_class = models.get_trainer_class('overflow_demo')
  advice = advisor.advise(trainer_class, _demo_config(), str(tmp_path / 'advise'), steps=3)
  # By path (trainer/nn/paths.py), as a run of the config names them.
  assert advice.suggested == ['overflow_forward/culprit', 'overflow_forward/norm']
  culprit = next(s for s in advice.layers if s.name == 'overflow_forward/culprit')
  assert culprit.max_out > 65504 and culprit.headroom(culprit.max_out) < 0
  assert culprit.nonfinite > 0  # the float16 run overflowed where float32 did not
  text = advice.markdown()
  assert f'--config.precision.float32_layers={advice.suggested_value}' in text

  # Without the suggestion every mixed_float16 step is skipped and the guard stops the run.
  with pytest.raises(CollapseError):
    trainer_class(
      _demo_config(**{'precision.max_consecutive_skips': 20}), str(tmp_path / 'f16')
    ).train()
  fixed = trainer_class(
    _demo_config(**{'precision.float32_layers': advice.suggested_value}),
    str(tmp_path / 'f16_fixed'),
  )
  fixed_metrics = fixed.train()
  assert int(fixed.train_step.skipped_steps.numpy()) == 0
  reference = trainer_class(
    _demo_config(**{'precision.policy': 'float32'}), str(tmp_path / 'f32')
  ).train()
  print(
    'accuracy: float32',
    reference['accuracy'],
    'mixed_float16 with float32_layers',
    fixed_metrics['accuracy'],
  )
  assert reference['accuracy'] > 0.7  # it learns at all
  assert abs(fixed_metrics['accuracy'] - reference['accuracy']) <= 0.005


def test_launch_advise_writes_advice_md(tmp_path):
  workdir = tmp_path / 'run'
  result = subprocess.run(
    [
      sys.executable,
      'launch.py',
      '--config=configs/overflow_demo.py',
      '--advise',
      '--advise_steps=2',
      f'--config.data.dir={DATA}',
      f'--workdir={workdir}',
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'},
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert (
    "precision.float32_layers = 'overflow_forward/culprit,overflow_forward/norm'" in result.stdout
  )
  assert (workdir / 'advice.md').read_text() in result.stdout


def test_non_finite_gradients_never_fit(tmp_path):
  """The backward-overflow demo: forward headroom names no layer, but the amplifier's input
  gradient at loss scale 32768 is beyond float16's range (a plain float32 tape says so), so
  the advice must not say every layer fits."""
  import numpy as np
  import tensorflow as tf

  trainer_class = models.get_trainer_class('overflow_demo')
  config = _demo_config(**{'model_config.overflow': 'backward'})
  advice = advisor.advise(trainer_class, config, str(tmp_path / 'advise'), steps=2)
  reference = trainer_class(
    _demo_config(**{'model_config.overflow': 'backward', 'precision.policy': 'float32'}),
    str(tmp_path / 'f32'),
  )
  amplifier = reference.model.get_layer('amplifier')
  batch = next(iter(reference.datasets.train))
  with tf.GradientTape() as tape:
    inputs = []
    original = amplifier.call

    def call(x, *args, **kwargs):
      tape.watch(x)
      inputs.append(x)
      return original(x, *args, **kwargs)

    object.__setattr__(amplifier, 'call', call)
    per_example, _ = reference.compute_loss(batch, training=True)
    loss = tf.reduce_mean(per_example) * 32768.0
  amplifier.__dict__.pop('call')
  assert np.abs(tape.gradient(loss, inputs[0]).numpy()).max() > 65504  # float16 cannot hold it
  assert advice.nonfinite_layers, [(s.name, s.grad_nonfinite) for s in advice.layers]
  text = advice.markdown()
  assert '(every layer fits' not in text and 'not every layer fits mixed_float16' in text


class ExpGate(keras.layers.Layer):
  """h * 16 * softmax(2h) with the softmax written as exp / sum: exp(2h) overflows float16 once
  h > 5.5, while the output stays below 16 max |h|."""

  def call(self, h):
    e = keras.ops.exp(2.0 * h)
    return h * 16.0 * (e / keras.ops.sum(e, axis=-1, keepdims=True))


class Holder(keras.layers.Layer):
  """A layer that only calls the gate inside it."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.gate = ExpGate(name='gate')

  def call(self, h):
    return self.gate(h)


@pytest.mark.parametrize('nested', [False, True])
def test_an_overflow_inside_a_layer_is_suggested_though_its_output_fits(tmp_path, nested):
  """The gate's output has headroom in float32, so headroom alone would suggest nothing; its
  float16 output is non-finite from finite inputs where float32's is finite, so it is named
  and suggested (not the layer holding it, whose output is non-finite only through the gate). A
  non-finite share below 0.05 % shows as '< 0.1 %', not '0.0 %'."""
  import numpy as np
  from tiny import TinyTrainer, tiny_config

  class GateTrainer(TinyTrainer):
    def build_model(self):
      return keras.Sequential(
        [
          keras.Input((8,)),
          keras.layers.Dense(
            16, name='proj', kernel_initializer=keras.initializers.RandomNormal(stddev=2.0, seed=0)
          ),
          Holder(name='holder') if nested else ExpGate(name='gate'),
          keras.layers.Dense(4, dtype='float32', name='logits'),
        ],
        name='gated',
      )

  advice = advisor.advise(
    GateTrainer,
    tiny_config(**{'precision.policy': 'mixed_float16'}),
    str(tmp_path / 'advise'),
    steps=2,
  )
  path = 'gated/holder/gate' if nested else 'gated/gate'
  gate = next(s for s in advice.layers if s.name == path)
  assert gate.headroom(gate.max_out) > advisor.HEADROOM_BITS  # its output fits float16
  assert gate.overflowed > 0 and gate.nonfinite > 0
  assert advice.suggested == [path], advice.markdown()
  text = advice.markdown()
  assert f'Overflowed inside: {path}' in text
  share = 100.0 * gate.nonfinite / gate.outputs
  row = next(line for line in text.splitlines() if line.startswith(f'| {path}'))
  assert ('< 0.1 %' if share < 0.05 else f'{share:.1f} %') in row
  assert np.isfinite(gate.max_out)


def test_launch_advise_validates_its_suggestion(tmp_path):
  workdir = tmp_path / 'run'
  result = subprocess.run(
    [
      sys.executable,
      'launch.py',
      '--config=configs/overflow_demo.py',
      '--advise',
      '--advise_steps=2',
      '--advise_validate_steps=20',
      f'--config.data.dir={DATA}',
      f'--workdir={workdir}',
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    env={**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'},
  )
  assert result.returncode == 0, result.stderr[-2000:]
  out = result.stdout
  assert "- as configured (float32_layers=''): skipped 20 of 20 steps" in out, out[-1500:]
  assert (
    "- with the suggestion (float32_layers='overflow_forward/culprit,overflow_forward/norm'): "
    'skipped 0 of 20 steps' in out
  )
  assert (workdir / 'advice.md').read_text() in out


@pytest.mark.parametrize(
  'mode, advice',
  [
    ('dynamic', 'lower precision.initial_scale, or replay'),
    ('static', 'lower precision.loss_scale (static), or replay'),
    ('none', 'the loss is not scaled, so they overflow by themselves: replay'),
  ],
)
def test_a_backward_overflow_names_the_key_that_sets_the_scale(mode, advice):
  """Under a static scale, or none, it said 'lower precision.initial_scale', which only the
  dynamic scaler reads."""
  layer = advisor.LayerStats(
    'dense', 'Dense', 'float16', max_out=1.0, max_in=1.0, grad_nonfinite=3, grad_total=10
  )
  text = advisor.Advice('mixed_float16', 4, 1e6, [layer], [], scale_mode=mode).markdown()
  assert f'a backward overflow: {advice}' in text
