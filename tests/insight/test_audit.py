"""trainer.audit: the per-layer dtype table and the hazards it flags, and launch.py --audit."""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.insight import audit, hooks

from conftest import ROOT


@pytest.fixture
def mixed_float16():
  keras.mixed_precision.set_global_policy('mixed_float16')
  yield 'mixed_float16'
  keras.mixed_precision.set_global_policy('float32')


class Float32Inside(keras.layers.Layer):
  """Ignores the policy: its weight is never autocast and it casts the input up."""

  def build(self, shape):
    self.w = self.add_weight(shape=(shape[-1], 4), dtype='float32', autocast=False)

  def call(self, x):
    return tf.matmul(tf.cast(x, tf.float32), self.w)


def test_clean_mixed_model_has_float32_variables_and_logits(mixed_float16):
  model = keras.Sequential(
    [
      keras.Input((8,)),
      keras.layers.Dense(16, activation='relu', name='hidden'),
      keras.layers.Dense(3, dtype='float32'),
    ],
    name='clean',
  )
  rows, hazards = audit.audit(model)
  assert [(r.cls, r.compute_dtype, r.variable_dtype, r.output_dtype, r.params) for r in rows] == [
    ('Dense', 'float16', 'float32', 'float16', 8 * 16 + 16),
    ('Dense', 'float32', 'float32', 'float32', 16 * 3 + 3),
  ]
  assert hazards == []
  text = audit.markdown(model, mixed_float16, rows, hazards)
  assert '| clean/hidden | Dense | float16 | float32 | float16 | 144 |' in text
  assert 'No hazards' in text and '195 parameters' in text


def test_flags_each_hazard_once(mixed_float16):
  model = keras.Sequential(
    [
      keras.Input((8,)),
      keras.layers.Dense(16, dtype='float16', name='half_weights'),
      Float32Inside(name='float32_inside'),
      keras.layers.Dense(16, name='ok'),
      keras.layers.Dense(3, activation='softmax', name='half_softmax'),  # float16 output too
    ],
    name='hazards',
  )
  _, hazards = audit.audit(model)
  found = sorted((h.layer, h.kind) for h in hazards)
  assert found == [
    ('hazards/float32_inside', 'not autocast'),
    ('hazards/half_softmax', 'low-precision logits'),  # named by the layer making it
    ('hazards/half_softmax', 'low-precision softmax'),
    ('hazards/half_weights', 'low-precision variables'),
  ]
  assert all('float32' in h.message for h in hazards)  # each says what to do


class Subclassed(keras.Model):
  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.hidden = keras.layers.Dense(16, name='hidden')
    self.inside = Float32Inside(name='float32_inside')
    self.head = keras.layers.Dense(3, name='head')  # float16 logits

  def call(self, x):
    return self.head(self.inside(self.hidden(x)))


def test_a_subclassed_model_is_audited_through_one_forward_pass(mixed_float16):
  """Keras records no layer outputs for a subclassed model: without `run` its output dtypes
  are '?' and its float16 logits go unseen."""
  model = Subclassed(name='sub')
  model(tf.zeros([2, 8]))
  rows, hazards = audit.audit(model)
  assert [r.output_dtype for r in rows] == ['?'] * 3 and hazards == []

  labels = tf.constant([0, 1])

  def loss():  # a hand-written cross-entropy: its log-softmax runs in the logits' dtype
    logits = model(tf.ones([2, 8]))
    return -tf.reduce_sum(tf.one_hot(labels, 3, dtype=logits.dtype) * tf.nn.log_softmax(logits), -1)

  rows, hazards = audit.audit(model, run=loss)
  assert [(r.name, r.output_dtype) for r in rows] == [
    ('sub/hidden', 'float16'),
    ('sub/float32_inside', 'float32'),
    ('sub/head', 'float16'),
  ]
  assert sorted((h.layer, h.kind) for h in hazards) == [
    ('sub/float32_inside', 'not autocast'),
    ('sub/head', 'low-precision logits'),
  ]
  assert 'the loss computes LogSoftmax on it in float16' in hazards[-1].message

  # What the loss receives decides: logits cast to float32 first, or Keras's cross-entropy
  # (whose op gets them cast to float32, as tf.nn's does), and the float16 output is no hazard.
  def cast_loss():
    logits = tf.cast(model(tf.ones([2, 8])), tf.float32)
    return tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)

  def keras_loss():
    logits = model(tf.ones([2, 8]))
    return keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)

  for run in (cast_loss, keras_loss):
    _, hazards = audit.audit(model, run=run)
    assert [h.kind for h in hazards] == ['not autocast']

  assert 'call' not in vars(model) and 'call' not in vars(model.head)  # the hooks are gone


