"""precision.float8 recipes (trainer/nn/float8_gemm.py, float8_layers.py): the GEMMs against a
NumPy reference, the layers they reach, the config's errors, `delayed` = Keras's float8, and every
recipe in the loop (loss scaling, skips, accumulation, resume, replicas, the numerics tools).

On this CPU float8 is emulated (quantize-dequantize): these check numerics, not speed."""

import json
import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from conftest import MNIST_DIR, ROOT
from test_float8_quant import ref_qdq
from tiny import TinyTrainer, tiny_config
from trainer import Datasets
from trainer import config as config_lib
from trainer.errors import ConfigError
from trainer.nn import float8_gemm

CURRENT = ['tensorwise', 'rowwise', 'mxfp8']


def ref_gemm(x, w, g, recipe):
  """(y, dx, dw) of the recipe's three GEMMs in NumPy: each operand quantized along the GEMM's
  contraction axis (tests/nn/test_float8_quant.py's reference), products summed in float64."""
  r = float8_gemm.RECIPES[recipe]
  q = lambda t, fmt, axis: ref_qdq(t, fmt, r.scaling, axis).astype(np.float64)  # noqa: E731
  y = q(x, r.forward, 1) @ q(w, r.forward, 0)
  dx = q(g, r.gradient, 1) @ q(w, r.forward, 1).T
  dw = q(x, r.forward, 0).T @ q(g, r.gradient, 0)
  return y, dx, dw


def gemm(x, w, g, recipe, loss_scale=1.0):
  x, w = tf.constant(x), tf.constant(w)
  with tf.GradientTape() as tape:
    tape.watch([x, w])
    y = float8_gemm.matmul(x, w, float8_gemm.RECIPES[recipe])
    loss = tf.reduce_sum(y * g * loss_scale)
  dx, dw = tape.gradient(loss, [x, w])
  return y.numpy(), dx.numpy() / loss_scale, dw.numpy() / loss_scale


def operands(seed=0, m=40, k=96, n=64):
  """M = 40: the weight gradient's contraction axis has a ragged 32-element block."""
  rng = np.random.default_rng(seed)
  x = (rng.standard_normal((m, k)) * np.exp2(rng.uniform(-4, 4, (m, 1)))).astype(np.float32)
  w = (rng.standard_normal((k, n)) * 0.1).astype(np.float32)
  g = (rng.standard_normal((m, n)) * 1e-3).astype(np.float32)
  return x, w, g


@pytest.mark.parametrize('recipe', [*CURRENT, 'mxfp8_rceil'])
def test_gemm_and_its_gradients_equal_the_reference(recipe):
  x, w, g = operands()
  for got, want in zip(gemm(x, w, g, recipe), ref_gemm(x, w, g, recipe)):
    # float32 summation order (the sums cancel: the bound is on the largest value)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(want).max())
  exact = (x.astype(np.float64) @ w, g.astype(np.float64) @ w.T)
  assert not np.allclose(gemm(x, w, g, recipe)[0], exact[0], rtol=1e-3)  # quantized indeed


