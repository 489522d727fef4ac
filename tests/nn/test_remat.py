"""Gradient checkpointing (config.train.remat, trainer/nn/remat.py) in the Transformer LM: the same
gradients as without it, less kept for the backward pass, and it composes with mixed precision,
loss scaling, skipped steps and MirroredStrategy."""

import os
import subprocess
import sys

import keras
import ml_collections
import numpy as np
import pytest
import tensorflow as tf

from conftest import ROOT, once_per_session

DATA = os.path.join(ROOT, '..', 'shared', 'data', 'tinyshakespeare')


def _model_config(**kw):
  from models import transformer_lm

  return ml_collections.ConfigDict(
    {
      **transformer_lm.MODEL_DEFAULTS,
      'context': 32,
      'd_model': 32,
      'num_heads': 2,
      'num_layers': 2,
      **kw,
    }
  )


def _remat(on):
  return ml_collections.ConfigDict({'train': {'remat': on}})


def _loss_and_grads(model, tokens):
  @tf.function
  def step(tokens):
    with tf.GradientTape() as tape:
      logits = tf.cast(model(tokens, training=True), tf.float32)
      loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(tokens, logits))
    return loss, tape.gradient(loss, model.trainable_variables)

  return step


def _tokens():
  return tf.constant(np.random.RandomState(0).randint(0, 11, (4, 32)), tf.int32)


def test_gradients_equal_without_remat_float32():
  from models.transformer_lm import build_transformer

  keras.utils.set_random_seed(0)
  plain = build_transformer(11, _model_config(), _remat(False))
  remat = build_transformer(11, _model_config(), _remat(True))
  remat.set_weights(plain.get_weights())
  loss, grads = _loss_and_grads(plain, _tokens())(_tokens())
  loss_r, grads_r = _loss_and_grads(remat, _tokens())(_tokens())
  assert float(loss) == pytest.approx(float(loss_r), abs=1e-6)
  assert len(grads) == len(grads_r) == len(plain.trainable_variables)
  for g, g_r, v in zip(grads, grads_r, plain.trainable_variables):
    np.testing.assert_allclose(
      tf.convert_to_tensor(g_r), tf.convert_to_tensor(g), atol=1e-6, err_msg=v.path
    )


@pytest.mark.parametrize('policy', ['float32', 'mixed_bfloat16'])
def test_remat_keeps_only_block_inputs_for_the_backward_pass(policy):
  from benchmarks.memory import kept_for_backward
  from models.transformer_lm import build_transformer

  keras.mixed_precision.set_global_policy(policy)
  tokens = _tokens()
  kept = {}
  for on in (False, True):
    model = build_transformer(11, _model_config(), _remat(on))
    graph = _loss_and_grads(model, tokens).get_concrete_function(tokens).graph
    kept[on] = kept_for_backward(graph)
  squares = lambda ts: [t for t in ts if t.shape.rank == 4 and t.shape[-1] == t.shape[-2] == 32]
  assert len(squares(kept[False])) == 2 and not squares(kept[True])  # attention weights
  size = lambda ts: sum(t.shape.num_elements() * t.dtype.size for t in ts)
  assert size(kept[True]) < size(kept[False]) / 3


def test_remat_with_dropout_is_a_config_error():
  from models.transformer_lm import build_transformer
  from trainer.errors import ConfigError

  with pytest.raises(ConfigError, match='config.model_config.dropout'):
    build_transformer(11, _model_config(dropout=0.1), _remat(True))


def test_keras_remat_scope_fails_inside_tf_function_with_training_argument():
  """Why trainer/nn/remat.py uses tf.recompute_grad: Keras's scope passes `training=` through
  tf.custom_gradient, which refuses keyword arguments in a tf.function. If this starts passing,
  keras.RematScope could replace trainer/remat.checkpoint."""

  class Block(keras.layers.Layer):
    def build(self, shape):
      self.dense = keras.layers.Dense(shape[-1], name='remat_scope_dense')

    def call(self, x, training=False):
      return self.dense(x)

  with keras.RematScope(mode='list_of_layers', layer_names=['block']):
    block = Block(name='block')
  x = tf.ones([2, 4])
  block(x)

  @tf.function
  def grads(x):
    with tf.GradientTape() as tape:
      y = tf.reduce_sum(block(x, training=True))
    return tape.gradient(y, block.trainable_variables)

  with pytest.raises(ValueError, match='keywords arguments only when eager'):
    grads(x)


def train(workdir, steps, remat, start=None, **overrides):
  """Trains the tiny Transformer LM `steps` steps (SGD) with train.remat = `remat`, from
  `start` weights if given: (start weights, end weights, skipped/scale/loss/replicas)."""
  from configs import shakespeare
  from models.transformer_lm import TransformerLmTrainer
  from trainer.config import set_dotted

  c = shakespeare.get_config()
  c.data.dir = DATA
  c.model_config.update(context=32, d_model=32, num_heads=2, num_layers=2)
  c.train.update(
    batch_size=8, steps=steps, steps_per_loop=1, remat=bool(remat), jit_compile='false'
  )
  c.optimizer.update(
    name='sgd', learning_rate=0.1, schedule='constant', warmup_steps=0, weight_decay=0.0
  )
  for key, value in overrides.items():
    set_dotted(c, key, value)
  t = TransformerLmTrainer(c, workdir)
  if start is not None:
    t.model.set_weights(start)
  start = t.model.get_weights()
  iterator = iter(t.strategy.experimental_distribute_dataset(t.datasets.train))
  for _ in range(steps):
    t.runner.train_loop.run(iterator, 1)
  return (
    start,
    t.model.get_weights(),
    {
      'skipped': int(t.train_step.skipped_steps.numpy()),
      'scale': float(t.loss_scaler.scale.numpy()),
      'loss': float(t.runner.train_loop.read_outputs()['loss']),
      'replicas': t.strategy.num_replicas_in_sync,
    },
  )


