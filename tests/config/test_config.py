"""trainer/config.py: defaults, filling, coercion and errors that name the key."""

import ml_collections
import pytest

from trainer import ConfigError
from trainer import config as config_lib
import models
from benchmarks import overrides


def test_config_file_matches_schema():
  """configs/mnist.py spells out every schema key, with values of the schema's types."""
  flat = config_lib.flatten(config_lib.load_file('configs/mnist.py'))
  assert set(config_lib.SCHEMA) <= set(flat), set(config_lib.SCHEMA) - set(flat)
  validated = config_lib.flatten(config_lib.validate(config_lib.load_file('configs/mnist.py')))
  assert validated == flat


def test_config_file_comments_state_the_schemas_exit_statuses():
  """A comment in configs/mnist.py naming an exit status names the one the schema's description
  (the config reference's) states: numerics.divergence_stop's said 2 (bad input) for a stop
  that exits 3 (trainer.errors.DivergenceError)."""
  import re

  checked = 0
  for line in open('configs/mnist.py'):
    stated = re.search(r'config\.([\w.]+) = .*#.*exit status (\d)', line)
    if stated:
      key, status = stated.groups()
      assert f'exit status {status}' in config_lib.SCHEMA[key].help, line
      checked += 1
  assert checked


def test_missing_keys_are_filled():
  config = config_lib.defaults()
  del config.precision['hysteresis']
  assert config_lib.validate(config).precision.hysteresis == 1


@pytest.mark.parametrize(
  'key, value, words',
  [
    ('train.batch_size', -1, 'config.train.batch_size=-1: must be > 0'),
    ('train.steps', -5, 'config.train.steps=-5: must be >= 0'),
    ('precision.policy', 'fp8', "config.precision.policy='fp8'"),
    ('precision.loss_scale', 'nan', 'config.precision.loss_scale'),
    ('precision.loss_scale', '0', 'config.precision.loss_scale'),
    ('precision.loss_scale', 'big', 'config.precision.loss_scale'),
    ('precision.growth_interval', 0, 'config.precision.growth_interval=0: must be >= 1'),
    ('precision.min_scale', 1e9, 'config.precision.min_scale'),
    ('train.log_every', 150, 'config.train.log_every=150 must be a multiple'),
    ('train.batch_size', 'big', 'config.train.batch_size must be int'),
    ('debug.inject_nonfinite_steps', '3,x', 'config.debug.inject_nonfinite_steps'),
    (
      'train.jit_compile',
      'float32,bf16',
      "config.train.jit_compile='float32,bf16': must be auto, "
      'true, false or policies from float32, mixed_float16, mixed_bfloat16, comma-separated (not '
      "'bf16')",
    ),
  ],
)
def test_bad_values_name_the_key(key, value, words):
  raw = config_lib.defaults().to_dict()  # a plain dict: ConfigDict would refuse a wrong type
  config_lib.set_dotted(raw, key, value)
  with pytest.raises(ConfigError) as info:
    config_lib.validate(ml_collections.ConfigDict(raw))
  assert words in str(info.value)


def test_diff_names_changed_keys():
  a = config_lib.defaults().to_dict()
  b = config_lib.defaults()
  b.train.steps = 7
  assert config_lib.diff(a, b.to_dict()) == ['train.steps']


def test_model_section_fills_defaults_and_names_an_unknown_key():
  config = config_lib.defaults()
  config.model_config = ml_collections.ConfigDict({'d_model': 64})
  m = models.model_section(config, {'d_model': 128, 'layers': 2}, 'the test model')
  assert m.to_dict() == {'d_model': 64, 'layers': 2}
  config.model_config.dmodel = 32
  with pytest.raises(
    ConfigError,
    match=r'^config\.model_config\.dmodel is not a key of the test '
    r'model; known: d_model, layers$',
  ):
    models.model_section(config, {'d_model': 128, 'layers': 2}, 'the test model')


def test_benchmark_overrides_convert_to_the_current_type():
  config = config_lib.defaults()
  overrides.apply(
    config,
    [
      'train.remat=false',
      'train.steps=7',
      'optimizer.learning_rate=0.5',
      'train.jit_compile=true',
      'model_config.attention=chunked',
    ],
  )
  assert config.train.remat is False  # bool('false') would be True
  assert config.train.steps == 7 and config.optimizer.learning_rate == 0.5
  assert config.train.jit_compile == 'true' and config.model_config.attention == 'chunked'
  overrides.apply(config, ['train.remat=1'])
  assert config.train.remat is True