@pytest.mark.parametrize('recipe', CURRENT)
def test_each_operand_is_quantized_in_one_xla_computation_with_the_same_bits(recipe, monkeypatch):
  """The GEMMs' q/dq runs as one XLA computation per operand (float8_quant.fused), in a graph not
  compiled with XLA too: no float8 cast is left in the graph itself. 'tensorwise' quantizes x, w
  and g once each (its backward GEMMs reuse the forward's operands), the per-row and per-block
  recipes each of them along both of its contraction axes. The results are those of the q/dq
  run op by op, bit for bit."""
  from tensorflow.python.framework import dtypes as tf_dtypes

  from trainer.nn import float8_quant

  x, w, g = operands(3)
  r = float8_gemm.RECIPES[recipe]

  def step(x, w):
    with tf.GradientTape() as tape:
      tape.watch([x, w])
      y = float8_gemm.matmul(x, w, r)
    return [y, *tape.gradient(y, [x, w], output_gradients=tf.constant(g))]

  graph = tf.function(step).get_concrete_function(tf.constant(x), tf.constant(w)).graph
  library = {f.signature.name: f for f in graph.as_graph_def().library.function}
  compiled = [
    op
    for op in graph.get_operations()
    if op.type in ('PartitionedCall', 'StatefulPartitionedCall')
    and library[op.get_attr('f').name].attr['_XlaMustCompile'].b
  ]
  assert len(compiled) == (3 if recipe == 'tensorwise' else 6)
  float8 = (tf_dtypes.float8_e4m3fn, tf_dtypes.float8_e5m2)
  assert not [
    op for op in graph.get_operations() if op.type == 'Cast' and op.get_attr('DstT') in float8
  ]
  fused = [t.numpy() for t in step(tf.constant(x), tf.constant(w))]
  monkeypatch.setattr(
    float8_quant, 'fused', lambda f, s, a=-1: lambda t: float8_quant.qdq(t, f, s, a)
  )
  for a, b in zip(fused, [t.numpy() for t in step(tf.constant(x), tf.constant(w))]):
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize('recipe', CURRENT)
def test_loss_scaled_gradients_quantize_to_the_same_values(recipe):
  """The scaled gradient is quantized: its scales follow the loss scale, so with a power of two
  the unscaled gradients are bit-identical; an overflow poisons them (the step skips)."""
  x, w, g = operands(1)
  plain, scaled = gemm(x, w, g, recipe), gemm(x, w, g, recipe, loss_scale=2.0**15)
  for a, b in zip(plain[1:], scaled[1:]):
    np.testing.assert_array_equal(a, b)
  g[3, 5] = np.inf  # an overflowed scaled gradient
  _, dx, dw = gemm(x, w, g, recipe)
  assert not np.isfinite(dx).all() and not np.isfinite(dw).all()


@pytest.mark.parametrize('recipe', [*CURRENT, 'mxfp8_rceil'])
def test_einsum_dense_is_the_recipes_gemm(recipe):
  """'abc,cde->abde': x's (a, b) fold into M, c is K, the kernel's (d, e) fold into N."""
  from trainer.nn import float8_layers

  keras.mixed_precision.set_global_policy('mixed_bfloat16')
  layer = keras.layers.EinsumDense('abc,cde->abde', (None, 4, 8), bias_axes='de')
  model = keras.Sequential([keras.Input((6, 64)), layer])
  rng = np.random.default_rng(2)
  x = rng.standard_normal((3, 6, 64)).astype(np.float32)
  layer.bias.assign(rng.standard_normal((4, 8)))
  assert float8_layers.apply(model, recipe) == ([layer.path], [])
  xb = tf.cast(tf.cast(x, tf.bfloat16), tf.float32).numpy().reshape(18, 64)
  kb = tf.cast(tf.cast(layer.kernel, tf.bfloat16), tf.float32).numpy().reshape(64, 32)
  r = float8_gemm.RECIPES[recipe]
  want = ref_qdq(xb, r.forward, r.scaling, 1) @ ref_qdq(kb, r.forward, r.scaling, 0)
  want = tf.cast(want.reshape(3, 6, 4, 8), tf.bfloat16) + tf.cast(layer.bias, tf.bfloat16)
  np.testing.assert_array_equal(model(x).numpy(), want.numpy())


class Tiny32(TinyTrainer):
  """Dense 64 relu -> EinsumDense 32 relu -> Dense 4 (float32) on 32 features: every GEMM's
  axes divide into MX blocks."""

  def build_model(self):
    return keras.Sequential(
      [
        keras.Input((32,)),
        keras.layers.Dense(64, activation='relu', name='d1'),
        keras.layers.EinsumDense('ab,bc->ac', 32, bias_axes='c', activation='relu', name='e1'),
        keras.layers.Dense(4, dtype='float32', name='logits'),
      ],
      name='tiny32',
    )

  def build_datasets(self):
    rng = np.random.default_rng(1234)
    x = rng.normal(size=(512, 32)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(32, 4)), axis=1).astype(np.int32)
    b = self.config.train.batch_size
    train = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(512, seed=self.config.seed)
    return Datasets(
      train=train.repeat().batch(b, drop_remainder=True),
      eval=tf.data.Dataset.from_tensor_slices((x, y)).batch(b),
      train_examples=len(x),
    )


def tiny(tmp_path, recipe, name='w', **overrides):
  config = tiny_config(
    **{'precision.policy': 'mixed_bfloat16', 'precision.float8': recipe, **overrides}
  )
  return Tiny32(config, str(tmp_path / name))


