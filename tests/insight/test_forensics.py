"""trainer/insight/forensics.py: the eager replay names the layer where float16 overflowed, forward
or backward; forensic folders save and replay; launch.py --mode=diagnose."""

import json
import math
import os
import subprocess
import sys
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.insight import forensics

from conftest import ROOT

SCALE = 32768.0


@pytest.fixture
def mixed_float16():
  keras.mixed_precision.set_global_policy('mixed_float16')
  yield
  keras.mixed_precision.set_global_policy('float32')


def _batch(seed=0, n=32):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(n, 16)).astype(np.float32), rng.integers(0, 4, size=n).astype(np.int32))


def _loss_fn(model):
  def compute_loss(batch, *, training):
    x, y = batch
    logits = tf.cast(model(x, training=training), tf.float32)
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True), {}

  return compute_loss


def forward_model(seed=0):
  """'culprit' (Dense, huge weights) feeds a LayerNormalization: fine in float32, its float16
  output passes 65504."""
  return keras.Sequential(
    [
      keras.Input((16,)),
      keras.layers.Dense(
        32, name='early', kernel_initializer=keras.initializers.GlorotUniform(seed)
      ),
      keras.layers.Dense(
        32,
        name='culprit',
        kernel_initializer=keras.initializers.RandomNormal(stddev=1e4, seed=seed),
      ),
      keras.layers.LayerNormalization(name='norm'),
      keras.layers.Dense(
        4,
        dtype='float32',
        name='logits',
        kernel_initializer=keras.initializers.GlorotUniform(seed + 1),
      ),
    ],
    name='forward_overflow',
  )


def backward_model(seed=0):
  """Forward values fit float16; 'amplifier' (2000 x identity) multiplies the gradient it passes
  back by 2000, past 65504 at loss scale 32768 (not at scale 1)."""
  return keras.Sequential(
    [
      keras.Input((16,)),
      keras.layers.Dense(
        16,
        activation='relu',
        name='early',
        kernel_initializer=keras.initializers.GlorotUniform(seed),
      ),
      keras.layers.Dense(
        16, name='amplifier', kernel_initializer=keras.initializers.Identity(gain=2000.0)
      ),
      keras.layers.Dense(
        4,
        dtype='float32',
        name='logits',
        kernel_initializer=keras.initializers.GlorotUniform(seed + 1),
      ),
    ],
    name='backward_overflow',
  )


class Block(keras.layers.Layer):
  """A subclassed layer holding the culprit: the report must name the layer inside it."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.inner = keras.layers.Dense(
      32, name='culprit', kernel_initializer=keras.initializers.RandomNormal(stddev=1e4, seed=3)
    )
    self.norm = keras.layers.LayerNormalization(name='inner_norm')

  def call(self, x):
    return self.norm(self.inner(x))


class Net(keras.Model):
  def __init__(self):
    super().__init__(name='subclassed')
    self.early = keras.layers.Dense(32, name='early')
    self.block = Block(name='block')
    self.head = keras.layers.Dense(4, dtype='float32', name='logits')

  def call(self, x):
    return self.head(self.block(self.early(x)))


def test_forward_overflow_names_the_culprit(mixed_float16):
  model = forward_model()
  report = forensics.replay(model, _loss_fn(model), _batch(), loss_scale=SCALE)
  assert (report.phase, report.layer, report.layer_class, report.tensor) == (
    'forward',
    'forward_overflow/culprit',  # its path in the model (trainer/nn/paths.py)
    'Dense',
    'output',
  )
  assert report.op == 'MatMul'  # check_numerics on the replay names the op
  assert report.dtype == 'float16' and report.max_abs_float32 > 65504
  assert report.line().startswith(
    "first non-finite: forward output of 'forward_overflow/culprit' (Dense)"
  )
  assert '> float16 max 65504' in report.line()


class ExpGate(keras.layers.Layer):
  """h * 16 * softmax(2h), the softmax written as exp / sum in the compute dtype: exp(2h)
  overflows float16 once h > 5.5 while the layer's output stays below 16 max |h|."""

  def call(self, h):
    e = tf.exp(2.0 * h)
    return h * 16.0 * (e / tf.reduce_sum(e, axis=-1, keepdims=True))


