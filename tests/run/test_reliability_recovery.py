"""A known-good checkpoint is kept, and a run recovers instead of stopping.

The scenario of issue 23: a healthy run, resumed with learning_rate=1e38 (one finite but useless
update, then every step skipped). The saves after it hold finite but broken weights; rotation
(max_to_keep=2) must not remove the last healthy checkpoint, and the collapse message names it.
With train.recover_tries the run restores it, lowers the learning rate and finishes. At the end
of every run one goodput line splits the wall time."""

import json
import logging
import math
import os

import numpy as np
import pytest
import tensorflow as tf

from trainer.errors import CollapseError, DivergenceError
from trainer.insight.divergence import DivergenceMonitor
from trainer.run import goodput, health

from tiny import TinyTrainer, tiny_config, weights

HEALTHY = {'train.steps': 20, 'train.max_to_keep': 2, 'precision.max_consecutive_skips': 8}
BROKEN = {
  **HEALTHY,
  'train.steps': 60,
  'optimizer.learning_rate': 1e38,
  'train.accept_config_change': True,
  'precision.max_consecutive_skips': 20,
}


def healthy_run(workdir):
  trainer = TinyTrainer(tiny_config(**HEALTHY), str(workdir))
  trainer.train()
  return weights(trainer)


def index_files(workdir):
  return sorted(p for p in os.listdir(os.path.join(workdir, 'checkpoints')) if p.endswith('.index'))


def test_the_healthy_checkpoint_survives_rotation_and_is_named(tmp_path):
  at_20 = healthy_run(tmp_path)
  trainer = TinyTrainer(tiny_config(**BROKEN), str(tmp_path))
  with pytest.raises(CollapseError) as info:
    trainer.train()
  message = str(info.value)
  assert '\n' not in message
  assert 'last healthy: ckpt-20, step 20, loss ' in message
  record = json.loads((tmp_path / 'checkpoints' / 'healthy.json').read_text())
  assert record['checkpoint'] == 'ckpt-20' and record['step'] == 20
  assert 0 < record['loss'] < 3  # cross-entropy of 4 classes: log(4) = 1.39 at the start
  # Saves went on after the broken update (finite weights, every step skipped); rotation kept
  # the newest 2 of them and the healthy one.
  names = index_files(tmp_path)
  assert 'ckpt-20.index' in names and len(names) == 3, names
  np.testing.assert_array_equal(first_kernel(tmp_path, 'ckpt-20'), at_20[0])
  newest = max(names, key=lambda n: int(n[5:-6]))
  assert np.abs(first_kernel(tmp_path, newest[:-6])).max() > 1e30  # finite, broken


def first_kernel(workdir, name):
  """The first Dense layer's kernel (8 x 16) in checkpoint `name`."""
  reader = tf.train.load_checkpoint(os.path.join(workdir, 'checkpoints', name))
  # (Keras 3 saves a model's weights once, under the optimizer that tracks them)
  return reader.get_tensor('optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE')


def test_with_recovery_the_run_finishes(tmp_path, caplog):
  healthy_run(tmp_path)
  trainer = TinyTrainer(
    tiny_config(**BROKEN, **{'train.recover_tries': 3, 'train.recover_lr_factor': 1e-20}),
    str(tmp_path),
  )
  with caplog.at_level(logging.INFO):
    metrics = trainer.train()
  assert int(trainer.global_step.numpy()) == 60
  assert math.isfinite(metrics['loss']) and metrics['loss'] < 3
  recoveries = [r.getMessage() for r in caplog.records if r.getMessage().startswith('recovery ')]
  # 1e38 -> 1e18 (still broken) -> 1e-2: two recoveries, each from the healthy ckpt-20.
  assert len(recoveries) == 2, recoveries
  assert all('last healthy: ckpt-20, step 20' in r for r in recoveries)
  assert 'learning rate x1e-40' in recoveries[1]
  # Each divergence is said once, in its recovery line (it was also a line of its own before).
  said = [r.getMessage() for r in caplog.records if r.getMessage().startswith('divergence at ')]
  assert not [d for d in said if any(d in r for r in recoveries)], said
  assert float(trainer.learning_rate.factor.numpy()) == pytest.approx(1e-40)  # the schedule's
  assert all(np.isfinite(w).all() for w in weights(trainer))
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith('goodput ')]
  assert len(lines) == 2  # the healthy run's and this one's
  assert 'redone ' in lines[1]
  # Each recovery ran the steps from 21 to where it was detected (a log step) again.
  assert trainer.runner.clock.redone_steps >= 10 and trainer.runner.clock.shares()['redone'] > 0
  # The recoveries are in TensorBoard.
  from tensorboard.backend.event_processing import event_accumulator

  events = event_accumulator.EventAccumulator(
    str(tmp_path / 'tensorboard'), size_guidance={'tensors': 0}
  )
  events.Reload()
  tags = events.Tags()['tensors']
  assert 'recovery/recoveries' in tags and 'goodput/train' in tags
  counts = [float(tf.make_ndarray(e.tensor_proto)) for e in events.Tensors('recovery/recoveries')]
  assert counts == [1.0, 2.0]


def test_a_divergence_before_any_healthy_checkpoint_says_there_is_none(tmp_path, caplog):
  """No healthy checkpoint yet (a fresh run broken from its first step): the line said 'no
  recovery left (0 of config.train.recover_tries=3 done, ...)', as if the tries were used up."""
  broken = {**BROKEN, 'train.recover_tries': 3}
  del broken['train.accept_config_change']
  trainer = TinyTrainer(tiny_config(**broken), str(tmp_path))
  with caplog.at_level(logging.INFO), pytest.raises(CollapseError):
    trainer.train()
  said = [r.getMessage() for r in caplog.records if r.getMessage().startswith('divergence at ')]
  assert said and all(
    m.endswith(
      '; no checkpoint to recover to (0 of config.train.recover_tries=3 done, no '
      'healthy checkpoint yet)'
    )
    for m in said
  ), said