@pytest.mark.parametrize('recipe', CURRENT)
def test_recipes_reach_dense_einsum_and_attention_but_not_float32_layers(tmp_path, recipe):
  trainer = tiny(tmp_path, recipe, **{'precision.float32_layers': 'e1'})
  recipes = {layer.name: getattr(layer, 'float8_recipe', None) for layer in trainer.model.layers}
  assert recipes == {'d1': recipe, 'e1': None, 'logits': None}
  from models.transformer_lm import build_transformer, model_config

  m = model_config(config_lib.defaults())
  m.update(d_model=32, num_heads=2, num_layers=1, context=8)
  keras.mixed_precision.set_global_policy('mixed_bfloat16')
  lm = build_transformer(40, m)
  lm(np.zeros((2, 8), np.int32))
  from trainer.step import precision

  precision.apply_float8(lm, recipe)
  quantized = {layer.name for layer in lm._flatten_layers() if hasattr(layer, 'float8_recipe')}
  assert quantized == {'block0_attention', 'block0_mlp_in', 'block0_mlp_out'}
  attention = lm.get_layer('block0').attention
  x = tf.random.normal((2, 8, 32), seed=1)
  quantized_out = attention(x)
  del attention.float8_matmul
  assert not np.array_equal(quantized_out.numpy(), attention(x).numpy())  # projections in float8


def test_config_errors_are_one_line_naming_the_key_or_layer(tmp_path):
  config = config_lib.defaults()
  config.precision.float8 = 'rowise'
  with pytest.raises(ConfigError, match=r"^config\.precision\.float8='rowise': must be one of"):
    config_lib.validate(config)
  for old, new in ((True, 'delayed'), (False, 'none'), ('True', 'delayed'), ('false', 'none')):
    config = config_lib.defaults()
    config.precision.float8 = old  # a config file's old boolean, or a command line's string
    assert config_lib.validate(config).precision.float8 == new
  for recipe in ('rowwise', 'mxfp8'):
    with pytest.raises(ConfigError, match=rf"^config\.precision\.float8='{recipe}' does not run"):
      tiny(tmp_path, recipe, **{'precision.policy': 'mixed_float16'})
  tiny(tmp_path, 'tensorwise', **{'precision.policy': 'mixed_float16'})  # allowed


def test_mxfp8_leaves_the_layer_that_does_not_fit_and_names_it(tmp_path, caplog):
  """The MNIST MLP's first Dense contracts over K=784, not whole 32-element blocks: mxfp8 leaves
  it in the compute policy, in one line with the reason, and quantizes the rest; the MLP
  trains under each recipe. A misfit named in precision.float8_layers is an error."""
  from models.mnist_mlp import MnistMlpTrainer

  for recipe in CURRENT:
    caplog.clear()
    trainer = MnistMlpTrainer(mlp_config(recipe, steps=10), str(tmp_path / recipe))
    quantized = [l.path for l in trainer.model.layers if hasattr(l, 'float8_recipe')]
    first = [l.path for l in trainer.model.layers if isinstance(l, keras.layers.Dense)][0]
    left = [
      r.getMessage() for r in caplog.records if 'left in the compute policy' in r.getMessage()
    ]
    if recipe == 'mxfp8':
      assert quantized == [] and len(left) == 1, left  # the other Dense: the float32 logits
      assert f'{first} (contracts over K=784 (forward) and N=128 (input gradient)' in left[0]
    else:
      assert quantized == [first] and not left
    assert np.isfinite(trainer.train()['loss'])
  with pytest.raises(ConfigError) as error:  # the float32 policy: the logits are quantized
    tiny(
      tmp_path,
      'mxfp8',
      'named',
      **{'precision.policy': 'float32', 'precision.float8_layers': 'logits'},
    )
  assert re.search(
    r"^config\.precision\.float8='mxfp8': layer tiny32/logits contracts over K=32 \(forward\) "
    r'and N=4'
    r'.*take it out of config\.precision\.float8_layers',
    str(error.value),
  ), str(error.value)
  assert '\n' not in str(error.value)


