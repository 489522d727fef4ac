"""KerasHub as a source of models (models/keras_hub_lm.py), and the full layer path in every tool
(issue 58): a tiny decoder whose layer 1 `feedforward_intermediate_dense` kernel is x 1e5 under
mixed_float16 (layer 0 has a healthy layer of that name), built by KerasHub (GPT2CausalLM) and,
for runs without keras-hub, nested the same way from Keras layers: a functional backbone of
decoder layers inside a functional model, so Keras's own layer paths miss both models' names."""

import json
import logging
import math
import os

import keras
import pytest
import tensorflow as tf

from configs import keras_hub_lm as hub_config
from conftest import ROOT
from models.keras_hub_lm import KerasHubLmTrainer
from trainer import config as config_lib
from trainer.errors import ConfigError
from trainer.insight import advisor, audit, forensics, numerics
from trainer.nn import paths

DATA = os.path.join(ROOT, '..', 'shared', 'data', 'tinyshakespeare')
FFN = 'feedforward_intermediate_dense'


class DecoderLayer(keras.layers.Layer):
  """A pre-norm feedforward residual block named as KerasHub's decoder layers name theirs."""

  def __init__(self, hidden, **kwargs):
    super().__init__(**kwargs)
    self.norm = keras.layers.LayerNormalization(name='feedforward_layer_norm')
    self.up = keras.layers.Dense(2 * hidden, activation='gelu', name=FFN)
    self.down = keras.layers.Dense(hidden, name='feedforward_output_dense')

  def call(self, x):
    return x + tf.cast(self.down(self.up(self.norm(x))), x.dtype)


def keras_lm(vocab, m):
  ids = keras.Input((None,), dtype='int32')
  h = keras.layers.Embedding(vocab, m.hidden_dim, name='token_embedding')(ids)
  for i in range(m.num_layers):
    h = DecoderLayer(m.hidden_dim, name=f'transformer_layer_{i}')(h)
  h = keras.layers.LayerNormalization(name='layer_norm')(h)
  backbone = keras.Model(ids, h, name='backbone')
  outer = keras.Input((None,), dtype='int32')
  return keras.Model(outer, keras.layers.Dense(vocab, name='logits')(backbone(outer)), name='lm')


def planted(model):
  """Decoder layer 1's feedforward kernel x 1e5: its output passes float16's 65504."""
  (dense,) = [l for p, l in paths.walk(model) if p.endswith(f'/transformer_layer_1/{FFN}')]
  dense.kernel.assign(dense.kernel * 1e5)
  return model


class Small(KerasHubLmTrainer):
  def build_datasets(self):
    datasets = super().build_datasets()
    return datasets._replace(eval=datasets.eval.take(2))


class HubLm(Small):
  def build_model(self):
    return planted(super().build_model())


class KerasLm(Small):
  def build_model(self):
    return planted(keras_lm(len(self.corpus.vocab), self.m))

  def logits(self, inputs, training=False):
    return self.model(inputs, training=training)


SOURCES = {'keras': (KerasLm, 'lm/backbone'), 'keras_hub': (HubLm, 'gpt2_causal_lm/gpt2_backbone')}


def tiny(**overrides):
  config = hub_config.get_config()
  config.data.dir = DATA
  config.model_config.update(context=16, num_heads=2, intermediate_dim=256)
  config.train.update(
    batch_size=4, steps=4, steps_per_loop=2, log_every=2, eval_every=0, checkpoint_every=4
  )
  config.optimizer.warmup_steps = 0
  config.precision.policy = 'mixed_float16'
  for key, value in overrides.items():
    config_lib.set_dotted(config, key, value)
  return config


@pytest.fixture(autouse=True)
def float32_after():
  yield
  keras.mixed_precision.set_global_policy('float32')


