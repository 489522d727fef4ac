"""Bad config values and keys: each is one ConfigError line naming the key (trainer.config.validate,
in-process), and through launch.py one line, exit 2, no workdir. Covers non-finite learning rate,
clip norm and weight decay, momentum outside [0, 1), seeds outside [0, 2**32), integers beyond
int64, misspelled keys in a config file (with a did-you-mean), and a get_config() returning a
dict."""

import os
import subprocess
import sys

import ml_collections
import pytest

from trainer import config as config_lib
from trainer.errors import ConfigError
from trainer.launch import config_errors

from conftest import ROOT

MNIST_DIR = os.path.join(ROOT, '..', 'shared', 'data', 'mnist')


def invalid(key, value):
  values = config_lib.defaults().to_dict()  # a plain dict, so any type can go in
  config_lib.set_dotted(values, key, value)
  with pytest.raises(ConfigError) as info:
    config_lib.validate(ml_collections.ConfigDict(values))
  message = str(info.value)
  assert message and '\n' not in message
  assert f'config.{key}' in message
  return message


def valid(key, value):
  config = config_lib.defaults()
  config_lib.set_dotted(config, key, value)
  return config_lib.validate(config)


@pytest.mark.parametrize(
  'key', ['optimizer.learning_rate', 'optimizer.clip_norm', 'optimizer.weight_decay']
)
@pytest.mark.parametrize('value', [float('inf'), float('nan'), float('-inf')])
def test_non_finite_optimizer_values(key, value):
  message = invalid(key, value)
  assert 'finite' in message or 'must be' in message


def test_clip_norm_zero_still_means_off():
  assert valid('optimizer.clip_norm', 0.0).optimizer.clip_norm == 0.0


@pytest.mark.parametrize('value', [1.0, 1.5, -0.1])
def test_momentum_outside_zero_one(value):
  assert '[0, 1)' in invalid('optimizer.momentum', value)


@pytest.mark.parametrize('value', [0.0, 0.99])
def test_momentum_inside_zero_one(value):
  assert valid('optimizer.momentum', value).optimizer.momentum == value


@pytest.mark.parametrize('value', [-1, 2**32])
def test_seed_outside_32_bits(value):
  assert '2**32' in invalid('seed', value)


def test_largest_seed_is_fine():
  assert valid('seed', 2**32 - 1).seed == 2**32 - 1


@pytest.mark.parametrize('key', ['train.steps', 'train.batch_size', 'optimizer.warmup_steps'])
def test_integer_beyond_int64(key):
  assert '64-bit' in invalid(key, 99999999999999999999)


def test_non_finite_scale_setting():
  assert 'finite' in invalid('precision.max_scale', float('inf'))


# ---- keys a config file adds ------------------------------------------------------------------
def config_file(tmp_path, *lines, start='config_lib.defaults()'):
  path = tmp_path / 'my_config.py'
  path.write_text(
    'import ml_collections\nfrom trainer import config as config_lib\n\n\n'
    f'def get_config():\n  config = {start}\n'
    + ''.join(f'  {line}\n' for line in lines)
    + '  return config\n'
  )
  return str(path)


def test_misspelled_key_in_a_config_file(tmp_path):
  config = config_lib.load_file(config_file(tmp_path, 'config.train.batch_sise = 16'))
  with pytest.raises(ConfigError) as info:
    config_lib.validate(config)
  assert str(info.value) == (
    'config.train.batch_sise is not a config key; did you mean config.train.batch_size?'
  )


def test_a_schema_key_given_without_its_section_is_named(tmp_path):
  """config.learning_rate = 0.1 at the top level was taken as the model's own key and the run
  trained at the default rate; it is the optimizer's key without its section."""
  config = config_lib.load_file(config_file(tmp_path, 'config.learning_rate = 0.1'))
  with pytest.raises(ConfigError) as info:
    config_lib.validate(config)
  assert str(info.value) == (
    'config.learning_rate is not a config key; did you mean '
    "config.optimizer.learning_rate? (a key of the model's own goes "
    'under config.model_config)'
  )
  # A model's own top-level keys still pass, generic names shared with the schema too.
  config = config_lib.load_file(
    config_file(tmp_path, 'config.vocab_size = 65', 'config.epsilon = 1e-6', 'config.steps = 3')
  )
  validated = config_lib.validate(config)
  assert (validated.vocab_size, validated.epsilon, validated.steps) == (65, 1e-6, 3)


def test_every_unknown_key_is_named_in_one_line(tmp_path):
  config = config_lib.load_file(
    config_file(tmp_path, 'config.train.batch_sise = 16', 'config.optimizer.learning_rat = 0.1')
  )
  with pytest.raises(ConfigError) as info:
    config_lib.validate(config)
  message = str(info.value)
  assert 'did you mean config.train.batch_size?' in message
  assert 'did you mean config.optimizer.learning_rate?' in message and '\n' not in message