def test_an_overflow_inside_a_layer_reports_the_ops_own_value(mixed_float16):
  """The gate's output fits float16 in float32; its Exp does not. The report gives both, each
  equal to a NumPy float64 computation from the gate's float16 input."""
  model = keras.Sequential(
    [
      keras.Input((16,)),
      keras.layers.Dense(
        16, name='proj', kernel_initializer=keras.initializers.RandomNormal(stddev=2.0, seed=0)
      ),
      ExpGate(name='gate'),
      keras.layers.Dense(4, dtype='float32', name='logits'),
    ],
    name='gated',
  )
  x, y = _batch()
  report = forensics.replay(model, _loss_fn(model), (x, y), loss_scale=SCALE)
  assert (report.phase, report.layer, report.tensor, report.op) == (
    'forward',
    'gated/gate',
    'output',
    'Exp',
  )
  h = model.get_layer('proj')(x).numpy().astype(np.float64)  # float16, as the gate got it
  e = np.exp(2.0 * h)
  out = h * 16.0 * e / e.sum(-1, keepdims=True)
  assert report.op_max_abs_float32 == pytest.approx(e.max(), rel=1e-5)
  assert report.max_abs_float32 == pytest.approx(np.abs(out).max(), rel=1e-3)
  assert report.op_max_abs_float32 > 65504 > report.max_abs_float32
  assert f'op Exp: max {e.max():.2g} > float16 max 65504' in report.line()
  assert "the layer's output: max |x|" in report.line()


class MaskThenOverflow(keras.layers.Layer):
  """An intended -inf (a mask: non-finite in float32 too) before a real float16 overflow
  (h * 1e4, finite in float32): the overflow is the op to blame."""

  def call(self, h):
    mask = tf.where(h > 0, tf.zeros_like(h), tf.fill(tf.shape(h), tf.constant(-np.inf, h.dtype)))
    return tf.nn.softmax(h * 1e4 + mask)


class TracedExpGate(keras.layers.Layer):
  """ExpGate's math inside a tf.function: its ops reach the op callback as one function."""

  def call(self, h):
    return _traced_gate(h)


@tf.function
def _traced_gate(h):
  e = tf.exp(2.0 * h)
  return h * 16.0 * (e / tf.reduce_sum(e, axis=-1, keepdims=True))


def _gated(layer):
  return keras.Sequential(
    [
      keras.Input((16,)),
      keras.layers.Dense(
        16, name='proj', kernel_initializer=keras.initializers.RandomNormal(stddev=2.0, seed=0)
      ),
      layer,
      keras.layers.Dense(4, dtype='float32', name='logits'),
    ],
    name='gated',
  )


def test_an_intended_infinity_is_passed_over_for_the_real_overflow(mixed_float16):
  model = _gated(MaskThenOverflow(name='masked'))
  x, y = _batch()
  report = forensics.replay(model, _loss_fn(model), (x, y), loss_scale=SCALE)
  assert (report.layer, report.op) == ('gated/masked', 'Mul'), report.line()
  h = model.get_layer('proj')(x).numpy().astype(np.float64)
  assert report.op_max_abs_float32 == pytest.approx(np.abs(h * 1e4).max(), rel=1e-5)
  assert report.op_max_abs_float32 > 65504


def test_a_traced_function_inside_a_layer_is_not_named_as_the_op(mixed_float16):
  model = _gated(TracedExpGate(name='gate'))
  report = forensics.replay(model, _loss_fn(model), _batch(), loss_scale=SCALE)
  assert (report.phase, report.layer) == ('forward', 'gated/gate')
  assert not report.op.startswith('__'), report.line()  # not '__inference__traced_gate_12'
  assert report.op_max_abs_float32 is None


def test_a_weight_gradient_overflow_names_each_variable_and_whose_value_it_gives(mixed_float16):
  """Both of 'proj''s weight gradients overflow (batch sums of a finite float16 output
  gradient): the report lists both; the op's value and the largest weight gradient, with its
  variable, equal x^T dy and sum(dy) from the step's own float16 dy, in NumPy float64."""
  model = keras.Sequential(
    [
      keras.Input((16,)),
      keras.layers.Dense(16, name='proj', kernel_initializer=keras.initializers.GlorotUniform(0)),
      keras.layers.Dense(
        4, dtype='float32', name='logits', kernel_initializer=keras.initializers.GlorotUniform(1)
      ),
    ],
    name='wg',
  )
  x, y = _batch(n=256)
  scale = 2.0**21
  report = forensics.replay(model, _loss_fn(model), (x, y), loss_scale=scale)
  assert (report.phase, report.layer, report.tensor) == ('backward', 'wg/proj', 'weight gradient')
  assert report.detail == 'wg/proj/kernel, wg/proj/bias'
  proj, logits = model.layers
  with tf.GradientTape() as tape:
    h = proj(x)
    tape.watch(h)
    per_example = keras.losses.sparse_categorical_crossentropy(
      y, tf.cast(logits(h), tf.float32), from_logits=True
    )
    scaled = tf.reduce_mean(per_example) * scale
  dy = tape.gradient(scaled, h)
  assert dy.dtype == tf.float16 and bool(tf.reduce_all(tf.math.is_finite(dy)))
  dy = dy.numpy().astype(np.float64)
  dw, db = np.abs(x.astype(np.float64).T @ dy).max(), np.abs(dy.sum(0)).max()
  assert min(dw, db) > 65504
  assert report.largest_of == ('wg/proj/kernel' if dw > db else 'wg/proj/bias')
  assert report.max_abs_float32 == pytest.approx(max(dw, db), rel=1e-4)
  assert report.op in ('BiasAddGrad', 'MatMul')  # the first of the two computed
  assert report.op_max_abs_float32 == pytest.approx(
    db if report.op == 'BiasAddGrad' else dw, rel=1e-4
  )
  assert f"the layer's weight gradient ({report.largest_of}): max |dw|" in report.line()


