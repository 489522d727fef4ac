"""numerics.every: per-layer gradient underflow (flushed, subnormal, exact zeros) and
activation headroom at log steps, checked against NumPy references."""

import math

import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from tiny import TinyTrainer, tiny_config
from trainer.insight import events


class Wide(TinyTrainer):
  """Dense 16 -> Dense 'loud' (outputs x 1e3) -> Dense 4; the loud layer's outputs sit close
  to float16's largest value."""

  def build_model(self):
    loud = keras.layers.Dense(
      16, name='loud', kernel_initializer=keras.initializers.Constant(1e3 / 16), use_bias=False
    )
    return keras.Sequential(
      [
        keras.Input((8,)),
        keras.layers.Dense(16, activation='relu'),
        loud,
        keras.layers.Dense(4, dtype='float32'),
      ],
      name='wide',
    )


def test_statistics_name_layers_and_are_written(tmp_path, caplog):
  trainer = Wide(
    tiny_config(**{'precision.policy': 'mixed_float16', 'numerics.every': 10, 'train.steps': 20}),
    str(tmp_path / 'w'),
  )
  with caplog.at_level('INFO'):
    trainer.train()
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith('numerics at')]
  # The first log step, then the first log step past each multiple of numerics.every.
  assert [l.split(':')[0] for l in lines] == [
    'numerics at step 5',
    'numerics at step 10',
    'numerics at step 20',
  ]
  assert 'least headroom wide/loud' in lines[0]
  stats, overall = trainer.runner.numerics.probe.measure()
  loud = stats['wide/loud']
  assert 0 < loud['headroom_bits'] < 10  # |outputs| ~ 1e3 x inputs: within 2^10 of 65504
  first = trainer.model.layers[0].path
  assert loud['headroom_bits'] < stats[first]['headroom_bits']
  assert all(0.0 <= overall[k] <= 1.0 for k in ('grad_flushed', 'grad_subnormal', 'grad_zero'))
  scalars = events.read_scalars(str(tmp_path / 'w'))
  assert [s for s, _ in scalars['numerics/wide/loud/headroom_bits']] == [5, 10, 20]
  assert {
    'numerics/gradient_flushed',
    'numerics/gradient_subnormal',
    'numerics/gradient_zero',
  } <= set(scalars)
  assert 'numerics/wide/loud/grad_flushed' in scalars
  # Finite outputs: output_nonfinite 0. Scaled by 1e3 more, the loud layer overflows float16:
  # its output_max and headroom_bits are not finite, and output_nonfinite tells TensorBoard.
  assert [v for _, v in scalars['numerics/wide/loud/output_nonfinite']] == [0.0] * 3
  trainer.model.get_layer('loud').kernel.assign(trainer.model.get_layer('loud').kernel * 1e3)
  stats, _ = trainer.runner.numerics.probe.measure()
  assert stats['wide/loud']['output_nonfinite'] == 1.0
  assert stats['wide/loud']['headroom_bits'] == -math.inf


def test_every_numerics_tag_names_its_layer_by_one_path_scheme(tmp_path):
  """Layers without weights (Dropout, Activation) have no Keras `path` (it is set when a build
  runs), and their tags were numerics/drop/... beside numerics/gappy/first/...: every layer's
  tags now carry its path in the model."""

  class Gappy(TinyTrainer):
    def build_model(self):
      return keras.Sequential(
        [
          keras.Input((8,)),
          keras.layers.Dense(16, name='first'),
          keras.layers.Dropout(0.1, name='drop'),
          keras.layers.Activation('relu', name='act'),
          keras.layers.Dense(4, dtype='float32', name='logits'),
        ],
        name='gappy',
      )

  trainer = Gappy(tiny_config(**{'numerics.every': 5, 'train.steps': 5}), str(tmp_path / 'w'))
  trainer.train()
  tags = set(events.read_scalars(str(tmp_path / 'w')))
  numerics = [t[len('numerics/') :] for t in tags if t.startswith('numerics/')]
  layers = {t.rsplit('/', 1)[0] for t in numerics if '/' in t}  # not gradient_flushed, ...
  assert layers == {'gappy/first', 'gappy/drop', 'gappy/act', 'gappy/logits'}, sorted(tags)
  assert {'numerics/gappy/drop/output_max', 'numerics/gappy/act/headroom_bits'} <= tags
  assert 'numerics/gappy/first/grad_flushed' in tags


