"""trainer.plot renders a PNG from the TensorBoard events of a real short run."""

import keras
import numpy as np
import pytest

import models
from configs import mnist_mlp
from trainer.insight import plot
from conftest import MNIST_DIR as DATA
from trainer.errors import UserError

matplotlib = pytest.importorskip('matplotlib')


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """200 MLP steps in mixed_float16 with dynamic scaling and two injected non-finite steps."""
  workdir = str(tmp_path_factory.mktemp('plot') / 'mlp_f16')
  config = mnist_mlp.get_config()
  config.data.dir = DATA
  config.train.update(
    steps=200, steps_per_loop=50, log_every=50, eval_every=100, checkpoint_every=200
  )
  config.precision.update(policy='mixed_float16', loss_scale='dynamic', initial_scale=1024.0)
  config.debug.inject_nonfinite_steps = '60,120'
  models.get_trainer_class(config.model)(config, workdir).train()
  keras.mixed_precision.set_global_policy('float32')
  return workdir


def test_reads_every_logged_series(run):
  scalars = plot.read_scalars(run)
  steps, scale = scalars['train/loss_scale']
  np.testing.assert_array_equal(steps, [50, 100, 150, 200])
  np.testing.assert_array_equal(scale, [1024, 512, 256, 256])  # halved after steps 60 and 120
  np.testing.assert_array_equal(scalars['train/skipped_steps'][1], [0, 1, 2, 2])
  np.testing.assert_array_equal(scalars['eval/loss'][0], [100, 200])
  assert scalars['eval/accuracy'][1][-1] > 0.85
  assert scalars['train/learning_rate'][1][0] > scalars['train/learning_rate'][1][-1]


def test_renders_png_with_every_panel(run, tmp_path):
  out = plot.render([run, run], str(tmp_path / 'curves.png'))
  image = matplotlib.image.imread(out)
  assert image.shape[:2] == (800, 2000)
  assert image[..., :3].std() > 0.05  # not a blank canvas


def test_panels_name_the_policy_and_show_speed_wall_clock_and_eval_curves(run):
  import matplotlib.pyplot as plt

  fig = plot.figure([run])
  axes = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
  assert fig._suptitle.get_text() == 'mlp_f16 (mixed_float16)'
  # eval_every=100: the eval curve has a point at each eval (100, 200).
  eval_line = [l for l in axes['accuracy'].lines if l.get_label().endswith(' eval')]
  np.testing.assert_array_equal(eval_line[0].get_xdata(), [100, 200])
  speed = axes['steps/s'].lines[0]
  np.testing.assert_array_equal(speed.get_xdata(), [50, 100, 150, 200])
  assert all(v > 0 for v in speed.get_ydata())
  wall = axes['train loss against wall-clock time'].lines[0]
  minutes = wall.get_xdata()
  assert minutes[0] == 0 and all(np.diff(minutes) > 0)  # later steps, later times
  np.testing.assert_allclose(wall.get_ydata(), plot.read_scalars(run)['train/loss'][1])
  assert wall.get_label() == 'mlp_f16 (mixed_float16)'
  plt.close(fig)


def test_missing_events_is_a_user_error(tmp_path):
  with pytest.raises(UserError, match='tensorboard not found'):
    plot.read_scalars(str(tmp_path))
