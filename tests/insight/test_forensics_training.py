"""Forensics during training: a skipped step is replayed from its pre-step weights and batch,
the log names the layer, and the folder it writes replays to the same line later."""

import os

import pytest

from conftest import MNIST_DIR, ROOT
from trainer import config as config_lib
from trainer.insight import forensics


def demo_config(overflow, **overrides):
  config = config_lib.load_file(os.path.join(ROOT, 'configs', 'overflow_demo.py'))
  config.data.dir = MNIST_DIR
  config.model_config.overflow = overflow
  config.train.steps = 20
  config.train.steps_per_loop = 10
  config.train.log_every = 10
  config.train.checkpoint_every = 20
  config.precision.max_consecutive_skips = 0  # let it skip: this is about naming the layer
  config.numerics.forensics_first = 2
  config.numerics.forensics_every = 5
  for key, value in overrides.items():
    config_lib.set_dotted(config, key, value)
  return config


def train(config, workdir, caplog):
  from models.overflow_demo import OverflowDemoTrainer

  trainer = OverflowDemoTrainer(config, str(workdir))
  with caplog.at_level('WARNING'):
    try:
      trainer.train()
    except Exception:  # a run that never gets a finite step ends with a non-finite eval
      pass
  lines = [r.getMessage() for r in caplog.records if 'first non-finite' in r.getMessage()]
  return trainer, lines


@pytest.mark.parametrize(
  'overflow, jit, words',
  [
    ('forward', 'false', "forward output of 'overflow_forward/culprit'"),
    # The compiled step used XLA.
    ('forward', 'true', "forward output of 'overflow_forward/culprit'"),
    ('backward', 'false', "'overflow_backward/amplifier'"),
  ],
)
def test_skips_are_replayed_and_name_the_layer(tmp_path, caplog, overflow, jit, words):
  trainer, lines = train(
    demo_config(overflow, **{'train.jit_compile': jit}), tmp_path / 'w', caplog
  )
  skipped = int(trainer.train_step.skipped_steps.numpy())
  assert skipped >= 3
  # Rate limit: the first 2 skips, then every 5th (the 7th, 12th, ...).
  expected = [k for k in range(1, skipped + 1) if k <= 2 or (k - 2) % 5 == 0]
  assert len(lines) == len(expected), lines
  assert words in lines[0], lines  # later skips, at lower scales, may name another overflow
  if overflow == 'backward':
    assert all('backward' in line for line in lines)
  folders = sorted(os.listdir(tmp_path / 'w' / 'forensics'))
  assert len(folders) == len(expected)
  # The folder replays to the same report later, from its own weights and batch.
  from models.overflow_demo import OverflowDemoTrainer

  fresh = OverflowDemoTrainer(demo_config(overflow), str(tmp_path / 'other'))
  first = os.path.join(tmp_path / 'w' / 'forensics', folders[0])
  report = forensics.replay_folder(fresh, first)
  assert report.line() == lines[0].split(': ', 1)[1].rsplit(' (forensics:', 1)[0]


def test_boundaries_stay_aligned_after_an_early_stop(tmp_path, caplog):
  """A call stopped after a skip is followed by one that ends on the next steps_per_loop
  multiple: logs, evals and checkpoints keep their steps."""
  trainer, _ = train(demo_config('forward', **{'train.steps': 30}), tmp_path / 'w', caplog)
  checkpoints = sorted(
    f for f in os.listdir(tmp_path / 'w' / 'checkpoints') if f.endswith('.index')
  )
  assert checkpoints == ['ckpt-20.index', 'ckpt-30.index']
  assert int(trainer.train_step.skipped_steps.numpy()) >= 3  # calls did stop early
  assert int(trainer.global_step.numpy()) == 30


def test_forensics_off_never_stops_a_call_early(tmp_path, caplog):
  trainer, lines = train(
    demo_config('forward', **{'numerics.forensics_first': 0, 'numerics.forensics_every': 0}),
    tmp_path / 'w',
    caplog,
  )
  assert not trainer.runner.train_loop.forensics and lines == []
  assert not os.path.exists(tmp_path / 'w' / 'forensics')


def test_rate_limiter_next_after_is_the_next_wanted_skip():
  def wanted(k):  # the rule, spelled out: the first 3 skips, then every 10th
    return k <= 3 or (k - 3) % 10 == 0

  limiter = forensics.RateLimiter(3, 10)
  for count in range(60):
    nxt = limiter.next_after(count)
    assert nxt > count and wanted(nxt)
    assert not any(wanted(k) for k in range(count + 1, nxt))
  assert forensics.RateLimiter(2, 0).next_after(2) == 0