def test_underflow_fraction_follows_the_scale(tmp_path):
  """float16 gradients of ~1e-6 (below the smallest normal, 6.1e-5) underflow at scale 1 and
  not at scale 2**15."""

  class Small(TinyTrainer):
    def compute_loss(self, batch, *, training):
      loss, metrics = super().compute_loss(batch, training=training)
      return loss * 1e-5, metrics

  fractions = {}
  for scale in ('1', '32768'):
    trainer = Small(
      tiny_config(**{'precision.policy': 'mixed_float16', 'precision.loss_scale': scale}),
      str(tmp_path / scale),
    )
    from trainer.insight.numerics import Probe

    stats, overall = Probe(trainer).measure(next(iter(trainer.datasets.train)))
    layer = stats[trainer.model.layers[0].path]
    fractions[scale] = layer['grad_flushed'] + layer['grad_subnormal']
  assert fractions['1'] > 0.5 and fractions['32768'] < 0.1, fractions


def test_the_probe_runs_eagerly_first_then_compiled_with_the_same_numbers(tmp_path):
  """The tests above check the eager measurements (the first ones) against references; the
  compiled ones, after EAGER_CALLS, give the same numbers: float16 gradients of ~1e-6 at scale
  1, partly flushed and partly subnormal, and the loud layer's headroom."""
  from trainer.insight import numerics

  class Small(Wide):
    def compute_loss(self, batch, *, training):
      loss, metrics = super().compute_loss(batch, training=training)
      return loss * 1e-5, metrics

  trainer = Small(
    tiny_config(**{'precision.policy': 'mixed_float16', 'precision.loss_scale': '1'}),
    str(tmp_path / 'w'),
  )
  probe = numerics.Probe(trainer)
  probe._fn.eager_seconds = float('inf')  # the count alone decides here
  batch = next(iter(trainer.datasets.train))
  eager = [probe.measure(batch) for _ in range(numerics.EAGER_CALLS)]
  assert probe._fn.compiled.experimental_get_tracing_count() == 0
  compiled = probe.measure(batch)
  assert probe._fn.compiled.experimental_get_tracing_count() == 1
  assert all(e == eager[0] for e in eager)
  stats, overall = compiled
  assert overall['grad_flushed'] > 0 and overall['grad_subnormal'] > 0, overall
  assert compiled == eager[0]


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


def test_a_failing_probe_is_one_line_and_turns_numerics_off(tmp_path):
  """Diagnostics never end a run: the probe raising (here with an empty message) gives the
  line naming the exception and numerics.every = 0 for the rest of the run."""
  trainer = TinyTrainer(tiny_config(), str(tmp_path / 'w'))
  recorder = trainer.runner.numerics

  class Failing:
    def measure(self):
      raise RuntimeError()

  recorder.probe = Failing()
  out = recorder.record(3)
  assert out['stats'] == {} and recorder.every == 0
  assert out['line'] == (
    'numerics at step 3: the statistics probe failed (RuntimeError: ); numerics.every is off '
    'for this run'
  )


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
  np.testing.assert_allclose(
    stats[first.path]['grad_max'], float(tf.reduce_max(tf.abs(kernel))), rtol=1e-5
  )


# ---- underflow = what the precision loses, against a NumPy float16 / bfloat16 emulation -------

# Per output unit j the loss weighs the (float16) Dense output by C[j], log-uniform from 1e-14 to
# 1e-2: each column of the kernel gradient is C[j] / batch x scale x (sum of inputs), so the
# columns whose upstream gradient flushes to zero depend on the scale.
UNITS = 64
C = np.logspace(-14, -2, UNITS).astype(np.float32)


class Spread(TinyTrainer):
  def build_model(self):
    return keras.Sequential(
      [keras.Input((8,)), keras.layers.Dense(UNITS, name='spread')], name='spread_model'
    )

  def compute_loss(self, batch, *, training):
    x, _ = batch
    out = tf.cast(self.model(x, training=training), tf.float32)
    return tf.reduce_sum(out * C, axis=-1), {}


def reference_counts(x, scale, dtype):
  """NumPy: (flushed, subnormal, zero, total) of the Dense's kernel and bias gradients for
  batch `x` at loss scale `scale`, computed as the compute dtype `dtype` rounds them (products
  summed in float64, rounded once), against float64 (the float32 computation)."""
  upstream32 = C.astype(np.float64) * scale / len(x)  # d loss / d out, float32 side
  upstream = upstream32.astype(dtype)  # the Cast's gradient into the compute dtype
  x_low = x.astype(dtype).astype(np.float64)
  grads = [
    (x_low.T @ np.tile(upstream.astype(np.float64), (len(x), 1))).astype(dtype),
    (len(x) * upstream.astype(np.float64)).astype(dtype),
  ]
  grads32 = [x.astype(np.float64).T @ np.tile(upstream32, (len(x), 1)), len(x) * upstream32]
  tiny = float(ml_dtypes.finfo(dtype).tiny)
  flushed = sum(int(np.sum((g.astype(np.float64) == 0) & (r != 0))) for g, r in zip(grads, grads32))
  subnormal = sum(int(np.sum((g != 0) & (np.abs(g.astype(np.float64)) < tiny))) for g in grads)
  zero = sum(int(np.sum(r == 0)) for r in grads32)
  return flushed, subnormal, zero, sum(g.size for g in grads)