def test_recovery_gives_up_after_its_tries(tmp_path):
  healthy_run(tmp_path)
  trainer = TinyTrainer(tiny_config(**BROKEN, **{'train.recover_tries': 1}), str(tmp_path))
  with pytest.raises(CollapseError) as info:  # the learning rate stays 1e38: it fails again
    trainer.train()
  assert '(1 recoveries of config.train.recover_tries=1 done)' in str(info.value)
  assert trainer.runner.recovery.recoveries == 1


def test_health_test():
  h = health.Health()
  assert h.healthy(0) and not h.healthy(1)  # no loss logged (a custom step): its skips alone
  h.observe(2.0, diverged=False)
  assert h.healthy(0) and not h.healthy(1)  # a skipped step at the save
  h.observe(50.0, diverged=True)  # the divergence monitor's word (trainer/insight/divergence.py)
  assert not h.healthy(0) and h.loss == 50.0
  h.observe(float('nan'), diverged=False)  # a non-finite loss is never healthy
  assert not h.healthy(0)
  h.observe(1.0, diverged=False)
  assert h.healthy(0)


def test_a_network_that_stopped_learning_is_not_healthy():
  """A run at chance from step 50 (warm-up to learning rate 20) was healthy: its running minimum
  was 1.8. The divergence monitor now calls its training loss diverged
  (tests/insight/test_divergence.py replays it); an eval back near the loss at the first weights
  is not healthy either."""
  h = health.Health()
  h.observe_eval(0.4, first=2.3)  # learned: best eval 0.4
  assert h.healthy(0)
  h.observe_eval(1.0, first=2.3)  # worse, but keeps more than 3/4 of its gain (log units)
  assert h.healthy(0)
  h.observe_eval(2.29, first=2.3)  # back at the first weights' loss: stopped learning
  assert not h.healthy(0) and h.bad
  h.bad = False  # a recovery restored a healthy checkpoint
  assert h.healthy(0)
  h.observe_eval(float('nan'), first=None)  # a non-finite eval is never healthy
  assert not h.healthy(0)
  fresh = health.Health()
  fresh.observe_eval(2.29, first=2.3)  # no gain yet (an early eval): not judged
  assert fresh.healthy(0)
  assert health.DEFINITION.startswith('healthy = finite, its last step applied')


def test_a_run_whose_final_eval_fell_back_ends_with_exit_status_3():
  """health.check_end at the end of train(): the training losses looked fine to the monitor,
  but the final eval is back near the loss at the first weights."""
  monitor = DivergenceMonitor(10.0)
  monitor.start(2.3)
  h = health.Health()
  h.observe_eval(0.4, monitor.first)
  health.check_end(monitor, h, 0.4, 50, None)  # a good run: no error
  h.observe_eval(2.2, monitor.first)
  with pytest.raises(DivergenceError) as failed:
    health.check_end(monitor, h, 2.2, 100, {'checkpoint': 'ckpt-50', 'step': 50, 'loss': 0.41})
  assert failed.value.exit_status == 3
  assert str(failed.value) == (
    'step 100: the final eval loss 2.2 is back near the loss at the first weights 2.3 (best eval '
    '0.4): the network stopped learning; the checkpoint of step 100 is saved, last healthy: '
    'ckpt-50, step 50, loss 0.41; lower config.optimizer.learning_rate or add warm-up '
    '(config.optimizer.warmup_steps)'
  )


def test_goodput_shares_sum_to_one_and_count_compilation():
  clock = goodput.Clock(started=0.0)
  clock.started = __import__('time').perf_counter() - 10.0  # a 10 s run so far
  clock.steps(4.0, 10, clock.started + 1.0)  # first call: 1 s of steps + 3 s of compilation
  clock.steps(2.0, 20, clock.started + 5.0)  # 0.1 s a step
  clock.redone(5)
  clock.skipped_from = 7  # the run's skip counter when this process began
  clock.count_skipped(9)  # 2 steps skipped since: 0.2 s at 0.1 s a step
  clock.spent['eval'] += 1.0
  shares = clock.shares()
  assert sum(shares.values()) == pytest.approx(1.0)
  assert shares['startup'] == pytest.approx(0.1, abs=1e-3)
  assert shares['compile'] == pytest.approx(0.3, abs=1e-3)
  assert shares['redone'] == pytest.approx(0.05, abs=1e-3)
  assert shares['skipped'] == pytest.approx(0.02, abs=1e-3)
  assert shares['train'] == pytest.approx(0.23, abs=1e-3)  # 3 s of steps less 0.5 + 0.2 s
  assert clock.line(shares).startswith('goodput 23% of the wall time in train steps')
  clock.count_skipped(5)  # a recovery restored an older counter: no negative share
  assert clock.skipped_steps == 0 and clock.shares()['skipped'] == 0.0


def test_goodput_of_one_compiled_call_says_its_compilation_is_in_train():
  """A run of one compiled call (train.steps <= train.steps_per_loop) has no step rate to
  separate its compilation by: it logged 'train steps 61%; ... compile 0%'."""
  clock = goodput.Clock(started=0.0)
  clock.started = __import__('time').perf_counter() - 10.0
  clock.steps(4.0, 10, clock.started + 1.0)
  shares = clock.shares()
  assert shares['train'] == pytest.approx(0.4, abs=1e-3) and shares['compile'] == 0.0
  line = clock.line(shares)
  assert line.startswith('goodput 40% of the wall time in train steps and their compilation')
  assert 'compile 0%' not in line and 'startup 10%' in line
