"""Training converges through injected faults: the MNIST CNN of configs/mnist.py with every 20th
step's gradients made non-finite ends within 0.3 points of test accuracy of the clean run, which
ends above 98 %. Two runs of 2 epochs (936 steps each; the config's 5 are for its published
figure), in the config's policy 'auto': the subject is the skip, not bfloat16 arithmetic, so a
CPU without fast bfloat16 runs it in float32 instead of emulating bfloat16."""

import os

import pytest

import models
from trainer import config as config_lib

from conftest import ROOT

MNIST_DIR = os.path.join(ROOT, '..', 'shared', 'data', 'mnist')
EPOCHS = 2


def mnist_config(**debug):
  config = config_lib.load_file(os.path.join(ROOT, 'configs', 'mnist.py'))
  config.data.dir = MNIST_DIR
  config.train.epochs = EPOCHS
  for key, value in debug.items():
    config.debug[key] = value
  return config


@pytest.mark.slow
def test_every_20th_step_injected_converges_like_clean_run(tmp_path):
  trainer_class = models.get_trainer_class('mnist_cnn')
  clean = trainer_class(mnist_config(), str(tmp_path / 'clean'))
  clean_metrics = clean.train()
  injected = trainer_class(mnist_config(inject_nonfinite_every=20), str(tmp_path / 'injected'))
  injected_metrics = injected.train()

  total = injected.total_steps
  assert int(clean.train_step.skipped_steps.numpy()) == 0
  assert int(injected.train_step.skipped_steps.numpy()) == (total - 1) // 20  # steps 20, 40, ..
  assert int(injected.optimizer.iterations.numpy()) == total - (total - 1) // 20
  print(
    f'clean accuracy {clean_metrics["accuracy"]:.4f}, injected '
    f'{injected_metrics["accuracy"]:.4f}, {total} steps'
  )
  assert clean_metrics['accuracy'] > 0.98
  assert abs(injected_metrics['accuracy'] - clean_metrics['accuracy']) <= 0.003