@pytest.mark.parametrize(
  'policy, loss_scale, scale, dtype',
  [
    ('mixed_float16', 'none', 1.0, np.float16),
    ('mixed_float16', '32768', 32768.0, np.float16),
    ('mixed_bfloat16', 'none', 1.0, ml_dtypes.bfloat16),
  ],
)
def test_flushed_fraction_matches_a_numpy_reference(tmp_path, policy, loss_scale, scale, dtype):
  from trainer.insight.numerics import Probe, summary_line

  trainer = Spread(
    tiny_config(**{'precision.policy': policy, 'precision.loss_scale': loss_scale}),
    str(tmp_path / 'w'),
  )
  batch = next(iter(trainer.datasets.train))
  stats, overall = Probe(trainer).measure(batch)
  flushed, subnormal, zero, total = reference_counts(batch[0].numpy(), scale, dtype)
  layer = stats['spread_model/spread']
  print(policy, loss_scale, 'probe', layer, 'numpy', flushed / total, subnormal / total)
  if dtype is np.float16:
    assert flushed / total > 0.2  # the case is not vacuous
    assert layer['grad_flushed'] == pytest.approx(flushed / total, rel=0.1)
    assert layer['grad_subnormal'] == pytest.approx(subnormal / total, rel=0.1)
  else:
    assert flushed == 0 and layer['grad_flushed'] == 0.0  # bfloat16: float32's range
  assert layer['grad_zero'] == zero / total == 0.0  # nothing is zero in float32 here
  assert overall['grad_flushed'] == layer['grad_flushed']  # the only layer
  line = summary_line(
    7,
    stats,
    overall,
    scale=None if loss_scale == 'none' else scale,
    dtypes=Probe(trainer).low_precision,
  )
  if dtype is np.float16:
    assert f'flushed to zero {100 * layer["grad_flushed"]:.1f} %' in line, line
    assert ('at loss scale 32768' in line) == (loss_scale != 'none'), line
    assert 'most flushed spread_model/spread' in line
  else:
    assert 'range is not the issue under bfloat16' in line and 'gradients flushed' not in line


def test_exact_zeros_are_not_underflow(tmp_path):
  """Dead ReLU units give exact zeros in float32 too: counted as zeros, not as flushed."""

  class Dead(TinyTrainer):
    def build_model(self):
      return keras.Sequential(
        [
          keras.Input((8,)),
          keras.layers.Dense(
            16,
            activation='relu',
            bias_initializer=keras.initializers.Constant([-100.0] * 8 + [0.0] * 8),
          ),  # 8 of 16 units never fire
          keras.layers.Dense(4, dtype='float32'),
        ],
        name='dead',
      )

  trainer = Dead(tiny_config(**{'precision.policy': 'mixed_float16'}), str(tmp_path / 'w'))
  from trainer.insight.numerics import Probe

  batch = next(iter(trainer.datasets.train))
  stats, _ = Probe(trainer).measure(batch)
  first = trainer.model.layers[0]
  with tf.GradientTape() as tape:  # a plain float32 reference: which kernel entries are zero
    x = tf.cast(batch[0][:32], tf.float32)
    h = tf.nn.relu(x @ first.kernel + first.bias)
    loss = tf.reduce_sum(h)
  grads = tape.gradient(loss, [first.kernel, first.bias])
  zero = sum(int(np.sum(g.numpy() == 0)) for g in grads) / (8 * 16 + 16)
  assert zero >= 8 * 9 / (8 * 16 + 16)  # the dead units' kernel columns and biases
  assert stats[first.path]['grad_zero'] == pytest.approx(zero, abs=1e-6)
  assert stats[first.path]['grad_flushed'] == 0.0