class FloatIds(keras.Model):
  def __init__(self, vocabulary=5000, **kwargs):
    super().__init__(**kwargs)
    self.embed = keras.layers.Embedding(vocabulary, 4, name='embed')
    self.head = keras.layers.Dense(3, dtype='float32')

  def call(self, ids):
    return self.head(self.embed(ids)), None  # a None beside the logits (a cache, say)


@pytest.mark.parametrize('policy', ['mixed_bfloat16', 'mixed_float16'])
def test_float_token_ids_into_an_embedding(policy):
  """A subclassed model casts its float inputs to the compute dtype, so float ids reach the
  Embedding rounded: in bfloat16 id 257 looks up row 256. A Functional model's float32 Input
  reaches it as float32 (an Embedding does not autocast): exact, as integer ids are."""
  keras.mixed_precision.set_global_policy(policy)
  try:

    def functional(dtype):
      ids = keras.Input((4,), dtype=dtype)
      embedded = keras.layers.Embedding(5000, 4, name='embed')(ids)
      return keras.Model(ids, keras.layers.Dense(3, dtype='float32')(embedded))

    assert audit.audit(functional('float32'))[1] == []
    assert audit.audit(functional('int32'))[1] == []
    model = FloatIds(name='float_ids')
    model(tf.zeros([2, 4]))
    # The premise: the Embedding gets the ids the model cast (id 257 becomes 256 in bfloat16,
    # 2049 becomes 2048 in float16); given float32 ids itself, it reads the right row.
    first = 257.0 if policy == 'mixed_bfloat16' else 2049.0
    with hooks.recording(model, None) as calls:
      model(tf.fill([1, 4], first))
    got = next(c.args[0] for c in calls if c.layer is model.embed)
    assert got.dtype.name == policy[6:] and float(got[0, 0]) == first - 1
    model.embed.embeddings.assign(np.tile([[0.0], [1.0]], [2500, 4]))  # odd rows 1, even 0
    assert float(model.embed(tf.constant([first]))[0, 0]) == 1.0
    _, hazards = audit.audit(model, run=lambda: model(tf.fill([2, 4], 257.0)))
    assert [(h.layer, h.kind) for h in hazards] == [('float_ids/embed', 'float token ids')]
    limit = '256' if policy == 'mixed_bfloat16' else '2048'
    assert f'ids above {limit} of its 5000 turn into other ids' in hazards[0].message
    model(tf.zeros([2, 4], tf.int32))
    assert audit.audit(model, run=lambda: model(tf.fill([2, 4], 257)))[1] == []
    small = FloatIds(vocabulary=200)  # every id below 257: exact in either dtype
    assert audit.audit(small, run=lambda: small(tf.fill([2, 4], 7.0)))[1] == []
  finally:
    keras.mixed_precision.set_global_policy('float32')


class Failing(keras.Model):
  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.head = keras.layers.Dense(3, dtype='float32')
    self.fail = False

  def call(self, x):
    if self.fail:
      raise RuntimeError('broken')
    return self.head(x)


def test_a_failing_forward_pass_leaves_the_audit_without_output_dtypes(mixed_float16, caplog):
  """The audit is a diagnostic: a forward pass that fails is a warning, not a stopped run."""
  model = Failing()
  model(tf.zeros([2, 8]))
  model.fail = True
  rows, hazards = audit.audit(model, run=lambda: model(tf.zeros([2, 8])))
  assert [r.output_dtype for r in rows] == ['?'] and hazards == []
  assert 'the forward pass of failing failed (RuntimeError: broken)' in caplog.text


def test_nested_models_are_walked(mixed_float16):
  inner = keras.Sequential(
    [keras.Input((4,)), keras.layers.Dense(5, name='inner_dense')], name='inner'
  )
  outer = keras.Sequential(
    [keras.Input((4,)), inner, keras.layers.Dense(2, dtype='float32')], name='outer'
  )
  names = [r.name for r in audit.audit(outer)[0]]
  assert names[:2] == ['outer/inner', 'outer/inner/inner_dense']


