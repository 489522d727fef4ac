"""Update groups and framework names (issue 19): the docs' two-loss-scale GAN, written with no
private name, skips one group's update on its own, puts BatchNorm's statistics back, keeps its
stateful metric and resumes bit-identically; a subclass redefining a framework name is one line.
"""

import importlib
import re

import numpy as np
import pytest

import docblocks
import test_readme_beyond as beyond
from test_readme_beyond import package  # noqa: F401  (the fixture)
from tiny import TinyTrainer, tiny_config
from trainer import UserError
from trainer.run import build


@pytest.fixture
def gan2(package):  # noqa: F811  (the fixture imported above)
  """The two-loss-scale GAN block as my_project/gan2.py (test_readme_beyond's package)."""
  block = docblocks.block('runs this block as my_project/gan2.py')
  # No private name: no attribute or import starting with an underscore but __init__.
  assert not re.search(r'\._(?!_init__)', block)
  assert 'from trainer.' not in block.replace('from trainer.data', '')
  folder = package('my_project').__path__[0]
  with open(f'{folder}/gan2.py', 'w') as f:
    f.write(block)
  importlib.invalidate_caches()
  return package('my_project.gan2')


def gan_config(**overrides):
  """test_readme_beyond's GAN config (batch 32, 8 steps, mixed_float16, dynamic from 1024)."""
  return beyond.gan_config(model='my_project.gan2', **overrides)


def arrays(variables):
  return [np.array(v.numpy()) for v in variables]


def test_one_group_skips_alone_and_the_forward_state_is_put_back(gan2, tmp_path):
  trainer = gan2.TwoScaleGanTrainer(
    gan_config(**{'debug.inject_nonfinite_steps': '2'}), str(tmp_path / 'w')
  )
  step, model = trainer.train_step, trainer.model
  iterator = iter(trainer.strategy.experimental_distribute_dataset(trainer.datasets.train))
  trainer.runner.run_steps(iterator, 2)  # steps 0, 1: both groups apply
  d_vars = model.discriminator.trainable_variables
  bn = [v for v in model.discriminator.non_trainable_variables]
  assert bn, 'the discriminator has BatchNorm moving statistics'
  before_d, before_bn = arrays(d_vars), arrays(bn)
  before_d_opt = arrays(trainer.optimizer.variables)
  before_g = arrays(model.generator.trainable_variables)
  d_scale, g_scale = float(trainer.loss_scaler.scale.numpy()), float(step.g_scaler.scale.numpy())
  assert (int(trainer.optimizer.iterations), int(step.g_optimizer.iterations)) == (2, 2)

  trainer.runner.run_steps(iterator, 1)  # step 2: the first group's (the D's) gradient poisoned
  for a, b in zip(
    before_d + before_d_opt + before_bn,
    arrays(d_vars) + arrays(trainer.optimizer.variables) + arrays(bn),
  ):
    np.testing.assert_array_equal(a, b)  # the D, its optimizer and BatchNorm's state unmoved
  assert any(
    not np.array_equal(a, b) for a, b in zip(before_g, arrays(model.generator.trainable_variables))
  )
  assert (int(trainer.optimizer.iterations), int(step.g_optimizer.iterations)) == (2, 3)
  assert float(trainer.loss_scaler.scale.numpy()) == d_scale / 2  # the D's scale backed off
  assert float(step.g_scaler.scale.numpy()) == g_scale  # the G's did not
  assert int(step.skipped_steps.numpy()) == 1

  trainer.runner.run_steps(iterator, 1)  # step 3: both apply again
  assert (int(trainer.optimizer.iterations), int(step.g_optimizer.iterations)) == (3, 4)
  outputs = step.read_outputs()
  assert outputs['steps'] == 4 and outputs['skipped'] == 1
  assert 0.0 <= outputs['real_accuracy'] <= 1.0  # the stateful metric was updated and read
  assert outputs['loss'] == pytest.approx(outputs['d_loss'] + outputs['g_loss'], rel=1e-5)


