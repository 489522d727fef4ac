"""Issue 36's done-when: the 25-line GradientTape loop of docs/guides/mixed-precision-own-loop.md
(trainer.mixed_precision.LossScaleOptimizer) trains MNIST under mixed_float16 to the Trainer's
accuracy within 0.3 points: the same model (configs/mnist_mlp.py: Dense 128 relu, Dense 10
float32), optimizer (Adam 2e-3, constant), batch (128) and epochs. float16 is emulated on this
CPU: the full comparison is slow; the quick variant trains the loop alone on part of MNIST."""

import importlib.util
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import MNIST_DIR, ROOT
from docblocks import block as doc_block

EPOCHS = 5


def own_loop(folder):
  path = folder / 'own_loop.py'
  path.write_text(doc_block('runs this block as own_loop.py'))
  spec = importlib.util.spec_from_file_location('own_loop', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def mnist():
  from trainer.data import mnist as mnist_data

  (x, y), (xt, yt) = mnist_data.load(MNIST_DIR)
  flat = lambda a: a.reshape(len(a), 784).astype('float32') / 255  # noqa: E731
  return flat(x), y.astype('int64'), flat(xt), yt.astype('int64')


def loop_accuracy(folder, train_examples=None, epochs=EPOCHS) -> tuple[float, object]:
  x, y, xt, yt = mnist()
  model, optimizer = own_loop(folder).train(
    x[:train_examples], y[:train_examples], epochs=epochs, batch_size=128
  )
  predicted = np.argmax(model.predict(xt, batch_size=1000, verbose=0), -1)
  return float(np.mean(predicted == yt)), optimizer


def trainer_accuracy(workdir) -> float:
  words = [
    sys.executable,
    os.path.join(ROOT, 'launch.py'),
    '--config=' + os.path.join(ROOT, 'configs', 'mnist_mlp.py'),
    f'--config.data.dir={MNIST_DIR}',
    f'--config.train.epochs={EPOCHS}',
    '--config.precision.policy=mixed_float16',
    '--config.optimizer.schedule=constant',
    f'--workdir={workdir}',
  ]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  done = subprocess.run(words, capture_output=True, text=True, cwd=ROOT, env=env, timeout=3600)
  text = done.stdout + done.stderr
  assert done.returncode == 0, text[-3000:]
  return float(re.findall(r'^final eval: .*accuracy ([0-9.]+)$', text, re.M)[-1])


@pytest.mark.slow
def test_the_own_loop_reaches_the_trainers_accuracy_under_mixed_float16(tmp_path):
  ours, optimizer = loop_accuracy(tmp_path)
  theirs = trainer_accuracy(tmp_path / 'run')
  print(f'accuracy: own loop {ours:.4f}, Trainer {theirs:.4f}')  # shown with pytest -s
  assert abs(ours - theirs) <= 0.003, (ours, theirs)
  assert int(optimizer.iterations.numpy()) > 0.99 * EPOCHS * (60000 // 128)  # few skips


def test_the_own_loop_learns_mnist_quickly_under_mixed_float16(tmp_path):
  accuracy, optimizer = loop_accuracy(tmp_path, train_examples=6016, epochs=1)
  assert accuracy > 0.85, accuracy
  assert int(optimizer.iterations.numpy()) + int(optimizer.skipped_steps.numpy()) == 47
