"""trainer/config.py: defaults, filling, coercion and errors that name the key."""
import ml_collections
import pytest

from trainer import ConfigError
from trainer import config as config_lib


def test_config_file_matches_schema():
  """configs/mnist.py spells out every schema key, with values of the schema's types."""
  flat = config_lib.flatten(config_lib.load_file('configs/mnist.py'))
  assert set(config_lib.SCHEMA) <= set(flat), set(config_lib.SCHEMA) - set(flat)
  validated = config_lib.flatten(config_lib.validate(config_lib.load_file('configs/mnist.py')))
  assert validated == flat


def test_missing_keys_are_filled():
  config = config_lib.defaults()
  del config.precision['hysteresis']
  assert config_lib.validate(config).precision.hysteresis == 1


@pytest.mark.parametrize('key, value, words', [
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
])
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