def test_float8_layers_and_float8_skip_choose_by_name_or_path(tmp_path):
  recipes = lambda t: {l.name: getattr(l, 'float8_recipe', None) for l in t.model.layers}  # noqa: E731
  only = tiny(tmp_path, 'rowwise', 'only', **{'precision.float8_layers': 'tiny32/e1'})
  assert recipes(only) == {'d1': None, 'e1': 'rowwise', 'logits': None}
  skip = tiny(tmp_path, 'rowwise', 'skip', **{'precision.float8_skip': 'd1'})
  assert recipes(skip) == {'d1': None, 'e1': 'rowwise', 'logits': None}
  with pytest.raises(ConfigError, match=r"^config\.precision\.float8_skip='d9': no layer named d9"):
    tiny(tmp_path, 'rowwise', 'bad', **{'precision.float8_skip': 'd9'})


def mlp_config(recipe, steps=100, **overrides):
  config = config_lib.load_file(os.path.join(ROOT, 'configs', 'mnist_mlp.py'))
  config.data.dir = MNIST_DIR
  config.train.steps = steps
  config.train.steps_per_loop = 50 if steps % 50 == 0 else steps
  config.train.log_every = config.train.checkpoint_every = config.train.steps_per_loop
  config.precision.policy = 'mixed_bfloat16'
  config.precision.loss_scale = 'dynamic'
  config.precision.float8 = recipe
  for key, value in overrides.items():
    config_lib.set_dotted(config, key, value)
  return config


def test_delayed_is_bit_identical_to_kerass_float8_over_100_steps(tmp_path):
  """'delayed' against what precision.float8=True did before recipes: model.quantize('float8')
  on the built model, right before the train step is built."""
  from models.mnist_mlp import MnistMlpTrainer

  class QuantizedByHand(MnistMlpTrainer):
    def build_train_step(self):
      self.model.quantize('float8')
      return super().build_train_step()

  delayed = MnistMlpTrainer(mlp_config('delayed'), str(tmp_path / 'delayed'))
  by_hand = QuantizedByHand(mlp_config('none'), str(tmp_path / 'hand'))
  assert delayed.model.layers[1].quantization_mode == 'float8'
  delayed.train(), by_hand.train()
  assert int(delayed.global_step.numpy()) == 100
  names = [v.name for v in delayed.model.variables]  # the layers' names differ (dense_2)
  assert names == [v.name for v in by_hand.model.variables]
  assert any('amax_history' in n for n in names)
  for a, b, name in zip(delayed.model.variables, by_hand.model.variables, names):
    np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=name)


# ---- every recipe in the loop ----------------------------------------------------------------


def run(trainer, n):
  if not hasattr(trainer, '_it'):
    trainer.runner.restore()
    trainer._it = iter(trainer.strategy.experimental_distribute_dataset(trainer.datasets.train))
  return trainer.runner._run_steps(trainer._it, n)


def values(trainer):
  return [v.numpy().copy() for v in trainer.model.variables + trainer.optimizer.variables]


@pytest.mark.parametrize('recipe', CURRENT)
def test_skipped_step_touches_no_state_under_dynamic_loss_scaling(tmp_path, recipe):
  trainer = tiny(
    tmp_path, recipe, **{'precision.loss_scale': 'dynamic', 'debug.inject_nonfinite_steps': '3'}
  )
  run(trainer, 3)
  before, scale = values(trainer), float(trainer.loss_scaler.scale.numpy())
  run(trainer, 1)  # step 3: injected, skipped
  assert int(trainer.train_step.skipped_steps.numpy()) == 1
  assert float(trainer.loss_scaler.scale.numpy()) == scale / 2
  for a, b in zip(before, values(trainer)):
    np.testing.assert_array_equal(a, b)
  run(trainer, 2)
  after = values(trainer)
  assert all(np.isfinite(v).all() for v in after)
  assert not np.array_equal(before[0], after[0])  # the next steps apply


class OneBatch(Tiny32):
  """Every train batch is the same 32 examples."""

  def build_datasets(self):
    rng = np.random.default_rng(7)
    batch = (rng.normal(size=(32, 32)).astype(np.float32), rng.integers(0, 4, 32).astype(np.int32))
    data = tf.data.Dataset.from_tensors(batch)
    return Datasets(train=data.repeat(), eval=data, train_examples=32)


