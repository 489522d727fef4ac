"""Update groups and framework names (issue 19): the docs' two-loss-scale GAN, written with no
private name, skips one group's update on its own, puts BatchNorm's statistics back, keeps its
stateful metric and resumes bit-identically; a subclass redefining a framework name is one line.
"""

import importlib
import re

import numpy as np
import pytest
import tensorflow as tf

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
  trainer.runner._run_steps(iterator, 2)  # steps 0, 1: both groups apply
  d_vars = model.discriminator.trainable_variables
  bn = [v for v in model.discriminator.non_trainable_variables]
  assert bn, 'the discriminator has BatchNorm moving statistics'
  before_d, before_bn = arrays(d_vars), arrays(bn)
  before_d_opt = arrays(trainer.optimizer.variables)
  before_g = arrays(model.generator.trainable_variables)
  d_scale, g_scale = float(trainer.loss_scaler.scale.numpy()), float(step.g_scaler.scale.numpy())
  assert (int(trainer.optimizer.iterations), int(step.g_optimizer.iterations)) == (2, 2)

  trainer.runner._run_steps(iterator, 1)  # step 2: the first group's (the D's) gradient poisoned
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

  trainer.runner._run_steps(iterator, 1)  # step 3: both apply again
  assert (int(trainer.optimizer.iterations), int(step.g_optimizer.iterations)) == (3, 4)
  outputs = trainer.runner.train_loop.read_outputs()
  assert outputs['steps'] == 4 and outputs['skipped'] == 1
  assert 0.0 <= outputs['real_accuracy'] <= 1.0  # the stateful metric was updated and read
  assert outputs['loss'] == pytest.approx(outputs['d_loss'] + outputs['g_loss'], rel=1e-5)


def test_two_scale_gan_resumes_bit_identically(gan2, tmp_path):
  overrides = {'debug.inject_nonfinite_steps': '5'}  # a skip after the resume point too
  straight = gan2.TwoScaleGanTrainer(gan_config(**overrides), str(tmp_path / 'straight'))
  straight.train()
  first = gan2.TwoScaleGanTrainer(gan_config(**overrides), str(tmp_path / 'resumed'))
  assert first.runner.train_steps(4) == 4
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


class Ema:
  """An exponential moving average of some variables, counting its updates."""

  def __init__(self, variables):
    self.variables = list(variables)
    self.averages = [tf.Variable(v.numpy(), trainable=False) for v in self.variables]
    self.updates = tf.Variable(0, dtype=tf.int64, trainable=False)

  def update(self):
    for average, v in zip(self.averages, self.variables):
      average.assign(0.9 * average + 0.1 * tf.convert_to_tensor(v))
    self.updates.assign_add(1)


def ema_trainer(gan2, step_body):
  """The docs' two-scale GAN whose step keeps an EMA of each group's weights, updated by
  `step_body` (a method added to the step class)."""

  class EmaStep(gan2.TwoScaleGanStep):
    def __init__(self, trainer):
      super().__init__(trainer)
      self.emas = [Ema(group.variables) for group in self.groups]

  for name, body in step_body.items():
    setattr(EmaStep, name, body)

  class EmaTrainer(gan2.TwoScaleGanTrainer):
    def build_train_step(self):
      return EmaStep(self)

  return EmaTrainer


def test_an_ema_in_apply_gradients_is_refused_at_build_in_one_line(gan2, tmp_path):
  """The step applies each group by apply_group and never calls apply_gradients: an EMA written
  there counted 0 updates over 60 applied steps, without a word."""

  def apply_gradients(self, grads):
    super(type(self), self).apply_gradients(grads)
    for ema in self.emas:
      ema.update()

  with pytest.raises(UserError) as info:
    ema_trainer(gan2, {'apply_gradients': apply_gradients})(gan_config(), str(tmp_path / 'w'))
  message = str(info.value)
  assert '\n' not in message
  assert message.startswith('EmaStep.apply_gradients is never called') and 'apply_group' in message
  assert not (tmp_path / 'w').exists()  # refused before anything is written


def test_an_ema_in_apply_group_counts_every_applied_step(gan2, tmp_path):
  """The same EMA in the one apply hook runs on exactly the steps its group applied: the D's
  group skipped at steps 2 and 5 (injected), the G's never."""

  def apply_group(self, index, grads):
    super(type(self), self).apply_group(index, grads)
    self.emas[index].update()

  trainer_class = ema_trainer(gan2, {'apply_group': apply_group})
  trainer = trainer_class(
    gan_config(**{'debug.inject_nonfinite_steps': '2,5'}), str(tmp_path / 'w')
  )
  step = trainer.train_step
  averages = [arrays(ema.averages) for ema in step.emas]
  iterator = iter(trainer.strategy.experimental_distribute_dataset(trainer.datasets.train))
  assert trainer.runner._run_steps(iterator, 8) == 8
  assert int(step.skipped_steps.numpy()) == 2
  counts = [int(ema.updates.numpy()) for ema in step.emas]
  assert counts == [int(trainer.optimizer.iterations), int(step.g_optimizer.iterations)]
  assert counts == [6, 8]
  for before, ema in zip(averages, step.emas):  # the averages moved, and stayed finite
    after = arrays(ema.averages)
    assert all(np.isfinite(a).all() for a in after)
    assert any(not np.array_equal(a, b) for a, b in zip(before, after))


def test_the_skip_line_names_the_group_skipped_and_its_scale(gan2, tmp_path, capfd):
  """Only the generator skipped at step 3 (its own overflow) while the discriminator's scale
  was already backed off (injected at step 1): the line names the generator, its scale (1024,
  not the D's 512) and the group applied. It printed the D's scale and 'no update'."""

  class NamedStep(gan2.TwoScaleGanStep):
    @property
    def groups(self):
      d, g = super().groups
      return [d._replace(name='discriminator'), g._replace(name='generator')]

    def compute_gradients(self, batch):
      outputs, grads = super().compute_gradients(batch)
      grads, n = list(grads), len(self.model.discriminator.trainable_variables)
      grads[n] = grads[n] * tf.where(tf.equal(self.global_step, 3), float('inf'), 1.0)
      return outputs, grads

  class NamedTrainer(gan2.TwoScaleGanTrainer):
    def build_train_step(self):
      return NamedStep(self)

  trainer = NamedTrainer(gan_config(**{'debug.inject_nonfinite_steps': '1'}), str(tmp_path / 'w'))
  step = trainer.train_step
  assert step.group_names == ['discriminator', 'generator']
  iterator = iter(trainer.strategy.experimental_distribute_dataset(trainer.datasets.train))
  trainer.runner._run_steps(iterator, 4)
  d_kernel = trainer.model.discriminator.trainable_variables[0].path
  g_kernel = trainer.model.generator.trainable_variables[0].path
  lines = [l for l in capfd.readouterr().err.splitlines() if l.startswith('skipped step ')]
  assert lines == [
    'skipped step 1, group discriminator (non-finite gradients injected by '
    'config.debug.inject_nonfinite_steps, no update): loss scale 1024, non-finite in 1 of 6 '
    f'variables, first: {d_kernel}; applied: group generator',
    'skipped step 3, group generator (non-finite gradients, no update): loss scale 1024, '
    f'non-finite in 1 of 4 variables, first: {g_kernel}; applied: group discriminator',
  ]
  assert float(trainer.loss_scaler.scale.numpy()) == 512.0  # the D's, backed off at step 1
  assert float(step.g_scaler.scale.numpy()) == 512.0  # the G's, backed off at step 3
  assert float(step.state.guard.last_scale.numpy()) == 1024.0  # the skipped group's, for the replay


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
