"""Update groups and framework names (issue 19): the docs' two-loss-scale GAN, written with no
private name, skips one group's update on its own, puts BatchNorm's statistics back, keeps its
stateful metric and resumes bit-identically; a subclass redefining a framework name is one line.
"""
import importlib
import re
import sys

import numpy as np
import pytest

import docblocks
from conftest import MNIST_DIR
from tiny import TinyTrainer, tiny_config
from trainer import UserError
from trainer import config as config_lib


@pytest.fixture
def gan2(tmp_path, monkeypatch):
  folder = tmp_path / 'src' / 'my_project'
  folder.mkdir(parents=True)
  (folder / '__init__.py').write_text('')
  block = docblocks.block('runs this block as my_project/gan2.py')
  # No private name: no attribute or import starting with an underscore but __init__.
  assert not re.search(r'\._(?!_init__)', block)
  assert 'from trainer.' not in block.replace('from trainer.data', '')
  (folder / 'gan2.py').write_text(block)
  monkeypatch.syspath_prepend(str(tmp_path / 'src'))
  for name in [m for m in sys.modules if m == 'my_project' or m.startswith('my_project.')]:
    del sys.modules[name]
  importlib.invalidate_caches()
  yield importlib.import_module('my_project.gan2')
  for name in [m for m in sys.modules if m == 'my_project' or m.startswith('my_project.')]:
    del sys.modules[name]


def gan_config(**overrides):
  config = config_lib.defaults()
  config.model = 'my_project.gan2'
  config.data.dir = MNIST_DIR
  config.train.batch_size = 32
  config.train.steps = 8
  config.train.steps_per_loop = 2
  config.train.log_every = 2
  config.train.checkpoint_every = 4
  config.train.deterministic = True
  config.precision.policy = 'mixed_float16'
  config.precision.loss_scale = 'dynamic'
  config.precision.initial_scale = 1024.0
  for key, value in overrides.items():
    config_lib.set_dotted(config, key, value)
  return config


def arrays(variables):
  return [np.array(v.numpy()) for v in variables]


def test_one_group_skips_alone_and_the_forward_state_is_put_back(gan2, tmp_path):
  trainer = gan2.TwoScaleGanTrainer(gan_config(**{'debug.inject_nonfinite_steps': '2'}),
                                    str(tmp_path / 'w'))
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
  for a, b in zip(before_d + before_d_opt + before_bn,
                  arrays(d_vars) + arrays(trainer.optimizer.variables) + arrays(bn)):
    np.testing.assert_array_equal(a, b)  # the D, its optimizer and BatchNorm's state unmoved
  assert any(not np.array_equal(a, b)
             for a, b in zip(before_g, arrays(model.generator.trainable_variables)))
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
    return arrays(t.model.weights + t.optimizer.variables + s.g_optimizer.variables +
                  [t.loss_scaler.scale, s.g_scaler.scale, s.g_scaler.good_steps])

  for a, b in zip(state(straight), state(resumed)):
    np.testing.assert_array_equal(a, b)


def test_a_helper_named_save_is_one_line_at_class_definition():
  with pytest.raises(UserError) as info:

    class Mine(TinyTrainer):  # pylint: disable=unused-variable
      def save(self, folder):
        del folder

  message = str(info.value)
  assert '\n' not in message and 'Mine.save' in message and 'build_model' in message


def test_an_attribute_named_like_the_framework_is_one_line():
  with pytest.raises(UserError, match=r'Mine\.numerics'):

    class Mine(TinyTrainer):  # pylint: disable=unused-variable
      numerics = None


def test_an_instance_attribute_set_before_init_is_caught_at_build(tmp_path):

  class Mine(TinyTrainer):
    def __init__(self, config, workdir):
      self.checkpoint = 'mine'  # set before super().__init__()
      super().__init__(config, workdir)

  with pytest.raises(UserError, match=r"Mine\.checkpoint: 'checkpoint' is a name the framework"):
    Mine(tiny_config(), str(tmp_path / 'w'))
  assert not (tmp_path / 'w').exists()  # nothing written
