"""Hysteresis rules of trainer/step/loss_scale.py, exactly, and the budget saved in checkpoints; the
scale's trajectory under fault injection in mixed_float16."""

import numpy as np
import tensorflow as tf

from trainer.step.loss_scale import LossScaler

from tiny import TinyTrainer, tiny_config


def run(scaler, pattern):
  """pattern: 'F' finite, 'N' non-finite; returns [(scale, hysteresis_left), ...] after each."""
  out = []
  for c in pattern:
    scaler.update(tf.constant(c == 'F'))
    out.append((float(scaler.scale.numpy()), int(scaler.hysteresis_left.numpy())))
  return out


def dynamic(**kw):
  args = dict(mode='dynamic', initial_scale=1024.0, growth_interval=1000, hysteresis=1)
  args.update(kw)
  return LossScaler(**args)


def test_hysteresis_1_backs_off_on_every_nonfinite_step():
  assert run(dynamic(), 'NNFN') == [(512, 0), (256, 0), (256, 1), (128, 0)]


def test_hysteresis_3_skips_two_then_backs_off_on_the_third_and_every_further_one():
  assert run(dynamic(hysteresis=3), 'NNNNN') == [(1024, 2), (1024, 1), (512, 0), (256, 0), (128, 0)]


def test_one_finite_step_refills_the_whole_budget():
  # N N F: budget back to 3; then N N only skip, the third N backs off.
  assert run(dynamic(hysteresis=3), 'NNFNNN') == [
    (1024, 2),
    (1024, 1),
    (1024, 3),
    (1024, 2),
    (1024, 1),
    (512, 0),
  ]


def test_storm_longer_than_budget_backs_off_each_step_until_min_scale():
  scaler = dynamic(hysteresis=2, initial_scale=8.0, min_scale=2.0)
  assert [s for s, _ in run(scaler, 'NNNNN')] == [8, 4, 2, 2, 2]


def test_nonfinite_step_resets_growth_counter():
  scaler = dynamic(hysteresis=2, growth_interval=3)
  # F F N F F F: the N (within budget) does not back off but restarts the count of 3.
  assert [s for s, _ in run(scaler, 'FFNFFF')] == [1024, 1024, 1024, 1024, 1024, 2048]


def test_budget_is_saved_and_restored_mid_storm(tmp_path):
  a = dynamic(hysteresis=4)
  run(a, 'NN')  # two left
  path = tf.train.Checkpoint(scaler=a).write(str(tmp_path / 'ckpt'))
  b = dynamic(hysteresis=4)
  assert int(b.hysteresis_left.numpy()) == 4
  tf.train.Checkpoint(scaler=b).read(path).assert_existing_objects_matched()
  assert int(b.hysteresis_left.numpy()) == 2
  # The restored scaler continues the storm exactly like the original.
  assert run(b, 'NNN') == run(a, 'NNN') == [(1024, 1), (512, 0), (256, 0)]


def test_budget_survives_a_trainer_resume(tmp_path):
  """Through the Trainer's own checkpoint: stop mid-storm at a checkpoint, resume, and the
  scale trajectory matches an uninterrupted run."""
  overrides = {
    'precision.policy': 'mixed_float16',
    'precision.hysteresis': 3,
    'precision.initial_scale': 1024.0,
    'debug.inject_nonfinite_steps': '4,5,6,7',
    'train.steps': 10,
  }
  straight = TinyTrainer(tiny_config(**overrides), str(tmp_path / 'a'))
  straight.train()
  first = TinyTrainer(tiny_config(**{**overrides, 'train.steps': 6}), str(tmp_path / 'b'))
  first.train()  # steps 0-5, checkpoint at 6: steps 4 and 5 injected, one non-finite step left
  assert int(first.loss_scaler.hysteresis_left.numpy()) == 1
  assert float(first.loss_scaler.scale.numpy()) == 1024.0
  resumed = TinyTrainer(tiny_config(**overrides), str(tmp_path / 'b'))
  resumed.train()
  # steps 6, 7 back off (budget exhausted): 1024 -> 512 -> 256 in both runs.
  assert float(straight.loss_scaler.scale.numpy()) == 256.0
  assert float(resumed.loss_scaler.scale.numpy()) == 256.0


def test_scale_trajectory_under_injection_mixed_float16(tmp_path):
  """Every 4th step injected, hysteresis 1: each injection halves the scale, and skips; every
  other step applies; growth after 3 finite steps in a row would never fire (interval 10)."""
  config = tiny_config(
    **{
      'precision.policy': 'mixed_float16',
      'debug.inject_nonfinite_every': 4,
      'precision.initial_scale': 4096.0,
      'precision.growth_interval': 10,
      'train.steps': 16,
      'train.steps_per_loop': 1,
      'train.log_every': 1,
      'train.checkpoint_every': 16,
    }
  )
  trainer = TinyTrainer(config, str(tmp_path))
  assert trainer.loss_scaler.mode == 'dynamic'
  iterator = iter(trainer.strategy.experimental_distribute_dataset(trainer.datasets.train))
  scales, skipped, iterations = [], [], []
  for _ in range(16):
    trainer.runner.train_loop.run(iterator, 1)
    scales.append(float(trainer.loss_scaler.scale.numpy()))
    skipped.append(int(trainer.train_step.skipped_steps.numpy()))
    iterations.append(int(trainer.optimizer.iterations.numpy()))
  # global steps 0..15; injected at 4, 8, 12 (step 0 is never injected by inject_every).
  expected = [4096.0] * 4 + [2048.0] * 4 + [1024.0] * 4 + [512.0] * 4
  assert scales == expected
  assert skipped == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
  assert iterations[-1] == 13  # 16 steps, 3 skipped: the optimizer applied 13 updates


def test_injection_in_float32_skips_without_loss_scaling(tmp_path):
  """Skipping applies with no loss scale too: the injected step leaves every weight as it was."""
  config = tiny_config(**{'debug.inject_nonfinite_steps': '2', 'train.steps_per_loop': 1})
  trainer = TinyTrainer(config, str(tmp_path))
  assert trainer.loss_scaler.mode == 'none'
  iterator = iter(trainer.strategy.experimental_distribute_dataset(trainer.datasets.train))
  trainer.runner.train_loop.run(iterator, 2)
  before = [v.numpy() for v in trainer.model.weights + trainer.optimizer.variables]
  trainer.runner.train_loop.run(iterator, 1)  # global step 2: injected
  after = [v.numpy() for v in trainer.model.weights + trainer.optimizer.variables]
  assert all(np.array_equal(a, b) for a, b in zip(before, after))
  assert int(trainer.train_step.skipped_steps.numpy()) == 1
  trainer.runner.train_loop.run(iterator, 1)  # step 3 applies again
  assert not np.array_equal(before[0], trainer.model.weights[0].numpy())
