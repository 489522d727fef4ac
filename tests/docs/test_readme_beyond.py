"""The custom-step and metrics guides (docs/guides/): their code blocks, run as written, keep
their promises.

The GAN block is written to my_project/gan.py and used through the public step contract only:
one loss scale for two optimizers, both updates skipped together, a resume bit-identical to an
uninterrupted run. The metric block's AUC equals the rank statistic of the same predictions.
"""

import importlib
import sys

import numpy as np
import pytest
import tensorflow as tf

from conftest import MNIST_DIR
from docblocks import block as doc_block
from trainer import config as config_lib


@pytest.fixture
def package(tmp_path, monkeypatch):
  """The docs' blocks as modules of a package `my_project` outside the repository."""
  folder = tmp_path / 'src' / 'my_project'
  folder.mkdir(parents=True)
  (folder / '__init__.py').write_text('')
  (folder / 'gan.py').write_text(doc_block('runs this block as my_project/gan.py'))
  monkeypatch.syspath_prepend(str(tmp_path / 'src'))

  def forget():  # another test's my_project package may be imported already
    for name in [m for m in sys.modules if m == 'my_project' or m.startswith('my_project.')]:
      del sys.modules[name]
    importlib.invalidate_caches()

  forget()
  yield importlib.import_module
  forget()


def gan_config(**overrides):
  config = config_lib.defaults()
  config.model = 'my_project.gan'
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


def state(trainer):
  step = trainer.train_step
  return [v.numpy().copy() for v in trainer.model.weights] + [
    v.numpy().copy() for v in trainer.optimizer.variables + step.g_optimizer.variables
  ]


def test_gan_step_one_scale_skips_both_updates_together(package, tmp_path):
  gan = package('my_project.gan')
  trainer = gan.GanTrainer(gan_config(**{'debug.inject_nonfinite_steps': '2'}), str(tmp_path / 'w'))
  step = trainer.train_step
  iterator = iter(trainer.strategy.experimental_distribute_dataset(trainer.datasets.train))
  trainer.runner._run_steps(iterator, 2)  # steps 0, 1 apply both updates
  before, scale = state(trainer), float(trainer.loss_scaler.scale.numpy())
  d_applied, g_applied = int(trainer.optimizer.iterations), int(step.g_optimizer.iterations)
  assert (d_applied, g_applied) == (2, 2)
  trainer.runner._run_steps(iterator, 1)  # step 2: the D's first gradient is poisoned
  for a, b in zip(before, state(trainer)):
    np.testing.assert_array_equal(a, b)  # neither model nor either optimizer moved
  assert (int(trainer.optimizer.iterations), int(step.g_optimizer.iterations)) == (2, 2)
  assert float(trainer.loss_scaler.scale.numpy()) == scale / 2  # the one scale backed off
  trainer.runner._run_steps(iterator, 1)  # step 3: both apply again
  assert (int(trainer.optimizer.iterations), int(step.g_optimizer.iterations)) == (3, 3)
  outputs = trainer.runner.train_loop.read_outputs()
  assert set(outputs) >= {'loss', 'd_loss', 'g_loss', 'steps', 'skipped'}
  assert outputs['steps'] == 4 and outputs['skipped'] == 1
  assert outputs['loss'] == pytest.approx(outputs['d_loss'] + outputs['g_loss'], rel=1e-5)


def test_gan_has_no_precision_hazard(package, tmp_path):
  """The guide's GAN trains without a hazard line: its generator's Reshape took the mixed_float16
  policy, so the model's output (the images) was float16 and the start of every run warned
  'low-precision logits' about a model that has none."""
  from trainer.insight import audit

  gan = package('my_project.gan')
  trainer = gan.GanTrainer(gan_config(), str(tmp_path / 'w'))
  _, hazards = audit.audit(trainer.model, trainer.policy, audit.forward(trainer))
  assert hazards == []


def test_gan_resume_is_bit_identical(package, tmp_path):
  gan = package('my_project.gan')
  straight = gan.GanTrainer(gan_config(), str(tmp_path / 'straight'))
  straight.train()
  # Interrupted: 4 steps, a checkpoint, a new process-like trainer resumes to 8.
  first = gan.GanTrainer(gan_config(), str(tmp_path / 'resumed'))
  assert first.runner.train_steps(4) == 4
  first.runner.save()
  resumed = gan.GanTrainer(gan_config(), str(tmp_path / 'resumed'))
  resumed.train()
  assert int(resumed.global_step.numpy()) == 8
  for a, b in zip(state(straight), state(resumed)):
    np.testing.assert_array_equal(a, b)


def zeros_config(**overrides):
  config = config_lib.defaults()
  config.data.dir = MNIST_DIR
  config.train.batch_size = 64
  config.train.steps = 60
  config.train.steps_per_loop = 20
  config.train.log_every = 20
  config.train.checkpoint_every = 60
  config.train.eval_every = 20
  config.precision.policy = 'float32'
  for key, value in overrides.items():
    config_lib.set_dotted(config, key, value)
  return config


def rank_auc(labels, scores):
  """The exact AUC: the probability that a positive outranks a negative (ties count half)."""
  pos, neg = scores[labels == 1], scores[labels == 0]
  greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
  return greater / (len(pos) * len(neg))


@pytest.fixture
def zeros(package, tmp_path):
  src = tmp_path / 'src' / 'my_project'
  (src / 'zeros.py').write_text(doc_block('runs this block as my_project/zeros.py'))
  target = doc_block('runs this block as my_project/zeros_target.py')
  (src / 'zeros_target.py').write_text(target)
  return package('my_project.zeros'), package('my_project.zeros_target')


def test_auc_metric_equals_the_rank_statistic_of_the_same_predictions(zeros, tmp_path):
  trainer = zeros[0].ZeroDetector(zeros_config(), str(tmp_path / 'w'))
  metrics = trainer.train()
  labels, scores = [], []
  for images, digits in trainer.datasets.eval:
    labels.append((digits.numpy() == 0).astype(int))
    scores.append(trainer.model(images).numpy()[:, 0])
  labels, scores = np.concatenate(labels), np.concatenate(scores)
  assert len(labels) == 10000
  reference = rank_auc(labels, scores)
  assert 0.9 < reference < 1.0  # a trained, imperfect detector: the comparison means something
  # Keras's AUC sums over 1000 thresholds of the sigmoid: equal to the rank statistic up to that.
  assert metrics['auc'] == pytest.approx(reference, abs=2e-3)
  # Reset between evals: a second eval of the same weights gives the same value.
  assert trainer.evaluate()['auc'] == pytest.approx(metrics['auc'], abs=1e-6)


def test_actions_stop_at_target_and_keep_the_best(zeros, tmp_path):
  workdir = tmp_path / 'w'
  trainer = zeros[1].ZeroDetectorToTarget(
    zeros_config(
      **{'train.steps': 400, 'optimizer.learning_rate': 3e-3, 'best_checkpoint.metric': 'auc'}
    ),
    str(workdir),
  )
  metrics = trainer.train()
  step = int(trainer.global_step.numpy())
  assert metrics['auc'] >= 0.99 and step < 400 and step % 20 == 0  # stopped at an eval
  assert tf.train.latest_checkpoint(str(workdir / 'checkpoints')).endswith(f'ckpt-{step}')
  import json

  best = json.loads((workdir / 'best' / 'best.json').read_text())
  assert best['step'] == step and best['value'] == pytest.approx(metrics['auc'])
