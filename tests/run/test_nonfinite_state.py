"""A non-finite state is caught where it starts and recovered from (issue 35).

A finite step can leave an optimizer slot non-finite (a gradient above ~1.8e19 squares to inf in
Adam's second moment), and a NaN put in a weight behind a ReLU trains on with a finite loss. The
first is caught at the end of that step's compiled call (trainer/step/step_state.py), a
non-finite state at a save too; both are recovery triggers like a collapse (trainer/run/
recovery.py), never a stop with train.recover_tries unused."""

import logging
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.errors import NonFiniteError

from tiny import TinyTrainer, tiny_config, weights

FAST = {'train.log_every': 5, 'train.checkpoint_every': 10, 'train.steps_per_loop': 5}


class SpikeTrainer(TinyTrainer):
  """Batch number `SPIKE` of the train set (counted from the start of the data: a fresh run's
  step) has its inputs x 1e20: every gradient finite, some above 1.8e19."""

  SPIKE = 7

  def build_datasets(self):
    datasets = super().build_datasets()
    spike = self.SPIKE

    def scaled(index, batch):
      x, y = batch
      return tf.where(index == spike, x * 1e20, x), y

    return datasets._replace(train=datasets.train.enumerate().map(scaled))


class PlantNaN:
  """An action: at the progress line of step `at`, once, a NaN in the first layer's bias."""

  def __init__(self, at):
    self.at, self.done = at, False

  def __call__(self, event):
    if event.kind == 'log' and event.step == self.at and not self.done:
      self.done = True
      bias = event.trainer.model.layers[0].bias
      bias.assign(tf.tensor_scatter_nd_update(bias, [[0]], [float('nan')]))


def recoveries(caplog):
  return [r.getMessage() for r in caplog.records if r.getMessage().startswith('recovery ')]


@pytest.mark.parametrize('steps_per_loop', [5, 1])
def test_a_finite_step_that_overflows_a_slot_stops_at_the_end_of_its_call(tmp_path, steps_per_loop):
  config = tiny_config(**{**FAST, 'train.steps_per_loop': steps_per_loop})
  trainer = SpikeTrainer(config, str(tmp_path))
  with pytest.raises(NonFiniteError) as info:
    trainer.train()
  message = str(info.value)
  assert '\n' not in message
  # The spike's call (its step alone when a call is one step), not the save at step 10 that
  # found it before.
  expected = (
    'steps 5-9: the training state is not finite after the updates of these steps'
    if steps_per_loop == 5
    else 'step 7: the training state is not finite after its update'
  )
  assert message.startswith(expected), message
  assert 'velocity' in message
  # The loop stopped at the end of that call.
  assert int(trainer.global_step.numpy()) == (10 if steps_per_loop == 5 else 8)


def test_a_slot_overflow_is_recovered_from(tmp_path, caplog):
  SpikeTrainer.SPIKE = 27
  try:
    trainer = SpikeTrainer(
      tiny_config(**FAST, **{'train.steps': 40, 'train.recover_tries': 1}), str(tmp_path)
    )
    with caplog.at_level(logging.INFO):
      metrics = trainer.train()
  finally:
    SpikeTrainer.SPIKE = 7
  lines = recoveries(caplog)
  assert len(lines) == 1 and 'steps 25-29: the training state is not finite' in lines[0], lines
  assert 'last healthy: ckpt-20, step 20' in lines[0]
  assert int(trainer.global_step.numpy()) == 40 and math.isfinite(metrics['loss'])
  assert all(np.isfinite(w).all() for w in weights(trainer))


class Pooled(TinyTrainer):
  """Dense 16 relu, max-pooled in pairs, Dense 4: a max-pool drops a NaN (as a CNN's does), so a
  NaN in the first bias trains on silently: finite loss, finite gradients, 0 skips."""

  def build_model(self):
    return keras.Sequential(
      [
        keras.Input((8,)),
        keras.layers.Dense(16, activation='relu'),
        keras.layers.Reshape((16, 1)),
        keras.layers.MaxPooling1D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(4, dtype='float32'),
      ],
      name='pooled',
    )


@pytest.mark.parametrize('at', [25, 30])  # caught at the end of the next call; by the save at 30
def test_a_nan_planted_in_a_weight_is_recovered_from(tmp_path, caplog, at):
  class Planted(Pooled):
    def build_actions(self):
      return [PlantNaN(at)]

  trainer = Planted(
    tiny_config(**FAST, **{'train.steps': 40, 'train.recover_tries': 1}), str(tmp_path)
  )
  with caplog.at_level(logging.INFO):
    metrics = trainer.train()
  lines = recoveries(caplog)
  assert len(lines) == 1 and 'the training state is not finite' in lines[0], lines
  assert '/bias' in lines[0] and ('after the updates of these steps' in lines[0]) == (at == 25), (
    lines
  )
  # Named as at a call, by Keras's path (the save read the tf.Variable, named '...:0').
  assert trainer.model.layers[0].bias.path in lines[0] and ':0' not in lines[0], lines
  assert int(trainer.global_step.numpy()) == 40 and math.isfinite(metrics['loss'])
  assert all(np.isfinite(w).all() for w in weights(trainer))


def test_a_nan_found_by_a_save_gets_advice_for_a_write_between_steps(tmp_path):
  """The save at step 10 finds the NaN an action put in the bias at step 10's progress line:
  the step's own check had found the update finite, so the advice is that write, not a learning
  rate or a loss scale (a float32 run)."""

  class Planted(Pooled):
    def build_actions(self):
      return [PlantNaN(10)]

  trainer = Planted(tiny_config(**FAST), str(tmp_path))
  with pytest.raises(NonFiniteError) as info:
    trainer.train()
  message = str(info.value)
  assert message.startswith('step 10: the training state is not finite'), message
  assert f'first: {trainer.model.layers[0].bias.path});' in message, message
  assert 'so something between the steps wrote them: an action, a callback' in message
  assert 'loss scale' not in message and 'learning_rate' not in message


def test_no_healthy_checkpoint_says_why_no_try_could_help(tmp_path):
  trainer = SpikeTrainer(tiny_config(**FAST, **{'train.recover_tries': 2}), str(tmp_path))
  with pytest.raises(NonFiniteError) as info:
    trainer.train()
  assert 'recover_tries=2: no recovery, for no checkpoint of this run is healthy' in str(info.value)
