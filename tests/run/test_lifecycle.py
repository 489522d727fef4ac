"""Eval-only, export, init_from and the profiler, on short real MNIST MLP runs."""

import glob
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import models
import tiny
from configs import mnist_mlp
from trainer.run import lifecycle
from trainer import steps_text
from trainer.errors import ConfigError, UserError

from conftest import ROOT

DATA = os.path.join(ROOT, '..', 'shared', 'data', 'mnist')


def _config(policy='float32', steps=100, **train):
  config = mnist_mlp.get_config()
  config.data.dir = DATA
  config.train.update(
    {'steps': steps, 'steps_per_loop': 50, 'log_every': 50, 'checkpoint_every': 100, **train}
  )
  config.precision.policy = policy
  return config


def _trainer(config, workdir):
  return models.get_trainer_class(config.model)(config, str(workdir))


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """(workdir, final eval metrics) of 100 MLP steps in mixed_bfloat16."""
  workdir = tmp_path_factory.mktemp('life') / 'run'
  metrics = _trainer(_config('mixed_bfloat16'), workdir).train()
  return workdir, metrics


@pytest.fixture(autouse=True)
def reset_policy():
  yield
  keras.mixed_precision.set_global_policy('float32')


def test_eval_mode_reproduces_the_final_eval(trained):
  workdir, metrics = trained
  again = lifecycle.evaluate_checkpoint(_trainer(_config('mixed_bfloat16'), workdir))
  assert again == pytest.approx(metrics, rel=1e-6)


def test_eval_under_another_config_than_the_run_says_so(trained, caplog):
  """It switched policy silently (the config file's, not the run's); a warning names it."""
  workdir, _ = trained
  lifecycle.evaluate_checkpoint(_trainer(_config('float32'), workdir))
  assert (
    "was trained with another config (config.precision.policy: 'mixed_bfloat16' -> "
    "'float32'); this config is used"
  ) in caplog.text
  caplog.clear()  # an eval-only override of what is not computed: no warning
  lifecycle.evaluate_checkpoint(_trainer(_config('mixed_bfloat16', batch_size=64), workdir))
  assert 'another config' not in caplog.text


def _tiny(policy, workdir):
  config = tiny.tiny_config(**{'precision.policy': policy, 'train.steps': 5})
  return tiny.TinyTrainer(config, str(workdir))


def _warned(caplog, evaluate) -> list[str]:
  caplog.clear()
  with caplog.at_level('WARNING'):
    evaluate()
  return [r.getMessage() for r in caplog.records if 'trained' in r.getMessage()]


def test_eval_warning_states_the_policy_that_trained_and_the_one_that_runs(tmp_path, caplog):
  """Under 'auto' the warning named the config's words only ('auto' -> 'float32'), not what ran
  in training nor what runs here; a run folder now records the policy it trained in
  (checkpoints/policy.json)."""
  from trainer.step import precision

  here = precision.resolve('auto')[0]
  other = 'mixed_bfloat16' if here == 'float32' else 'float32'
  workdir = tmp_path / 'w'
  _tiny('auto', workdir).train()
  record = json.loads((workdir / 'checkpoints' / 'policy.json').read_text())
  assert record == {'policy': here, 'config': 'auto'}
  (line,) = _warned(caplog, lambda: lifecycle.evaluate_checkpoint(_tiny(other, workdir)))
  assert (
    f"(config.precision.policy: 'auto' -> '{other}'); this config is used: the run trained in "
    f"{here} ('auto' on its machine), this runs in {other}"
  ) in line
  # The policy 'auto' trained in, spelled out, computes what the run computed: no warning.
  assert _warned(caplog, lambda: lifecycle.evaluate_checkpoint(_tiny(here, workdir))) == []
  # Trained where 'auto' resolved otherwise (policy.json as that machine wrote it): the same
  # config computes in another policy here, which the line says.
  record['policy'] = other
  (workdir / 'checkpoints' / 'policy.json').write_text(json.dumps(record))
  (line,) = _warned(caplog, lambda: lifecycle.evaluate_checkpoint(_tiny('auto', workdir)))
  assert (
    f"trained in {other} ('auto' on its machine), this runs in {here} ('auto' on this machine)"
  ) in line
  assert f'--config.precision.policy={other}' in line and '\n' not in line