def test_a_run_shorter_than_numerics_every_shows_the_line_once(tmp_path, caplog):
  trainer = TinyTrainer(tiny_config(**{'train.steps': 15}), str(tmp_path / 'w'))
  assert trainer.config.numerics.every == 1000  # the default
  with caplog.at_level('INFO'):
    trainer.train()
  lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith('numerics at')]
  assert len(lines) == 1 and lines[0].startswith('numerics at step 5:'), lines


def test_activation_flushed_and_subnormal_match_a_numpy_reference(tmp_path):
  """A Dense layer whose output columns are scaled from 1e-12 to 1e-2: in float16 some outputs
  flush to zero and some are subnormal. NumPy: float16 inputs and kernel, products summed in
  float64 and rounded once, against float64."""
  from trainer.insight.numerics import Probe

  scales = np.logspace(-12, -2, UNITS)

  class Quiet(TinyTrainer):
    def build_model(self):
      kernel = np.ones((8, UNITS)) * scales
      return keras.Sequential(
        [
          keras.Input((8,)),
          keras.layers.Dense(
            UNITS,
            name='quiet',
            kernel_initializer=keras.initializers.Constant(kernel),
            use_bias=False,
          ),
        ],
        name='quiet_model',
      )

    def compute_loss(self, batch, *, training):
      x, _ = batch
      out = tf.cast(self.model(x, training=training), tf.float32)
      return tf.reduce_sum(out, axis=-1), {}

  trainer = Quiet(tiny_config(**{'precision.policy': 'mixed_float16'}), str(tmp_path / 'w'))
  batch = next(iter(trainer.datasets.train))
  stats, _ = Probe(trainer).measure(batch)
  x = batch[0].numpy()[:32].astype(np.float64)
  kernel = trainer.model.layers[0].kernel.numpy()
  out16 = (
    (x.astype(np.float16).astype(np.float64) @ kernel.astype(np.float16).astype(np.float64))
    .astype(np.float16)
    .astype(np.float64)
  )
  out32 = x @ kernel.astype(np.float64)
  tiny = float(np.finfo(np.float16).tiny)
  flushed = np.mean((out16 == 0) & (out32 != 0) & (np.abs(out32) < tiny))
  subnormal = np.mean((out16 != 0) & (np.abs(out16) < tiny))
  entry = stats['quiet_model/quiet']
  print('probe', entry, 'numpy', flushed, subnormal)
  assert flushed > 0.1 and subnormal > 0.1  # not vacuous
  assert entry['output_flushed'] == pytest.approx(flushed, rel=0.1)
  assert entry['output_subnormal'] == pytest.approx(subnormal, rel=0.1)


def test_the_probe_leaves_a_resume_bit_identical(tmp_path):
  """The numerics line runs at the first log step; its probe reads the first eval batch, never
  the train pipeline (a second iterator over a shuffled train set changed the order the
  training iterator saw: resumed runs differed from uninterrupted ones 2 times in 3)."""
  from tiny import weights

  def config(steps):
    return tiny_config(**{'train.deterministic': True, 'train.steps': steps, 'numerics.every': 5})

  for trial in range(2):
    resumed, straight = tmp_path / f'resumed{trial}', tmp_path / f'straight{trial}'
    TinyTrainer(config(10), str(resumed)).train()
    a = TinyTrainer(config(25), str(resumed))
    a.train()
    b = TinyTrainer(config(25), str(straight))
    b.train()
    for x, y in zip(weights(a), weights(b)):
      np.testing.assert_array_equal(x, y)


def test_the_line_names_layers_in_the_models_order_and_says_which_outputs_are_not_finite():
  """Four layers all 100 % non-finite: the line named the alphabet's last three and left out
  the first layer (the culprit) without 'and 1 more'; a non-finite output read '-inf doublings
  to overflow' in the least-headroom part."""
  from trainer.insight.numerics import summary_line

  inf = float('inf')
  stats = {
    'net/big': {'grad_nonfinite': 1.0, 'headroom_bits': -inf},
    'net/norm': {'grad_nonfinite': 1.0, 'headroom_bits': -inf},
    'net/hidden': {'grad_nonfinite': 1.0, 'headroom_bits': 3.0},
    'net/head': {'grad_nonfinite': 0.5, 'headroom_bits': 100.0},
  }
  overall = {'grad_flushed': 0.0, 'grad_subnormal': 0.0, 'grad_zero': 0.0, 'grad_nonfinite': 0.9}
  line = summary_line(3, stats, overall, scale=1024.0, dtypes=['float16'])
  assert (
    'non-finite gradients in net/big, net/norm, net/hidden and 1 more; non-finite outputs '
    'in net/big, net/norm; least headroom net/hidden (3.0 doublings to overflow)'
  ) in line