def test_unknown_key_in_a_section_without_a_near_match(tmp_path):
  config = config_lib.load_file(config_file(tmp_path, 'config.optimizer.frobnicate = 1'))
  with pytest.raises(ConfigError) as info:
    config_lib.validate(config)
  assert 'config.optimizer.frobnicate is not a config key' in str(info.value)


def test_misspelled_section_in_a_config_file(tmp_path):
  config = config_lib.load_file(
    config_file(tmp_path, 'config.trian = ml_collections.ConfigDict({"steps": 3})')
  )
  with pytest.raises(ConfigError) as info:
    config_lib.validate(config)
  assert 'config.trian.steps' in str(info.value) and 'config.train.steps?' in str(info.value)


def test_model_keys_pass_through(tmp_path):
  config = config_lib.load_file(
    config_file(
      tmp_path,
      'config.model_config = ml_collections.ConfigDict({"d_model": 64})',
      'config.my_flag = True',
    )
  )
  checked = config_lib.validate(config)
  assert checked.model_config.d_model == 64 and checked.my_flag is True
  config_lib.validate(config_lib.load_file(os.path.join(ROOT, 'configs', 'shakespeare.py')))


def test_scalar_key_given_sub_keys():
  config = config_lib.defaults().to_dict()
  config['seed'] = {'value': 3}
  with pytest.raises(ConfigError) as info:
    config_lib.validate(config)
  assert 'config.seed' in str(info.value)


# ---- through launch.py -------------------------------------------------------------------------
def launch(tmp_path, *args, workdir=None):
  """Runs launch.py with `args`; asserts it exited with code 2, one `error:` line last, no
  traceback and nothing written to <tmp_path>/workdir; returns that line."""
  workdir = workdir or str(tmp_path / 'workdir')
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  result = subprocess.run(
    [sys.executable, 'launch.py', *args, f'--workdir={workdir}'],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  lines = [l for l in result.stderr.splitlines() if l.strip()]
  assert result.returncode == 2, result.stderr
  assert 'Traceback' not in result.stderr, result.stderr
  assert lines and lines[-1].startswith('error: '), result.stderr
  assert not os.path.exists(os.path.join(tmp_path, 'workdir'))  # nothing written
  return lines[-1]


def test_launch_config_file_returning_a_dict(tmp_path):
  path = tmp_path / 'dict_config.py'
  path.write_text("def get_config():\n  return {'model': 'mnist_cnn', 'train': {'steps': 2}}\n")
  line = launch(tmp_path, f'--config={path}')
  assert str(path) in line and 'ConfigDict' in line and 'dict' in line


def test_launch_misspelled_key_in_config_file_and_int_beyond_int64(tmp_path):
  path = config_file(
    tmp_path,
    'config.model = "mnist_cnn"',
    f'config.data.dir = {MNIST_DIR!r}',
    'config.train.batch_sise = 16',
  )
  line = launch(tmp_path, f'--config={path}')
  assert 'config.train.batch_sise' in line and 'did you mean config.train.batch_size?' in line
  line = launch(
    tmp_path,
    '--config=configs/mnist.py',
    f'--config.data.dir={MNIST_DIR}',
    '--config.train.steps=99999999999999999999',
  )
  assert 'config.train.steps=99999999999999999999' in line and '64-bit' in line


def test_launch_an_override_of_the_wrong_type_says_what_it_is_not(tmp_path):
  """absl and Python's words were passed on as they came: "('Non-boolean argument to boolean
  flag', 'yes')", "invalid literal for int() with base 10: 'abc'"."""
  line = launch(tmp_path, '--config=configs/mnist.py', '--config.train.deterministic=yes')
  assert line == "error: --config.train.deterministic=yes: 'yes' is not a boolean (True or False)"
  for flag, words, said in (
    ('train.steps=1.5', "invalid literal for int() with base 10: '1.5'", "'1.5' is not an integer"),
    ('seed=x', "invalid literal for int() with base 10: 'x'", "'x' is not an integer"),
    (
      'optimizer.epsilon=1e-7,',
      "could not convert string to float: '1e-7,'",
      "'1e-7,' is not a number",
    ),
  ):
    got = config_errors.flag_error(f'flag --config.{flag}: {words}')
    assert got == f'--config.{flag}: {said}', flag


def test_launch_an_override_in_the_wrong_section_names_the_key():
  """--config.train.learning_rate=0.1 and --config.train.lr=0.1 said 'see the keys in
  configs/...', a file that may list none (built from config_lib.defaults())."""
  known = list(config_lib.flatten(config_lib.defaults()))
  for key in ('train.learning_rate', 'learning_rate', 'optimizer.lr', 'train.lr'):
    assert config_lib.did_you_mean(key, known) == 'optimizer.learning_rate', key
  assert config_lib.did_you_mean('train.frobnicate', known) is None
  assert config_lib.did_you_mean('steps', known) == 'train.steps'
  assert config_lib.did_you_mean('metric', known) is None  # two sections hold one: no guess
