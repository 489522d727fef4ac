"""numerics.every: per-layer gradient underflow and activation headroom at log steps."""

import keras
import numpy as np

from tiny import TinyTrainer, tiny_config
from trainer.insight import events


class Wide(TinyTrainer):
  """Dense 16 -> Dense 'loud' (outputs x 1e3) -> Dense 4; the loud layer's outputs sit close
  to float16's largest value."""

  def build_model(self):
    loud = keras.layers.Dense(16, name='loud', kernel_initializer=keras.initializers.Constant(
        1e3 / 16), use_bias=False)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation='relu'), loud,
                             keras.layers.Dense(4, dtype='float32')], name='wide')


def test_statistics_name_layers_and_are_written(tmp_path, caplog):
  trainer = Wide(tiny_config(**{'precision.policy': 'mixed_float16', 'numerics.every': 10,
                                'train.steps': 20}), str(tmp_path / 'w'))
  with caplog.at_level('INFO'):
    trainer.train()
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith('numerics at')]
  assert [l.split(':')[0] for l in lines] == ['numerics at step 10', 'numerics at step 20']
  assert 'least headroom wide/loud' in lines[0]
  stats, overall = trainer.runner.numerics.probe.measure()
  loud = stats['wide/loud']
  assert 0 < loud['headroom_bits'] < 10  # |outputs| ~ 1e3 x inputs: within 2^10 of 65504
  first = trainer.model.layers[0].path
  assert loud['headroom_bits'] < stats[first]['headroom_bits']
  assert 0.0 <= overall <= 1.0 and all(0 <= v['grad_underflow'] <= 1 for v in stats.values()
                                       if 'grad_underflow' in v)
  scalars = events.read_scalars(str(tmp_path / 'w'))
  assert [s for s, _ in scalars['numerics/wide/loud/headroom_bits']] == [10, 20]
  assert 'numerics/gradient_underflow' in scalars


def test_underflow_fraction_follows_the_scale(tmp_path):
  """float16 gradients of ~1e-6 (below the smallest normal, 6.1e-5) underflow at scale 1 and
  not at scale 2**15."""

  class Small(TinyTrainer):
    def compute_loss(self, batch, *, training):
      loss, metrics = super().compute_loss(batch, training=training)
      return loss * 1e-5, metrics

  fractions = {}
  for scale in ('1', '32768'):
    trainer = Small(tiny_config(**{'precision.policy': 'mixed_float16',
                                   'precision.loss_scale': scale}), str(tmp_path / scale))
    from trainer.insight.numerics import Probe
    stats, overall = Probe(trainer).measure(next(iter(trainer.datasets.train)))
    fractions[scale] = stats[trainer.model.layers[0].path]['grad_underflow']
  assert fractions['1'] > 0.5 and fractions['32768'] < 0.1, fractions


def test_probe_leaves_weights_state_and_training_order_alone(tmp_path):
  from test_trainer_contract import BatchNormTrainer
  trainer = BatchNormTrainer(tiny_config(), str(tmp_path / 'w'))
  before = [v.numpy().copy() for v in trainer.model.variables]
  from trainer.insight.numerics import Probe
  Probe(trainer).measure()
  for a, v in zip(before, trainer.model.variables):
    np.testing.assert_array_equal(a, v.numpy())


def test_off_builds_nothing(tmp_path):
  trainer = TinyTrainer(tiny_config(**{'numerics.every': 0}), str(tmp_path / 'w'))
  trainer.train()
  assert trainer.runner.numerics.probe is None


def test_probe_measures_one_micro_batch_as_the_step_computes_it(tmp_path):
  """With grad_accum_steps=4 a step's weight gradients each sum 8 of the 32 examples (loss /
  32): the probe measures those, not the whole batch's (4x larger, underflow under-reported)."""
  import tensorflow as tf
  from trainer.insight.numerics import Probe
  trainer = TinyTrainer(tiny_config(**{'train.grad_accum_steps': 4}), str(tmp_path / 'w'))
  batch = next(iter(trainer.datasets.train))
  stats, _ = Probe(trainer).measure(batch)
  first = trainer.model.layers[0]
  micro = tf.nest.map_structure(lambda t: t[:8], batch)
  with tf.GradientTape() as tape:
    per_example, _ = trainer.compute_loss(micro, training=True)
    loss = tf.reduce_sum(per_example) / 32
  kernel = tape.gradient(loss, first.kernel)
  np.testing.assert_allclose(stats[first.path]['grad_max'],
                             float(tf.reduce_max(tf.abs(kernel))), rtol=1e-5)