@pytest.mark.parametrize('recipe', CURRENT)
def test_accumulated_micro_batches_each_quantized_on_their_own(tmp_path, recipe):
  """One SGD step over 2 micro-batches moves the weights by the mean of the micro-batches'
  float8 gradients (each GEMM quantized with its micro-batch's own scales)."""
  config = tiny_config(
    **{
      'precision.policy': 'mixed_bfloat16',
      'precision.float8': recipe,
      'precision.loss_scale': 'dynamic',
      'train.grad_accum_steps': 2,
      'optimizer.name': 'sgd',
      'optimizer.momentum': 0.0,
      'optimizer.learning_rate': 0.5,
      'optimizer.schedule': 'constant',
    }
  )
  trainer = OneBatch(config, str(tmp_path / 'w'))
  x, y = next(iter(trainer.datasets.train))
  model = trainer.model
  start = [v.numpy().copy() for v in model.trainable_variables]
  grads = []
  for part in (slice(0, 16), slice(16, 32)):
    with tf.GradientTape() as tape:
      loss, _ = trainer.compute_loss((x[part], y[part]), training=True)
      loss = tf.reduce_mean(loss)
    grads.append([g.numpy() for g in tape.gradient(loss, model.trainable_variables)])
  trainer.runner.train_loop.run(iter(trainer.datasets.train), 1)
  assert int(trainer.train_step.skipped_steps.numpy()) == 0
  for w0, g1, g2, v in zip(start, *grads, model.trainable_variables):
    np.testing.assert_allclose(v.numpy(), w0 - 0.5 * (g1 + g2) / 2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('recipe', CURRENT)
def test_resume_is_bit_identical(tmp_path, recipe):
  over = {'precision.loss_scale': 'dynamic', 'train.steps': 10}
  straight = tiny(tmp_path, recipe, 'straight', **over)
  straight.train()
  tiny(tmp_path, recipe, 'resumed', **{**over, 'train.steps': 5}).train()
  resumed = tiny(tmp_path, recipe, 'resumed', **over)
  resumed.train()
  assert int(resumed.global_step.numpy()) == 10
  for a, b in zip(values(straight), values(resumed)):
    np.testing.assert_array_equal(a, b)


def test_two_replicas_agree_with_each_other_and_one_device(tmp_path):
  env = {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2', 'PYTHONPATH': ROOT}
  script = os.path.join(ROOT, 'tests', 'distribute_runs.py')
  proc = subprocess.run(
    [sys.executable, script, '--float8-recipes', str(tmp_path), ','.join(CURRENT)],
    env=env,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  results = json.loads((tmp_path / 'results.json').read_text())
  arrays = dict(np.load(tmp_path / 'arrays.npz'))
  for recipe in CURRENT:
    assert results[recipe]['skipped'] == 0 and results[recipe]['quantized'] == ['hidden']
    for i, name in enumerate(results[recipe]['names']):
      one = arrays[f'{recipe}/one/{i}']
      replicas = [arrays[f'{recipe}/replica{r}/{i}'] for r in range(2)]
      np.testing.assert_array_equal(replicas[0], replicas[1], err_msg=name)
      # Each replica quantizes its half batch with its own scales, so the runs differ by float8
      # rounding (seen: 2.6e-3 on one of 8192 elements): small beside the 3 SGD steps' move
      # (gradients summed instead of averaged over replicas would double it).
      moved = np.linalg.norm(one - arrays[f'{recipe}/start/{i}'])
      assert np.linalg.norm(replicas[0] - one) < 0.1 * moved, f'{recipe} {name}'


@pytest.mark.parametrize('recipe', CURRENT)
def test_probe_measures_the_quantized_outputs(tmp_path, recipe):
  from trainer.insight.numerics import Probe

  trainer = tiny(tmp_path, recipe)
  batch = next(iter(trainer.datasets.eval))
  stats, overall = Probe(trainer).measure(batch)
  d1 = trainer.model.get_layer('d1')
  assert d1.float8_recipe == recipe
  quantized = np.abs(d1(batch[0]).numpy().astype(np.float32)).max()
  assert stats[d1.path]['output_max'] == pytest.approx(quantized, rel=1e-6)
  d1.__dict__.pop('call')  # the same layer without float8: another output
  assert np.abs(d1(batch[0]).numpy().astype(np.float32)).max() != quantized
  assert 0 <= overall['grad_zero'] < 1 and 'grad_max' in stats[d1.path]


@pytest.mark.parametrize('recipe', CURRENT)
def test_float32_layers_are_left_out_under_a_float32_policy_too(tmp_path, recipe):
  """A float32-compute run quantizes the layers its mixed_bfloat16 twin quantizes: the logits
  named in precision.float32_layers stay out (mxfp8 would refuse their N = 4)."""
  trainer = tiny(
    tmp_path, recipe, **{'precision.policy': 'float32', 'precision.float32_layers': 'logits'}
  )
  recipes = {layer.name: getattr(layer, 'float8_recipe', None) for layer in trainer.model.layers}
  assert recipes == {'d1': recipe, 'e1': recipe, 'logits': None}


@pytest.mark.parametrize('recipe', CURRENT)
def test_probe_compares_a_float8_layer_with_float32_under_a_float32_policy(tmp_path, recipe):
  """Under float32 compute the probe still runs its float32 reference for a float8 layer (the
  same layer without float8): feature 0 a million times the others, one tensorwise scale flushes
  the others' x to zero, so d1's kernel gradient is zero where float32's is not: flushed, not
  'zero in float32 too'. Per-row and per-block scales keep them."""
  trainer = tiny(
    tmp_path, recipe, **{'precision.policy': 'float32', 'precision.float32_layers': 'logits'}
  )
  x, y = next(iter(trainer.datasets.eval))
  x = x.numpy()
  x[:, 0] = 1e6
  from trainer.insight.numerics import Probe

  probe = Probe(trainer)
  assert probe.needs_reference
  stats, overall = probe.measure((tf.constant(x), y))
  d1 = stats[trainer.model.get_layer('d1').path]
  if recipe == 'tensorwise':
    assert d1['grad_flushed'] > 0.2 and overall['grad_flushed'] > 0  # ReLU: some are zero too
  else:
    assert d1['grad_flushed'] < 0.01
  assert 'call' in trainer.model.get_layer('d1').__dict__  # the reference put float8 back


@pytest.mark.parametrize('recipe', CURRENT)
def test_replay_names_the_float8_layer_that_overflows(tmp_path, recipe):
  """The culprit's float8 GEMM (dequantized products summed in float32) overflows: 64 x ~3e31
  x 1e30 > float32's 3.4e38. Its inputs come from a float8 layer that stays finite."""
  from trainer.insight import forensics

  class Loud(Tiny32):
    def build_model(self):
      big = keras.initializers.Constant(1e30)
      return keras.Sequential(
        [
          keras.Input((32,)),
          keras.layers.Dense(64, kernel_initializer=big, name='first'),
          keras.layers.Dense(64, kernel_initializer=big, name='culprit'),
          keras.layers.Dense(4, dtype='float32'),
        ],
        name='loud',
      )

  config = tiny_config(**{'precision.policy': 'mixed_bfloat16', 'precision.float8': recipe})
  trainer = Loud(config, str(tmp_path / 'w'))
  assert trainer.model.get_layer('culprit').float8_recipe == recipe
  batch = next(iter(trainer.datasets.train))
  report = forensics.replay(trainer.model, trainer.compute_loss, batch, loss_scale=32768.0)
  assert report.phase == 'forward' and report.layer == 'loud/culprit', report.line()


@pytest.mark.slow
def test_the_recipes_table_is_written(tmp_path):
  """benchmarks/float8_recipes.py end to end on a few MLP steps: the header, one row per recipe
  (mxfp8's too, its misfit layer left out), the shares of the current-scaling recipes."""
  out = tmp_path / 'float8.md'
  done = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, 'benchmarks', 'float8_recipes.py'),
      '--models=mnist_mlp',
      '--mlp_steps=4',
      '--recipes=none,rowwise,mxfp8',
      '--cost_steps=1',
      f'--results_dir={tmp_path}',
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=900,
    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'),
  )
  assert done.returncode == 0, done.stderr[-3000:]
  text = out.read_text()
  assert text.startswith('# Results: float8') and 'benchmarks.float8_recipes' in text
  for expected in ('| commit |', '| load |'):
    assert expected in text
  assert '| none | ' in text and '| rowwise | 0.' in text and 'short: 4 of 4680 steps' in text
  assert '| mxfp8 | 0.' in text  # its K=784 layer left in the compute policy: it runs
  assert '| rowwise | mnist_mlp/dense' in text  # the shares table