def test_two_scale_gan_resumes_bit_identically(gan2, tmp_path):
  overrides = {'debug.inject_nonfinite_steps': '5'}  # a skip after the resume point too
  straight = gan2.TwoScaleGanTrainer(gan_config(**overrides), str(tmp_path / 'straight'))
  straight.train()
  first = gan2.TwoScaleGanTrainer(gan_config(**overrides), str(tmp_path / 'resumed'))
  first.runner.restore()
  iterator = iter(first.strategy.experimental_distribute_dataset(first.datasets.train))
  assert first.runner.run_steps(iterator, 4) == 4
  first.runner.save()
  resumed = gan2.TwoScaleGanTrainer(gan_config(**overrides), str(tmp_path / 'resumed'))
  resumed.train()
  assert int(resumed.global_step.numpy()) == 8

  def state(t):
    s = t.train_step
    return arrays(
      t.model.weights
      + t.optimizer.variables
      + s.g_optimizer.variables
      + [t.loss_scaler.scale, s.g_scaler.scale, s.g_scaler.good_steps]
    )

  for a, b in zip(state(straight), state(resumed)):
    np.testing.assert_array_equal(a, b)


def test_a_helper_named_evaluate_is_one_line_at_class_definition():
  with pytest.raises(UserError) as info:

    class Mine(TinyTrainer):  # pylint: disable=unused-variable
      def evaluate(self, folder):
        del folder

  message = str(info.value)
  assert '\n' not in message and 'Mine.evaluate' in message and 'build_model' in message


def test_an_attribute_named_like_the_framework_is_one_line():
  with pytest.raises(UserError, match=r'Mine\.loss_scaler'):

    class Mine(TinyTrainer):  # pylint: disable=unused-variable
      loss_scaler = None


def test_the_guard_lists_only_names_a_trainer_has(tmp_path):
  """Issue 34: the guard refused `save`, `checkpoint`, `actions` and 9 more names no Trainer had
  any more; every name it lists is an attribute or method of a built Trainer, and a name that
  moved to the Runner is free."""
  trainer = TinyTrainer(tiny_config(), str(tmp_path / 'w'))
  missing = sorted(n for n in build.FRAMEWORK_NAMES if not hasattr(trainer, n))
  assert not missing, missing

  class Mine(TinyTrainer):  # a helper named like a Runner method: the user's own
    def save(self, folder):
      return folder

  assert Mine.save(None, 'x') == 'x'


def test_an_instance_attribute_set_before_init_is_caught_at_build(tmp_path):

  class Mine(TinyTrainer):
    def __init__(self, config, workdir):
      self.runner = 'mine'  # set before super().__init__()
      super().__init__(config, workdir)

  with pytest.raises(UserError, match=r"Mine\.runner: 'runner' is a name the framework"):
    Mine(tiny_config(), str(tmp_path / 'w'))
  assert not (tmp_path / 'w').exists()  # nothing written


def test_every_loss_scale_and_rate_is_logged(gan2, tmp_path, caplog):
  """Issue 34: with two scalers the generator's scale was in no log line and no TensorBoard tag,
  and the generator's learning rate (its own Adam at 2e-4) nowhere."""
  from tensorboard.backend.event_processing import event_accumulator
  import logging as py_logging
  import tensorflow as tf

  workdir = tmp_path / 'w'
  config = gan_config(**{'train.steps': 4, 'debug.inject_nonfinite_steps': '1'})
  trainer = gan2.TwoScaleGanTrainer(config, str(workdir))
  with caplog.at_level(py_logging.INFO):
    trainer.train()
  d_scale, g_scale = (
    float(trainer.loss_scaler.scale.numpy()),
    float(trainer.train_step.g_scaler.scale.numpy()),
  )
  assert (d_scale, g_scale) == (512.0, 1024.0)  # step 1 poisoned the D's group only
  line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith('step 4/4 '))
  assert '| scale 0=512 1=1024 |' in line, line
  d_rate = float(trainer.optimizer.learning_rate)
  assert f'| lr 0={d_rate:.2e} 1={2e-4:.2e} |' in line, line
  events = event_accumulator.EventAccumulator(
    str(workdir / 'tensorboard'), size_guidance={'tensors': 0}
  )
  events.Reload()

  def last(tag):
    return float(tf.make_ndarray(events.Tensors(tag)[-1].tensor_proto))

  assert (last('train/loss_scale/0'), last('train/loss_scale/1')) == (512.0, 1024.0)
  assert last('train/loss_scale') == 512.0  # the first group's, as with one group
  assert last('train/learning_rate/1') == pytest.approx(2e-4)
  assert last('train/learning_rate') == pytest.approx(d_rate)