def compare(start, end_off, end_on, off, on):
  return {
    **{f'{k}/False': v for k, v in off.items()},
    **{f'{k}/True': v for k, v in on.items()},
    'max_weight_diff': max(float(np.max(np.abs(a - b))) for a, b in zip(end_off, end_on)),
    'max_weight_change': max(float(np.max(np.abs(a - b))) for a, b in zip(start, end_off)),
  }


def train_pair(workdir, steps, **overrides):
  """train.remat off and on from the same weights: compared (`compare`)."""
  start, end_off, off = train(os.path.join(workdir, 'off'), steps, False, **overrides)
  _, end_on, on = train(os.path.join(workdir, 'on'), steps, True, start=start, **overrides)
  return compare(start, end_off, end_on, off, on)


@pytest.mark.parametrize(
  'policy,loss_scale,atol', [('mixed_bfloat16', '128', 1e-2), ('mixed_float16', 'dynamic', 2e-3)]
)
def test_composes_with_mixed_precision_loss_scaling_and_skipped_steps(
  tmp_path, policy, loss_scale, atol
):
  r = train_pair(
    str(tmp_path),
    3,
    **{
      'precision.policy': policy,
      'precision.loss_scale': loss_scale,
      'debug.inject_nonfinite_steps': '2',
    },
  )
  assert r['skipped/False'] == r['skipped/True'] == 1
  assert r['scale/False'] == r['scale/True']
  assert r['loss/True'] == pytest.approx(r['loss/False'], abs=atol)
  assert r['max_weight_change'] > 1e-2  # the comparison below is not trivially true
  assert r['max_weight_diff'] < atol


def _run_mirrored(out):
  env = {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2', 'PYTHONPATH': ROOT}
  for name in ('float32', 'mixed_float16'):  # two processes at a time: remat off and on
    procs = [
      subprocess.Popen(
        [sys.executable, os.path.join(ROOT, 'tests', 'remat_runs.py'), str(out), name, str(remat)],
        cwd=ROOT,
        env=env,
        text=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
      )
      for remat in (0, 1)
    ]
    for proc in procs:
      _, err = proc.communicate(timeout=600)
      assert proc.returncode == 0, err[-3000:]


@pytest.fixture(scope='module')
def mirrored(tmp_path_factory):
  out = once_per_session(tmp_path_factory, 'remat_runs', _run_mirrored)
  results = {}
  for name in ('float32', 'mixed_float16'):
    off, on = np.load(out / f'{name}_remat0.npz'), np.load(out / f'{name}_remat1.npz')
    part = lambda a, what: [
      a[k]
      for k in sorted(
        (k for k in a.files if k.startswith(f'{name}/{what}/')),
        key=lambda k: int(k.rsplit('/', 1)[1]),
      )
    ]
    scalars = lambda a: {
      k: a[f'{name}/{k}'].item() for k in ('skipped', 'scale', 'loss', 'replicas')
    }
    for a, b in zip(part(off, 'start'), part(on, 'start')):
      np.testing.assert_array_equal(a, b)  # the same initial weights in both processes
    results[name] = compare(
      part(off, 'start'), part(off, 'end'), part(on, 'end'), scalars(off), scalars(on)
    )
  return results


def test_mirrored_float32_same_weights_with_and_without_remat(mirrored):
  r = mirrored['float32']
  assert r['replicas/False'] == r['replicas/True'] == 2
  assert r['max_weight_change'] > 1e-3 and r['max_weight_diff'] < 1e-5


def test_mirrored_mixed_float16_skips_the_injected_step_with_remat(mirrored):
  r = mirrored['mixed_float16']
  assert r['replicas/False'] == r['replicas/True'] == 2
  assert r['skipped/False'] == r['skipped/True'] == 1
  assert r['scale/False'] == r['scale/True']
  assert r['max_weight_change'] > 2e-2 and r['max_weight_diff'] < 2e-3


def test_remat_on_a_model_that_marks_no_block_warns_once(tmp_path, monkeypatch):
  """Issue 35: train.remat=True on a model marking no block changed nothing and said nothing;
  one warning line now says how to mark a block. A model that marks one gets none."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from tiny import TinyTrainer, tiny_config
  from trainer.nn import remat

  warnings = []
  monkeypatch.setattr(remat.logging, 'warning', lambda msg, *a: warnings.append(msg % a))

  class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
      super().__init__(**kwargs)
      self.dense = keras.layers.Dense(16, activation='relu')

    def call(self, x):
      return remat.checkpoint(self.dense, x, enabled=True)

  class Marked(TinyTrainer):
    def build_model(self):
      return keras.Sequential([keras.Input((8,)), Block(), keras.layers.Dense(4)])

  config = tiny_config(**{'train.remat': True, 'train.steps': 2})
  TinyTrainer(config, str(tmp_path / 'plain'))
  assert len(warnings) == 1 and 'config.train.remat=True changes nothing' in warnings[0]
  assert 'trainer.nn.remat.checkpoint(' in warnings[0]
  Marked(config, str(tmp_path / 'marked')).train()
  TinyTrainer(tiny_config(**{'train.steps': 2}), str(tmp_path / 'off'))
  assert len(warnings) == 1