def test_launch_audit_prints_and_writes_markdown(tmp_path):
  workdir = tmp_path / 'run'
  result = subprocess.run(
    [
      sys.executable,
      'launch.py',
      '--config=configs/shakespeare.py',
      '--audit',
      '--config.data.dir=../shared/data/tinyshakespeare',
      f'--workdir={workdir}',
      '--config.model_config.num_layers=1',
      '--config.precision.policy=mixed_float16',
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2'},
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert (
    '| transformer_lm/block0/block0_attention | CausalSelfAttention | float16 | float32 |'
    in result.stdout
  )
  assert '| transformer_lm/logits | Dense | float32 | float32 | float32 |' in result.stdout
  assert 'No hazards' in result.stdout
  assert (workdir / 'audit.md').read_text() == result.stdout.rstrip('\n') + '\n'
  assert not (workdir / 'checkpoints').exists()  # audit does not train


class PatchEncoder(keras.layers.Layer):
  """A ViT's patch encoder: a projection and a position embedding, layers held as attributes."""

  def __init__(self, patches, width, **kwargs):
    super().__init__(**kwargs)
    self.patches = patches
    self.projection = keras.layers.Dense(width)
    self.position = keras.layers.Embedding(patches, width)

  def call(self, x):
    return self.projection(x) + self.position(keras.ops.arange(self.patches))


def _attention_model(dtype=None, dropout=0.1):
  from trainer.step import precision

  def build():
    inputs = keras.Input((16, 8))
    h = PatchEncoder(16, 32, name='patches')(inputs)
    h = keras.layers.MultiHeadAttention(2, 16, dropout=dropout, name='attention', dtype=dtype)(h, h)
    logits = keras.layers.Dense(10, dtype='float32', name='logits')(keras.layers.Flatten()(h))
    return keras.Model(inputs, logits, name='vit')

  return precision.build_model(build, '')


def test_nested_layers_are_counted_listed_and_checked():
  """Issue 35: MultiHeadAttention and a custom PatchEncoder showed 0 parameters and dtype '-',
  and attention's own softmax (bfloat16 with dropout) was neither listed nor flagged."""
  keras.mixed_precision.set_global_policy('mixed_bfloat16')
  try:
    model = _attention_model()
    rows, hazards = audit.audit(model, run=lambda: model(tf.ones([1, 16, 8])))
    by_name = {r.name: r for r in rows}
    for name in ('patches', 'attention'):
      layer = model.get_layer(name)
      assert by_name[f'vit/{name}'].params == layer.count_params() > 0
      assert by_name[f'vit/{name}'].variable_dtype == 'float32'
    projection = model.get_layer('patches').projection
    assert by_name[f'vit/patches/{projection.name}'].params == 8 * 32 + 32
    (softmax,) = [r for r in rows if r.cls == 'Softmax']  # Keras numbers the names: softmax_N
    assert softmax.name.startswith('vit/attention/softmax')
    assert (softmax.cls, softmax.compute_dtype, softmax.output_dtype) == (
      'Softmax',
      'bfloat16',
      'bfloat16',
    )
    assert [(h.layer, h.kind) for h in hazards] == [(softmax.name, 'low-precision softmax')]
    assert 'give vit/attention dtype="float32"' in hazards[0].message
    # The fix the message gives works: attention (and its softmax) in float32.
    fixed = _attention_model('float32')
    rows, hazards = audit.audit(fixed, run=lambda: fixed(tf.ones([1, 16, 8])))
    assert hazards == []
    assert [r.compute_dtype for r in rows if r.cls == 'Softmax'] == ['float32']
    # Without dropout Keras computes attention's softmax in float32 (dot_product_attention) and
    # never calls the Softmax layer: listed, not flagged.
    plain = _attention_model(dropout=0.0)
    rows, hazards = audit.audit(plain, run=lambda: plain(tf.ones([1, 16, 8])))
    assert [r.name.split('/')[1] for r in rows if r.cls == 'Softmax'] == ['attention']
    assert hazards == []
  finally:
    keras.mixed_precision.set_global_policy('float32')