@pytest.mark.parametrize(
  'trained, trained_setting, now, setting, says',
  [
    ('mixed_bfloat16', 'mixed_bfloat16', 'float32', 'float32', ''),  # the change names both
    ('float32', 'auto', 'float32', 'float32', ''),  # the same policy
    (None, 'auto', 'float32', 'auto', ''),  # auto both times, unknown then: nothing to say
    (
      None,
      'auto',
      'float32',
      'float32',
      "trained in what 'auto' resolved to on its machine (not recorded), this runs in float32",
    ),
    (
      'mixed_bfloat16',
      'mixed_bfloat16',
      'float32',
      'auto',
      "trained in mixed_bfloat16, this runs in float32 ('auto' on this machine)",
    ),
  ],
)
def test_policy_note(trained, trained_setting, now, setting, says):
  from trainer.run.config_record import policy_note

  assert policy_note(trained, trained_setting, now, setting) == says


def test_eval_reads_a_run_whose_config_record_is_damaged(tmp_path):
  workdir = tmp_path / 'run'
  metrics = _trainer(_config('float32', steps=50, checkpoint_every=50), workdir).train()
  (workdir / 'config.json').write_text('{garbled')
  again = lifecycle.evaluate_checkpoint(_trainer(_config('float32', steps=50), workdir))
  assert again == pytest.approx(metrics, rel=1e-6)


def test_eval_without_checkpoint_is_a_user_error(tmp_path):
  with pytest.raises(UserError, match='no checkpoint'):
    lifecycle.evaluate_checkpoint(_trainer(_config(), tmp_path))


def _export_and_compare(workdir, policy, tmp_path):
  trainer = _trainer(_config(policy), workdir)
  paths = lifecycle.export(trainer, str(tmp_path / 'export'))
  images, _ = next(iter(trainer.datasets.eval))
  expected = trainer.model(images, training=False).numpy()
  loaded = tf.saved_model.load(paths['saved_model'])  # keep a reference while serving
  served = loaded.serve(images).numpy()
  reloaded = keras.models.load_model(paths['keras'])
  assert reloaded.layers[-1].dtype_policy.name == 'float32'
  assert reloaded.layers[1].dtype_policy.name == policy
  return expected, served, reloaded(images).numpy()


def test_export_outputs_match_the_trained_model_float32(tmp_path):
  workdir = tmp_path / 'run'
  _trainer(_config('float32', steps=50, checkpoint_every=50), workdir).train()
  expected, served, reloaded = _export_and_compare(workdir, 'float32', tmp_path)
  np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(reloaded, expected, rtol=1e-5, atol=1e-5)


def test_export_outputs_match_the_trained_model_bfloat16(trained, tmp_path):
  """The SavedModel's graph may fuse ops differently from eager execution, so bfloat16 results
  differ by rounding: within 2**-6 of the largest logit (bfloat16 keeps 8 significant bits)."""
  workdir, _ = trained
  expected, served, reloaded = _export_and_compare(workdir, 'mixed_bfloat16', tmp_path)
  tolerance = 2**-6 * np.abs(expected).max()
  for outputs in (served, reloaded):
    assert np.abs(outputs - expected).max() <= tolerance
    assert (outputs.argmax(-1) == expected.argmax(-1)).mean() >= 0.98


def test_init_from_loads_model_weights_but_not_the_step(trained, tmp_path):
  source, metrics = trained
  trainer = _trainer(_config('mixed_bfloat16', init_from=str(source)), tmp_path / 'new')
  assert trainer.runner.restore() == 0
  assert trainer.evaluate() == pytest.approx(metrics, rel=1e-6)
  with pytest.raises(ConfigError, match='config.train.init_from'):
    _trainer(_config(init_from=str(tmp_path / 'nothing')), tmp_path / 'other').runner.restore()