def test_a_report_with_a_nan_loss_is_valid_json():
  report = forensics.Report('forward', tensor='loss', loss=float('nan'), max_abs_float32=math.inf)
  again = json.loads(json.dumps(report.to_json(), allow_nan=False))
  assert (again['loss'], again['max_abs_float32']) == ('nan', 'inf')
  assert math.isnan(float(again['loss']))


def test_forward_model_is_finite_in_float32():
  model = forward_model()  # the same weights under float32: the overflow is float16's range
  report = forensics.replay(model, _loss_fn(model), _batch(), loss_scale=SCALE)
  assert report.phase == '' and 'replay finite' in report.line()


def test_backward_overflow_names_the_layer_whose_input_gradient_overflowed(mixed_float16):
  model = backward_model()
  report = forensics.replay(model, _loss_fn(model), _batch(), loss_scale=SCALE)
  assert (report.phase, report.layer, report.tensor) == (
    'backward',
    'backward_overflow/amplifier',
    'input gradient',
  )
  assert np.isfinite(report.loss)  # the forward pass was finite
  assert report.max_abs_float32 > 65504
  assert "backward input gradient of 'backward_overflow/amplifier' (Dense)" in report.line()
  assert 'at loss scale 32768' in report.line()
  # The same step at scale 1 is finite: the overflow was the scale's.
  assert forensics.replay(model, _loss_fn(model), _batch(), loss_scale=1.0).phase == ''


def test_nested_subclassed_model_names_the_innermost_layer(mixed_float16):
  model = Net()
  model(_batch()[0])  # build
  report = forensics.replay(model, _loss_fn(model), _batch(), loss_scale=SCALE)
  assert (report.phase, report.layer, report.layer_class) == (
    'forward',
    'subclassed/block/culprit',
    'Dense',
  )
  # The hooks are gone afterwards: the layers' own call runs again.
  assert all('call' not in layer.__dict__ for layer in model._flatten_layers())


class AmplifierBlock(keras.layers.Layer):
  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.inner = keras.layers.Dense(
      16, name='amplifier', kernel_initializer=keras.initializers.Identity(gain=2000.0)
    )

  def call(self, x):
    return self.inner(x)


def test_nested_backward_overflow_names_the_innermost_layer(mixed_float16):
  inputs = keras.Input((16,))
  x = keras.layers.Dense(
    16, activation='relu', name='early', kernel_initializer=keras.initializers.GlorotUniform(0)
  )(inputs)
  x = AmplifierBlock(name='block')(x)
  outputs = keras.layers.Dense(
    4, dtype='float32', name='logits', kernel_initializer=keras.initializers.GlorotUniform(1)
  )(x)
  model = keras.Model(inputs, outputs, name='functional')
  report = forensics.replay(model, _loss_fn(model), _batch(), loss_scale=SCALE)
  assert (report.phase, report.layer, report.tensor) == (
    'backward',
    'functional/block/amplifier',
    'input gradient',
  )


def test_a_non_finite_batch_is_named_as_such(mixed_float16):
  model = forward_model()
  x, y = _batch()
  x[3, 2] = np.nan
  report = forensics.replay(model, _loss_fn(model), (x, y))
  assert report.tensor == 'input' and 'batch' in report.line()