@pytest.mark.parametrize(
  'setting, policy, on',
  [
    ('true', 'mixed_bfloat16', True),
    ('false', 'float32', False),
    ('float32,mixed_float16', 'float32', True),
    ('float32,mixed_float16', 'mixed_float16', True),
    ('float32,mixed_float16', 'mixed_bfloat16', False),
    ('mixed_bfloat16', 'float32', False),
  ],
)
def test_jit_compile_may_name_the_policies_it_is_on_under(setting, policy, on):
  from trainer.run import build

  config_lib.validate(
    ml_collections.ConfigDict(
      {**config_lib.defaults().to_dict(), 'train': {'jit_compile': setting}}
    )
  )  # valid
  assert build.jit(setting, policy) is on


def _schema_default(monkeypatch, name, default):
  monkeypatch.setitem(config_lib.SCHEMA, name, config_lib.SCHEMA[name]._replace(default=default))


def test_a_hand_built_section_reads_the_schema_default(monkeypatch):
  """The code that tolerates a config section without a key (one built by hand, not by
  validate) takes the default from SCHEMA, the one table of defaults: changed there, it changes
  everywhere."""
  from trainer.nn import remat
  from trainer.optim import optimizers
  from trainer.step import loss_scale

  empty = ml_collections.ConfigDict()
  assert config_lib.value(ml_collections.ConfigDict({'beta_1': 0.8}), 'optimizer.beta_1') == 0.8
  assert config_lib.value(empty, 'optimizer.beta_1') == 0.9
  _schema_default(monkeypatch, 'optimizer.beta_1', 0.5)
  _schema_default(monkeypatch, 'optimizer.epsilon', 1e-3)
  assert optimizers._moments(empty) == {'beta_1': 0.5, 'beta_2': 0.999, 'epsilon': 1e-3}
  _schema_default(monkeypatch, 'train.remat', True)
  assert remat.enabled(ml_collections.ConfigDict({'train': {}}))
  precision = config_lib.defaults().precision
  del precision['hysteresis']
  _schema_default(monkeypatch, 'precision.hysteresis', 4)
  assert loss_scale.LossScaler.from_config(precision, 'mixed_float16').hysteresis == 4


def _precision(policy, loss_scale):
  config = config_lib.defaults()
  config.precision.policy, config.precision.loss_scale = policy, loss_scale
  return config_lib.validate(config)


@pytest.mark.parametrize(
  'policy, loss_scale, resolved, says',
  [
    ('float32', 'dynamic', 'float32', "config.precision.policy='float32'"),
    ('auto', 'dynamic', 'float32', "'auto' resolved to float32 on this machine"),
    ('auto', 'auto', 'float32', None),  # auto is none under float32: silent
    ('float32', 'none', 'float32', None),
    ('mixed_float16', 'dynamic', 'mixed_float16', None),
    ('auto', 'dynamic', 'mixed_float16', None),
  ],
)
def test_dynamic_loss_scale_under_float32_is_a_note(policy, loss_scale, resolved, says):
  note = config_lib.loss_scale_note(_precision(policy, loss_scale), resolved)
  if says is None:
    assert note is None
    return
  assert note.startswith("config.precision.loss_scale='dynamic'") and says in note, note
  assert '\n' not in note


def test_training_warns_once_about_dynamic_loss_scale_under_float32(tmp_path, caplog):
  """The note is about a cost per trained step: logged when training starts, not by the build
  (an eval, an export or sampling from the run folder trains no step)."""
  from tiny import TinyTrainer, tiny_config

  def warned(loss_scale):
    overrides = {'precision.policy': 'float32', 'precision.loss_scale': loss_scale}
    caplog.clear()
    with caplog.at_level('WARNING'):
      trainer = TinyTrainer(
        tiny_config(**overrides, **{'train.steps': 2}), str(tmp_path / loss_scale)
      )
      built = [r.getMessage() for r in caplog.records if 'loss_scale' in r.getMessage()]
      trainer.train()
    trained = [r.getMessage() for r in caplog.records if 'loss_scale' in r.getMessage()]
    return built, trained

  built, (line,) = warned('dynamic')
  assert built == []
  assert "config.precision.loss_scale='dynamic' does nothing useful under float32" in line
  assert warned('auto') == ([], [])