def test_profile_steps_write_a_trace(tmp_path):
  _trainer(_config(steps=100, profile_steps='50,100'), tmp_path).train()
  traces = glob.glob(str(tmp_path / 'tensorboard' / 'plugins' / 'profile' / '*' / '*.xplane.pb'))
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 0


@pytest.mark.parametrize('text', ['5', '10,5', 'a,b', '1,2,3'])
def test_profile_steps_errors_name_the_key(text):
  with pytest.raises(ConfigError, match='config.train.profile_steps'):
    steps_text.profile_steps(text)
  assert steps_text.profile_steps('') is None
  assert steps_text.profile_steps('3, 9') == (3, 9)


def test_launch_modes(trained):
  workdir, metrics = trained
  base = [
    sys.executable,
    'launch.py',
    '--config=configs/mnist_mlp.py',
    f'--config.data.dir={DATA}',
    '--config.precision.policy=mixed_bfloat16',
    '--config.train.steps=100',
    '--config.train.steps_per_loop=50',
    '--config.train.log_every=50',
    '--config.train.checkpoint_every=100',
  ]
  env = {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'}
  run = lambda *a: subprocess.run(
    [*base, *a], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
  )
  result = run(f'--workdir={workdir}', '--mode=eval')
  assert result.returncode == 0, result.stderr[-2000:]
  assert f'accuracy: {metrics["accuracy"]:.4f}' in result.stdout
  result = run('--mode=export')
  assert result.returncode == 2 and 'needs --workdir' in result.stderr


class TokensAndScale(keras.Model):
  """A subclassed model of two inputs: integer token ids and a float scale per example."""

  def __init__(self):
    super().__init__()
    self.embed = keras.layers.Embedding(8, 4)
    self.out = keras.layers.Dense(4, dtype='float32')

  def call(self, tokens, scale, training=False):
    return self.out(tf.reduce_mean(self.embed(tokens), axis=1) * scale[:, None])


class _SubclassedTrainer(tiny.TinyTrainer):
  def build_model(self):
    return TokensAndScale()

  def compute_loss(self, batch, *, training):
    x, y = batch
    tokens = tf.cast(tf.abs(x[:, :3]) * 3, tf.int32) % 8
    logits = self.model(tokens, x[:, 3], training=training)
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True), {}


@pytest.mark.parametrize('policy', ['float32', 'mixed_bfloat16'])
def test_a_subclassed_models_export_takes_its_integer_inputs_and_float32(policy, tmp_path, caplog):
  """Keras's own signature for a subclassed model gives every input the compute dtype (bfloat16
  token ids under mixed_bfloat16, which no int32 binds to; float32 ids under float32). Its
  __init__ takes no **kwargs, so model.keras would not load back: a warning says so."""
  config = tiny.tiny_config(**{'train.steps': 5, 'precision.policy': policy})
  trainer = _SubclassedTrainer(config, str(tmp_path / 'run'))
  trainer.train()
  loaded = tf.saved_model.load(lifecycle.export(trainer)['saved_model'])
  specs = loaded.signatures['serve'].structured_input_signature[1]
  assert [(s.dtype, s.shape.as_list()) for _, s in sorted(specs.items())] == [
    (tf.int32, [None, 3]),
    (tf.float32, [None]),
  ]
  tokens, scale = tf.constant([[1, 2, 3], [7, 0, 5]]), tf.constant([0.5, 2.0])
  np.testing.assert_allclose(
    loaded.serve(tokens, scale).numpy(), trainer.model(tokens, scale).numpy(), rtol=1e-6
  )
  assert trainer.model.call.__func__ is TokensAndScale.call  # the recording is gone
  assert (
    'model.keras will not load back: TokensAndScale.__init__ takes no trainable, dtype '
    '(no **kwargs)'
  ) in caplog.text


class Masked(keras.Model):
  """Its inputs: x, and a mask given by keyword; `units` is an __init__ argument that get_config
  does not return."""

  def __init__(self, units, **kwargs):
    super().__init__(**kwargs)
    self.out = keras.layers.Dense(units, dtype='float32')

  def call(self, x, mask=None, training=False):
    return self.out(x if mask is None else x * tf.cast(mask, x.dtype)[:, :, None])

  def get_config(self):
    return super().get_config()  # forgets units