@pytest.mark.parametrize('build', [forward_model, backward_model])
def test_saved_folder_replays_to_the_same_report(build, tmp_path, mixed_float16):
  model = build(seed=0)
  batch = _batch(seed=5)
  original = forensics.replay(model, _loss_fn(model), batch, loss_scale=SCALE)
  folder = forensics.save(
    str(tmp_path / 'step-7'),
    model=model,
    batch=batch,
    loss_scale=SCALE,
    step=7,
    policy='mixed_float16',
    report=original,
  )
  assert sorted(os.listdir(folder)) == [
    'batch.npz',
    'meta.json',
    'report.json',
    'report.txt',
    'weights',
  ]
  # A model built again with other initial weights: the folder's weights replace them.
  again = build(seed=1)
  again(batch[0])
  assert not np.array_equal(again.get_weights()[0], model.get_weights()[0])
  loaded = forensics.load(folder)
  assert (loaded.step, loaded.loss_scale) == (7, SCALE)
  np.testing.assert_array_equal(loaded.batch[0], batch[0])
  trainer = types.SimpleNamespace(model=again, compute_loss=_loss_fn(again))
  replayed = forensics.replay_folder(trainer, folder)
  assert replayed.line() == original.line()
  with open(os.path.join(folder, 'report.txt')) as f:
    assert f.read().strip() == original.line()


def test_batch_structures_round_trip(tmp_path):
  model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name='one')], name='tiny')
  batch = {'x': np.ones((2, 2), np.float32), 'extra': [np.arange(2), (np.zeros(1),)]}
  forensics.save(str(tmp_path), model=model, batch=batch, loss_scale=1.0, step=0)
  loaded = forensics.load(str(tmp_path)).batch
  assert sorted(loaded) == ['extra', 'x'] and isinstance(loaded['extra'], list)
  assert isinstance(loaded['extra'][1], tuple)
  np.testing.assert_array_equal(loaded['extra'][0], np.arange(2))


def _recorded_skips(limiter, up_to: int) -> list[int]:
  """The skips (1-based) that get forensics, as the Runner walks them with next_after."""
  recorded, count = [], 0
  while (count := limiter.next_after(count)) and count <= up_to:
    recorded.append(count)
  return recorded


def test_rate_limiter_records_the_first_few_then_every_mth():
  assert _recorded_skips(forensics.RateLimiter(first=2, every=3), 9) == [1, 2, 5, 8]
  assert _recorded_skips(forensics.RateLimiter(first=1, every=0), 4) == [1]


def test_launch_diagnose_records_then_replays_a_folder(tmp_path):
  """--mode=diagnose on a workdir records the next batch of the overflow demo as a folder;
  --mode=diagnose --forensics=<folder> (no --config: the folder's) replays it."""
  env = {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'}
  workdir = tmp_path / 'run'
  first = subprocess.run(
    [
      sys.executable,
      'launch.py',
      '--config=configs/overflow_demo.py',
      '--mode=diagnose',
      '--config.data.dir=../shared/data/mnist',
      f'--workdir={workdir}',
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  assert first.returncode == 0, first.stderr[-2000:]
  assert "forward output of 'overflow_forward/culprit' (Dense)" in first.stdout
  folder = workdir / 'forensics' / 'step-0'
  assert (folder / 'report.txt').is_file()
  assert os.listdir(workdir) == ['forensics']  # read-only otherwise: no lock, config, events
  second = subprocess.run(
    [sys.executable, 'launch.py', '--mode=diagnose', f'--forensics={folder}'],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  assert second.returncode == 0, second.stderr[-2000:]
  assert second.stdout.strip().splitlines()[-1] == (
    'step 0, loss scale 32768: ' + (folder / 'report.txt').read_text().strip()
  )


def test_replay_after_a_compiled_xla_step_on_two_replicas(tmp_path):
  """The compiled step ran with XLA under MirroredStrategy (2 logical CPUs) and skipped; the
  eager one-replica replay still names the culprit, and its folder replays the same."""
  result = subprocess.run(
    [sys.executable, os.path.join('tests', 'forensics_mirrored_run.py'), str(tmp_path)],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'},
  )
  assert result.returncode == 0, result.stderr[-2000:]
  replicas, skipped, recorded, replayed = result.stdout.strip().splitlines()[-4:]
  assert (replicas, skipped) == ('2', '2')
  assert recorded.startswith(
    "first non-finite: forward output of 'overflow_forward/culprit' (Dense)"
  )
  assert replayed == recorded


def test_weights_that_do_not_fit_the_model_are_a_user_error(tmp_path, mixed_float16):
  model = forward_model()
  forensics.save(str(tmp_path), model=model, batch=_batch(), loss_scale=1.0, step=0)
  other = backward_model()  # another architecture
  with pytest.raises(forensics.UserError, match='do not fit the model'):
    forensics.load(str(tmp_path)).restore_weights(other)