@pytest.mark.parametrize('source', ['keras', 'keras_hub'])
def test_every_tool_names_the_overflowing_layer_by_its_full_path(source, tmp_path, caplog):
  if source == 'keras_hub':
    pytest.importorskip('keras_hub')
  cls, backbone = SOURCES[source]
  culprit = f'{backbone}/transformer_layer_1/{FFN}'
  healthy = f'{backbone}/transformer_layer_0/{FFN}'
  with caplog.at_level(logging.WARNING):
    trainer = cls(tiny(), str(tmp_path / 'run'))
  # The start-up check names the layer, not a loss problem.
  (warning,) = [r.getMessage() for r in caplog.records if 'non-finite loss' in r.getMessage()]
  assert f'layer {culprit} overflows' in warning and 'log(0)' not in warning, warning

  rows, hazards = audit.audit(trainer.model, trainer.policy, audit.forward(trainer))
  assert culprit in [r.name for r in rows] and healthy in [r.name for r in rows]
  # compute_loss casts the float16 logits to float32: the loss receives float32.
  assert [(h.layer, h.kind) for h in hazards] == [(culprit, 'overflow')], hazards

  stats, overall = numerics.Probe(trainer).measure()
  assert stats[culprit]['output_nonfinite'] == 1.0 and stats[healthy]['output_nonfinite'] == 0.0
  line = numerics.summary_line(0, stats, overall, scale=1.0, dtypes=['float16'])
  outputs = line.split('non-finite outputs in ')[1].split(';')[0]
  assert culprit in outputs and healthy not in outputs, line

  report = forensics.record(trainer, next(iter(trainer.datasets.train)), 0)
  assert report.line().startswith(f"first non-finite: forward output of '{culprit}' (Dense)")
  saved = json.loads((tmp_path / 'run' / 'forensics' / 'step-0' / 'report.json').read_text())
  assert saved['layer'] == culprit and saved['line'] == report.line()

  advice = advisor.advise(cls, tiny(), str(tmp_path / 'advise'), steps=1)
  table = advice.markdown()
  assert f'| {culprit} **float32** |' in table and f'| {healthy} |' in table, table
  assert all('transformer_layer_0' not in p for p in advice.condemned), advice.condemned
  assert f'{backbone}/transformer_layer_1' in advice.suggested, advice.suggested
  assert not any(a.startswith(b + '/') for a in advice.suggested for b in advice.suggested)

  # Pasted as the config value, the suggestion trains: layer 1 in float32, layer 0 in float16.
  fixed = cls(tiny(**{'precision.float32_layers': advice.suggested_value}), str(tmp_path / 'fix'))
  layers = dict(paths.walk(fixed.model))
  assert (layers[culprit].compute_dtype, layers[healthy].compute_dtype) == ('float32', 'float16')
  metrics = fixed.train()
  assert int(fixed.train_step.skipped_steps.numpy()) == 0 and math.isfinite(metrics['loss'])


def test_two_float32_layers_entries_reaching_one_layer_are_one_line(tmp_path):
  with pytest.raises(ConfigError) as info:
    KerasLm(tiny(**{'precision.float32_layers': f'transformer_layer_1,{FFN}'}), str(tmp_path))
  message = str(info.value)
  assert message.startswith(
    f"config.precision.float32_layers: 'transformer_layer_1' and '{FFN}' both reach layer "
    f'lm/backbone/transformer_layer_1/{FFN}'
  )
  assert '\n' not in message


def test_a_tied_output_embedding_gets_a_fix_that_applies():
  """GPT-2's logits come from its input embedding (ReversibleEmbedding): 'give the last layer
  dtype="float32"' cannot apply. Casting in the loss, or reverse_dtype, does. What counts is
  the dtype the loss receives: Keras's symbolic output says float16 either way."""
  keras.mixed_precision.set_global_policy('mixed_float16')
  ids = keras.Input((None,), dtype='int32')
  embedding = keras.layers.ReversibleEmbedding(50, 8, name='tokens')
  model = keras.Model(ids, embedding(embedding(ids), reverse=True), name='tied')
  batch = tf.constant([[1, 2, 3]])
  assert model.outputs[0].dtype == 'float16'

  def loss(cast):
    logits = model(batch)
    logits = tf.cast(logits, tf.float32) if cast else logits
    # A hand-written cross-entropy: its log-softmax runs in the logits' dtype (Keras's and
    # tf.nn's cross-entropy ops cast float16 logits to float32 themselves).
    return -tf.reduce_sum(tf.one_hot(batch, 50, dtype=logits.dtype) * tf.nn.log_softmax(logits), -1)

  # Keras 3.15 multiplies the float16 hidden states by the float32 embedding matrix (not
  # autocast): the logits are float32, no hazard.
  assert audit.audit(model, run=lambda: loss(cast=False))[1] == []
  embedding.reverse_dtype = 'float16'  # a projection that does compute in float16
  _, hazards = audit.audit(model, run=lambda: loss(cast=False))
  assert [(h.layer, h.kind) for h in hazards] == [('tied/tokens', 'low-precision logits')]
  assert 'reverse_dtype="float32" on tied/tokens' in hazards[0].message
  assert 'last layer' not in hazards[0].message
  assert audit.audit(model, run=lambda: loss(cast=True))[1] == []
  embedding.reverse_dtype = 'float32'
  assert audit.audit(model, run=lambda: loss(cast=False))[1] == []