class NoConfig(Masked):
  get_config = keras.Model.get_config  # Keras's: refuses a positional __init__ argument


class KeywordOnly(Masked):
  def call(self, x, *, mask, training=False):
    return super().call(x, mask=mask)


def _masked_trainer(model_class):
  class Trainer(tiny.TinyTrainer):
    def build_model(self):
      return model_class(4)

    def compute_loss(self, batch, *, training):
      x, y = batch
      logits = self.model(tf.reshape(x, [-1, 2, 4]), mask=x[:, ::4] > 0, training=training)
      return keras.losses.sparse_categorical_crossentropy(
        y, tf.reduce_mean(logits, 1), from_logits=True
      ), {}

  return Trainer


@pytest.mark.parametrize('model_class', [Masked, KeywordOnly])
def test_export_serves_a_mask_given_by_keyword(model_class, tmp_path, caplog):
  """A mask passed by keyword was left out of the signature (serving ran unmasked); a
  keyword-only input failed inside Keras, which calls the model with positional inputs."""
  config = tiny.tiny_config(**{'train.steps': 5})
  trainer = _masked_trainer(model_class)(config, str(tmp_path / 'run'))
  trainer.train()
  loaded = tf.saved_model.load(lifecycle.export(trainer)['saved_model'])
  specs = loaded.signatures['serve'].structured_input_signature[1]
  assert [(k, s.dtype, s.shape.as_list()) for k, s in sorted(specs.items())] == [
    ('args_0', tf.float32, [None, 2, 4]),
    ('args_1', tf.bool, [None, 2]),
  ]
  x, mask = tf.ones([1, 2, 4]), tf.constant([[True, False]])
  np.testing.assert_allclose(loaded.serve(x, mask), trainer.model(x, mask=mask), rtol=1e-6)
  assert not np.allclose(loaded.serve(x, mask), trainer.model(x, mask=~mask))  # mask matters
  assert (
    f'model.keras will not load back: {model_class.__name__}.get_config() returns no '
    'units, which __init__ needs'
  ) in caplog.text


def test_a_model_keras_cannot_write_leaves_the_saved_model(tmp_path, caplog):
  trainer = _masked_trainer(NoConfig)(tiny.tiny_config(**{'train.steps': 5}), str(tmp_path))
  trainer.train()
  assert set(lifecycle.export(trainer)) == {'saved_model'}  # Keras's save failed: a warning
  assert 'model.keras was not written: NotImplementedError: Object NoConfig' in caplog.text


class Pair(keras.Model):
  """Two inputs as *xs, dropout on by default, and a None beside the logits (a cache slot)."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.drop = keras.layers.Dropout(0.5)
    self.out = keras.layers.Dense(4, dtype='float32')

  def call(self, *xs, training=True):
    return self.out(self.drop(xs[0] * xs[1], training=training)), None


def test_export_serves_in_inference_mode_several_inputs_and_no_none(tmp_path):
  """Three ways the SavedModel failed: Keras's default signature of one input (for *xs), a
  None output, and the model served with its own training default (dropout on)."""

  class Trainer(tiny.TinyTrainer):
    def build_model(self):
      return Pair()

    def compute_loss(self, batch, *, training):
      x, y = batch
      logits, _ = self.model(x, x, training=training)
      return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True), {}

  trainer = Trainer(tiny.tiny_config(**{'train.steps': 5}), str(tmp_path / 'run'))
  trainer.train()
  loaded = tf.saved_model.load(lifecycle.export(trainer)['saved_model'])
  x = tf.random.normal([3, 8], seed=1)
  expected = trainer.model(x, x, training=False)[0]
  np.testing.assert_allclose(loaded.serve(x, x), expected, rtol=1e-6)
  np.testing.assert_allclose(loaded.serve(x, x), expected, rtol=1e-6)  # no dropout draws
