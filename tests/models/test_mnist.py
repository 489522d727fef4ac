"""MNIST end to end through the Trainer: each policy trains; overflow shows in TensorBoard."""

import numpy as np
import pytest

from tiny import tiny_config
from models.mnist_cnn import MnistCnnTrainer
from models.mnist_mlp import MnistMlpTrainer
from trainer.data import mnist
from trainer.insight.events import read_scalars


def test_loader_reads_the_real_files(mnist_dir):
  (x_train, y_train), (x_test, y_test) = mnist.load(mnist_dir)
  assert x_train.shape == (60000, 28, 28) and y_train.shape == (60000,)
  assert x_test.shape == (10000, 28, 28) and y_test.shape == (10000,)
  assert x_train.dtype == np.uint8 and set(np.unique(y_test)) == set(range(10))


def _short_run_trains(trainer_class, policy, mnist_dir, tmp_path):
  config = tiny_config(
    **{
      'data.dir': mnist_dir,
      'precision.policy': policy,
      'train.steps': 40,
      'train.steps_per_loop': 10,
      'train.log_every': 10,
      'train.checkpoint_every': 40,
    }
  )
  trainer = trainer_class(config, str(tmp_path))
  assert trainer.policy == policy
  assert trainer.model.layers[0].compute_dtype == policy.replace('mixed_', '')
  assert all(v.dtype == 'float32' for v in trainer.model.trainable_variables)
  metrics = trainer.train()
  losses = [v for _, v in read_scalars(str(tmp_path))['train/loss']]
  assert len(losses) == 4
  assert losses[-1] < 0.6 * losses[0], losses
  assert metrics['accuracy'] > 0.8  # eval over the 10,000 test images
  assert trainer.loss_scaler.mode == ('dynamic' if policy == 'mixed_float16' else 'none')


# mixed_bfloat16 on the CNN is slow where bfloat16 is emulated (a CPU without AVX512_BF16: many
# times float32's step); the quick suite trains the MLP in it below.
@pytest.mark.parametrize(
  'policy', ['float32', pytest.param('mixed_bfloat16', marks=pytest.mark.slow), 'mixed_float16']
)
def test_short_run_trains_in_each_policy(policy, mnist_dir, tmp_path):
  _short_run_trains(MnistCnnTrainer, policy, mnist_dir, tmp_path)


def test_short_run_trains_the_mlp_in_mixed_bfloat16(mnist_dir, tmp_path):
  _short_run_trains(MnistMlpTrainer, 'mixed_bfloat16', mnist_dir, tmp_path)


def test_injected_overflow_shows_in_tensorboard(mnist_dir, tmp_path):
  config = tiny_config(
    **{
      'data.dir': mnist_dir,
      'precision.policy': 'mixed_float16',
      'train.steps': 12,
      'train.steps_per_loop': 2,
      'train.log_every': 2,
      'train.checkpoint_every': 12,
      'precision.initial_scale': 1024.0,
      'debug.inject_nonfinite_steps': '6',
    }
  )
  MnistCnnTrainer(config, str(tmp_path)).train()
  s = read_scalars(str(tmp_path))
  skipped = dict(s['train/skipped_steps'])
  scale = dict(s['train/loss_scale'])
  assert skipped == {2: 0, 4: 0, 6: 0, 8: 1, 10: 1, 12: 1}  # step 6 runs in the loop ending at 8
  assert scale == {2: 1024, 4: 1024, 6: 1024, 8: 512, 10: 512, 12: 512}
  for tag in (
    'train/loss',
    'train/accuracy',
    'train/learning_rate',
    'train/steps_per_sec',
    'eval/loss',
    'eval/accuracy',
  ):
    assert tag in s, tag


def test_download_verifies_checksums(mnist_dir, tmp_path):
  """The download path, against a local file:// mirror of the original files."""
  mirror = f'file://{mnist_dir}/'
  (x_train, _), (x_test, _) = mnist.load('', mirror=mirror, cache_dir=str(tmp_path))
  assert x_train.shape == (60000, 28, 28) and x_test.shape == (10000, 28, 28)
  cached = tmp_path / 'datasets' / 'mnist-idx'
  assert sorted(p.name for p in cached.iterdir()) == sorted(mnist.FILES)

  bad = tmp_path / 'bad_mirror'
  bad.mkdir()
  for name in mnist.FILES:  # same names, other bytes: the checksum must catch it
    (bad / name).write_bytes(b'not mnist')
  with pytest.raises(mnist.DataError, match='train-images-idx3-ubyte.gz'):
    mnist.load('', mirror=f'file://{bad}/', cache_dir=str(tmp_path / 'other'))


def test_eval_covers_the_test_set_exactly_once(mnist_dir, tmp_path):
  config = tiny_config(**{'data.dir': mnist_dir, 'train.batch_size': 96})  # 10000 % 96 = 16
  trainer = MnistCnnTrainer(config, str(tmp_path))
  dataset = trainer.strategy.experimental_distribute_dataset(trainer.datasets.eval)
  means, count = trainer.runner.eval_loop.run(dataset)
  assert int(count) == 10000
  assert 0.0 <= float(means['accuracy']) <= 1.0
