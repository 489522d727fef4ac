"""docs/guides/mixed-precision-own-loop.md: its 25-line loop (float16 and bfloat16; two replicas
in tests/lso_mirrored_run.py) and TensorFlow's published tf-keras custom loop with only the
import line changed, run as written on an MNIST subset under mixed_float16."""

import contextlib
import functools
import importlib.util
import io
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import MNIST_DIR
from docblocks import block as doc_block


@functools.lru_cache
def mnist(train: int, test: int):
  """MNIST as TensorFlow's guide prepares it (flattened, / 255), the first examples only."""
  from trainer.data import mnist as mnist_data

  (x, y), (xt, yt) = mnist_data.load(MNIST_DIR)
  flat = lambda a: a.reshape(len(a), 784).astype('float32') / 255  # noqa: E731
  return flat(x[:train]), y[:train].astype('int64'), flat(xt[:test]), yt[:test].astype('int64')


BLOCKS = {
  'own_loop': 'runs this block as own_loop.py',
  'fit_example': 'runs this block as fit_example.py',
}


def own_loop(folder, name='own_loop'):
  """The block as a module from a file (autograph reads the source)."""
  path = folder / f'{name}.py'
  path.write_text(doc_block(BLOCKS[name]))
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def accuracy(model, x, y) -> float:
  return float(np.mean(np.argmax(model.predict(x, verbose=0), -1) == y))


@pytest.mark.parametrize('policy', ['mixed_float16', 'mixed_bfloat16'])
def test_the_guide_loop_trains_under_half_precision(policy, tmp_path):
  x, y, xt, yt = mnist(2048, 1024)
  model, optimizer = own_loop(tmp_path).train(x, y, policy=policy, epochs=1, batch_size=256)
  steps = int(optimizer.iterations.numpy()) + int(optimizer.skipped_steps.numpy())
  assert steps == 2048 // 256
  assert all(np.isfinite(v.numpy()).all() for v in model.weights)
  assert model.layers[0].compute_dtype == policy.removeprefix('mixed_')
  assert accuracy(model, xt, yt) > 0.6  # 8 steps from 0.1 (chance)
  if policy == 'mixed_bfloat16':
    assert float(optimizer.loss_scale) == 1.0 and not optimizer.dynamic


def test_tensorflow_published_tf_keras_loop_runs_with_the_import_changed():
  x_train, y_train, x_test, y_test = mnist(8192, 2048)
  namespace = dict(x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(doc_block('runs this block as the tf-keras guide loop'), namespace)
  epochs = re.findall(r'Epoch (\d): loss=([\d.]+), test accuracy=([\d.]+)', out.getvalue())
  assert [e[0] for e in epochs] == ['0', '1'], out.getvalue()
  assert float(epochs[1][1]) < float(epochs[0][1]) and float(epochs[1][2]) > 0.6, out.getvalue()
  optimizer = namespace['optimizer']
  assert keras.mixed_precision.global_policy().name == 'mixed_float16'
  assert int(optimizer.iterations.numpy()) + int(optimizer.skipped_steps.numpy()) == 16
  assert isinstance(optimizer.loss_scale, tf.Tensor) and optimizer.dynamic_counter is not None


def test_the_fit_guide_logs_scale_and_skips(tmp_path):
  x, y, xt, yt = mnist(2048, 1024)
  model, history = own_loop(tmp_path, 'fit_example').fit(x, y, epochs=2)
  optimizer = model.optimizer
  assert type(optimizer).__module__ == 'trainer.step.loss_scale_optimizer'  # not re-wrapped
  assert history.history['loss_scale'][-1] == float(optimizer.loss_scale)
  assert history.history['skipped_steps'][-1] == int(optimizer.skipped_steps.numpy())
  assert int(optimizer.iterations.numpy()) + history.history['skipped_steps'][-1] == 16
  assert accuracy(model, xt, yt) > 0.6  # 16 steps from 0.1 (chance)
