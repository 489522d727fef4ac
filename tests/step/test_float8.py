"""precision.float8: Keras float8 layers' scale and amax-history variables are assigned, never
unscaled, clipped or stepped; the MNIST MLP trains as well as in mixed_bfloat16; replicas agree.

On this CPU float8 is emulated (quantize-dequantize), so these check numerics, not speed."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import MNIST_DIR, ROOT
from trainer import config as config_lib


def mlp_config(**overrides):
  config = config_lib.load_file(os.path.join(ROOT, 'configs', 'mnist_mlp.py'))
  config.data.dir = MNIST_DIR
  config.train.steps = 10
  config.train.steps_per_loop = 5
  config.train.log_every = 5
  config.train.checkpoint_every = 5
  config.precision.policy = 'mixed_bfloat16'
  config.precision.float8 = True
  for key, value in overrides.items():
    config_lib.set_dotted(config, key, value)
  return config


def history(trainer, layer, name):
  return trainer.model.get_layer(layer).__getattribute__(name).numpy().copy()


def run(trainer, n):
  if not hasattr(trainer, '_it'):
    trainer.runner.restore()
    trainer._it = iter(trainer.strategy.experimental_distribute_dataset(trainer.datasets.train))
  return trainer.runner._run_steps(trainer._it, n)


def test_float8_state_under_dynamic_loss_scaling(tmp_path):
  from models.mnist_mlp import MnistMlpTrainer

  trainer = MnistMlpTrainer(
    mlp_config(**{'precision.loss_scale': 'dynamic', 'debug.inject_nonfinite_steps': '6'}),
    str(tmp_path / 'w'),
  )
  dense = trainer.model.layers[1].name
  assert trainer.model.layers[1].dtype_policy.name.startswith('float8')
  run(trainer, 6)
  # Keras rolls each history and writes the newest amax at index 0: after 6 applied steps,
  # 6 entries are filled.
  inputs = history(trainer, dense, 'inputs_amax_history')
  assert np.count_nonzero(inputs) == 6
  # The inputs are pixels in [0, 1]: their amax is 1.0, not 1.0 / 32768 (unscaled by mistake).
  assert (inputs[inputs > 0] == 1.0).all()
  kernel = history(trainer, dense, 'kernel_amax_history')[0]
  weight = np.abs(trainer.model.get_layer(dense).kernel.numpy()).max()
  assert kernel == pytest.approx(weight, rel=0.05)  # the kernel's amax a step ago
  # The output gradients flow scaled through the float8 casts: their amax records the scale.
  grads = history(trainer, dense, 'outputs_grad_amax_history')
  assert np.count_nonzero(grads) == 6 and grads[grads > 0].min() > 1.0
  before = [v.numpy().copy() for v in trainer.model.variables]
  run(trainer, 1)  # step 6: injected, skipped: histories and scales untouched too
  assert int(trainer.train_step.skipped_steps.numpy()) == 1
  for a, v in zip(before, trainer.model.variables):
    np.testing.assert_array_equal(a, v.numpy())
  run(trainer, 3)
  assert all(np.isfinite(v.numpy()).all() for v in trainer.model.variables)
  scales = [
    history(trainer, dense, n) for n in ('inputs_scale', 'kernel_scale', 'outputs_grad_scale')
  ]
  assert all(s > 0 and np.isfinite(s) for s in scales)


def test_float8_mlp_trains_within_one_point_of_bfloat16(tmp_path):
  from models.mnist_mlp import MnistMlpTrainer

  accuracy = {}
  for float8 in (False, True):
    config = mlp_config(
      **{
        'precision.float8': float8,
        'train.steps': 400,
        'train.steps_per_loop': 100,
        'train.log_every': 100,
        'train.checkpoint_every': 400,
        'precision.loss_scale': 'dynamic',
      }
    )
    accuracy[float8] = MnistMlpTrainer(config, str(tmp_path / str(float8))).train()['accuracy']
  assert accuracy[False] > 0.93  # trained (chance is 0.1): the comparison means something
  assert abs(accuracy[True] - accuracy[False]) <= 0.01, accuracy


def test_float8_two_replicas_agree_with_one_device(tmp_path):
  env = {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2', 'PYTHONPATH': ROOT}
  proc = subprocess.run(
    [sys.executable, os.path.join(ROOT, 'tests', 'distribute_runs.py'), '--float8', str(tmp_path)],
    env=env,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  results = json.loads((tmp_path / 'results.json').read_text())
  arrays = dict(np.load(tmp_path / 'arrays.npz'))
  assert results['skipped'] == 0
  names = results['names']
  for i, name in enumerate(names):
    one, replicas = arrays[f'one/{i}'], [arrays[f'replica{r}/{i}'] for r in range(2)]
    # The replicas hold the same values, histories and scales included: each replica's new
    # amax was combined with MAX (Keras alone would keep each replica's local amax).
    np.testing.assert_array_equal(replicas[0], replicas[1], err_msg=name)
    if name.startswith('mnist_mlp/dense/') and ('amax' in name or 'scale' in name):
      # The first layer sees the same inputs: its histories are exactly the one-device ones.
      np.testing.assert_array_equal(replicas[0], one, err_msg=name)
    else:
      # bfloat16 and float8 rounding of two half-batch gradients against one whole batch
      # (seen: 5e-4 absolute, 7e-5 relative on amax histories of later layers); a gradient
      # not summed over replicas moves SGD at 0.1 by ~1e-2.
      np.testing.assert_allclose(replicas[0], one, rtol=1e-3, atol=1e-3, err_msg=name)


# ---- the numerics tools on float8 models --------------------------------------------------------


def test_float8_probe_leaves_out_scales_and_histories_and_sees_quantized_layers(tmp_path):
  """The probe's gradient fractions are over the kernels and biases only (a NumPy float64
  reference of the first layer's zero gradient elements), and the quantized layers, which Keras
  calls through `quantized_call`, get their output statistics."""
  import tensorflow as tf
  from models.mnist_mlp import MnistMlpTrainer
  from trainer.insight.numerics import Probe

  trainer = MnistMlpTrainer(mlp_config(), str(tmp_path / 'w'))
  probe = Probe(trainer)
  assert not [v for v in probe.variables if getattr(v, 'overwrite_with_gradient', False)]
  batch = next(iter(trainer.datasets.train))
  stats, _ = probe.measure(batch)
  dense, logits = (layer for layer in trainer.model.layers if hasattr(layer, 'kernel'))
  x = batch[0].numpy().reshape(len(batch[0]), -1).astype(np.float64)
  labels = batch[1].numpy()
  w1, b1 = dense._kernel.numpy().astype(np.float64), dense.bias.numpy().astype(np.float64)
  w2 = logits._kernel.numpy().astype(np.float64)
  pre = x @ w1 + b1
  h = np.maximum(pre, 0)
  z = h @ w2 + logits.bias.numpy()
  p = np.exp(z - z.max(1, keepdims=True))
  p /= p.sum(1, keepdims=True)
  p[np.arange(len(labels)), labels] -= 1
  dh = (p @ w2.T) * (pre > 0)
  zeros = np.sum(x.T @ dh == 0) + np.sum(dh.sum(0) == 0)
  entry = stats[dense.path]
  assert entry['grad_zero'] == pytest.approx(zeros / (w1.size + b1.size), abs=1e-6)
  assert 'headroom_bits' in entry  # a quantized layer's output is seen
  assert entry['output_max'] == pytest.approx(np.abs(h).max(), rel=0.1)  # float8 rounding
  assert tf.reduce_all(tf.math.is_finite(dense.kernel_scale))


def test_float8_replay_names_the_overflowing_quantized_layer(tmp_path):
  """Keras's float8 gradient fails eagerly under a tape; the replay runs the quantized calls
  compiled and names the layer whose float16 output overflows (float32: 64 x 448 x 400 > 65504;
  the first call's scale is 1, so inputs are clipped to float8 e4m3's largest value, 448)."""
  import keras
  from tiny import TinyTrainer, tiny_config
  from trainer.insight import forensics

  class Loud(TinyTrainer):
    def build_model(self):
      big = keras.initializers.Constant(400.0)
      return keras.Sequential(
        [
          keras.Input((8,)),
          keras.layers.Dense(64, kernel_initializer=big),
          keras.layers.Dense(64, kernel_initializer=big, name='culprit'),
          keras.layers.Dense(4, dtype='float32'),
        ],
        name='loud',
      )

  trainer = Loud(
    tiny_config(**{'precision.policy': 'mixed_float16', 'precision.float8': True}),
    str(tmp_path / 'w'),
  )
  assert trainer.model.get_layer('culprit').quantization_mode == 'float8'
  batch = next(iter(trainer.datasets.train))
  report = forensics.replay(trainer.model, trainer.compute_loss, batch, loss_scale=32768.0)
  assert report.phase == 'forward' and report.layer == 'loud/culprit', report.line()
  finite = MnistMlpTrainerFor(tmp_path)
  line = forensics.replay(
    finite.model, finite.compute_loss, next(iter(finite.datasets.train)), loss_scale=32768.0
  ).line()
  assert line.startswith('replay finite'), line


def MnistMlpTrainerFor(tmp_path):  # pylint: disable=invalid-name
  from models.mnist_mlp import MnistMlpTrainer

  return MnistMlpTrainer(mlp_config(), str(tmp_path / 'mlp'))
