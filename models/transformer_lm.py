"""A character-level decoder-only Transformer language model on Tiny Shakespeare.

Pre-norm blocks (TransformerBlock): x + CausalSelfAttention(LayerNorm(x)), then
x + MLP(LayerNorm(x)); a final LayerNorm and a float32 Dense to the vocabulary. With
config.train.remat each block recomputes its activations in the backward pass.
What stays float32 under a mixed policy:
  * every variable (the layers build float32 weights; trainer/nn/layers.py);
  * the attention softmax and its -inf causal mask (CausalSelfAttention);
  * layer normalization (statistics and result in float32, cast back; trainer/nn/layers.py:
    LayerNorm, Keras's layer with its backward pass written out);
  * the logits (`dtype='float32'` on the last layer) and the cross-entropy.
The matmuls and the residual stream run in the policy's compute dtype.

Model keys (config.model_config, unchecked by the schema): context, d_model, num_heads,
num_layers, mlp_ratio, dropout, val_fraction, attention ('auto': 'chunked' where the context spans
more than one block and dropout is 0, else 'full'; 'chunked': the exact memory-efficient
attention, queries in blocks of attention_chunk positions, each block's weights recomputed in
the backward pass; 'full': the plain [batch, heads, time, time] softmax; trainer/nn/layers.py).

Sample text from a trained workdir:
  python -m models.transformer_lm --workdir=runs/shakespeare --prompt='ROMEO:' --length=300
"""

from __future__ import annotations

import os

import keras
import ml_collections
import numpy as np
import tensorflow as tf

from models import model_section
from trainer import Datasets, Trainer
from trainer.nn import remat
from trainer.data import shakespeare
from trainer.errors import ConfigError, DataError, UserError
from trainer.nn.layers import (
  ATTENTION,
  CausalSelfAttention,
  LayerNorm,
  TokenAndPositionEmbedding,
  gelu_float32,
)

MODEL_DEFAULTS = dict(
  context=128,
  d_model=128,
  num_heads=4,
  num_layers=4,
  mlp_ratio=4,
  dropout=0.0,
  val_fraction=0.1,
  attention='auto',
  attention_chunk=64,
)


def model_config(config) -> ml_collections.ConfigDict:
  """config.model_config with the defaults above filled in."""
  return model_section(config, MODEL_DEFAULTS, 'the Transformer LM')


@keras.saving.register_keras_serializable(package='models')
class TransformerBlock(keras.layers.Layer):
  """One pre-norm block: x + attention(ln1(x)), then x + mlp_out(gelu(mlp_in(ln2(x)))).

  A layer of its own so that gradient checkpointing (config.train.remat, trainer/nn/remat.py) can
  recompute it as a unit (`remat=True`): only its input is then kept for the backward pass.
  Its sublayers are named `<block name>_ln1`, `_attention`, `_mlp_in`, ... (`layers` lists them
  for the audit).
  """

  def __init__(
    self,
    d_model: int,
    num_heads: int,
    mlp_ratio: int,
    dropout: float = 0.0,
    remat: bool = False,
    attention: str = 'auto',
    attention_chunk: int = 64,
    **kwargs,
  ):
    super().__init__(**kwargs)
    self.remat = bool(remat)
    self.d_model, self.num_heads = int(d_model), int(num_heads)
    self.mlp_ratio, self.dropout = int(mlp_ratio), float(dropout)
    n, p = self.name, self.dtype_policy
    self.ln1 = LayerNorm(epsilon=1e-5, name=f'{n}_ln1', dtype=p)
    self.attention_kind, self.attention_chunk = attention, int(attention_chunk)
    self.attention = CausalSelfAttention(
      num_heads,
      dropout=dropout,
      attention=attention,
      chunk=attention_chunk,
      name=f'{n}_attention',
      dtype=p,
    )
    self.ln2 = LayerNorm(epsilon=1e-5, name=f'{n}_ln2', dtype=p)
    # GELU in float32: bfloat16 element-wise erf is emulated on a CPU (trainer/nn/layers.py).
    self.mlp_in = keras.layers.Dense(
      mlp_ratio * d_model, activation=gelu_float32, name=f'{n}_mlp_in', dtype=p
    )
    self.mlp_out = keras.layers.Dense(d_model, name=f'{n}_mlp_out', dtype=p)
    self.drop1 = keras.layers.Dropout(dropout, name=f'{n}_drop1', dtype=p)
    self.drop2 = keras.layers.Dropout(dropout, name=f'{n}_drop2', dtype=p)

  @property
  def layers(self):
    return [self.ln1, self.attention, self.ln2, self.mlp_in, self.mlp_out]

  def build(self, input_shape):
    shape = tuple(input_shape)
    self.ln1.build(shape)
    self.attention.build(shape)
    self.ln2.build(shape)
    self.mlp_in.build(shape)
    self.mlp_out.build((*shape[:-1], self.mlp_ratio * self.d_model))

  def call(self, x, training=False):
    return remat.checkpoint(lambda x: self.forward(x, training), x, enabled=self.remat)

  def forward(self, x, training=False):
    h = self.attention(self.ln1(x), training=training)
    if self.dropout:
      h = self.drop1(h, training=training)
    x = x + h
    h = self.mlp_out(self.mlp_in(self.ln2(x)))
    if self.dropout:
      h = self.drop2(h, training=training)
    return x + h

  def compute_output_shape(self, input_shape):
    return input_shape

  def get_config(self):
    return {
      **super().get_config(),
      'd_model': self.d_model,
      'num_heads': self.num_heads,
      'mlp_ratio': self.mlp_ratio,
      'dropout': self.dropout,
      'remat': self.remat,
      'attention': self.attention_kind,
      'attention_chunk': self.attention_chunk,
    }


def build_transformer(vocab_size: int, m, config=None) -> keras.Model:
  """The model; with `config.train.remat` on, every block recomputes its activations in the
  backward pass (trainer/nn/remat.py)."""
  config = config or {}
  remat.check_no_dropout(config, m.dropout, 'config.model_config.dropout')
  if m.attention not in ATTENTION:
    raise ConfigError(f'config.model_config.attention={m.attention!r}: must be one of {ATTENTION}')
  if m.attention == 'chunked' and m.dropout:
    raise ConfigError(
      "config.model_config.attention='chunked' recomputes the attention weights "
      'in the backward pass: set config.model_config.dropout=0'
    )
  tokens = keras.Input((None,), dtype='int32', name='tokens')
  x = TokenAndPositionEmbedding(vocab_size, m.context, m.d_model, name='embed')(tokens)
  for i in range(m.num_layers):
    x = TransformerBlock(
      m.d_model,
      m.num_heads,
      m.mlp_ratio,
      m.dropout,
      remat=remat.enabled(config),
      attention=m.attention,
      attention_chunk=m.attention_chunk,
      name=f'block{i}',
    )(x)
  x = LayerNorm(epsilon=1e-5, name='final_ln')(x)
  logits = keras.layers.Dense(vocab_size, dtype='float32', name='logits')(x)  # float32 logits
  return keras.Model(tokens, logits, name='transformer_lm')


def windows(ids: np.ndarray, length: int, stride: int) -> np.ndarray:
  """Every `length`-long slice of `ids` starting at 0, stride, 2*stride, ... [N, length]."""
  starts = np.arange(0, len(ids) - length + 1, stride)
  return ids[starts[:, None] + np.arange(length)[None]]


class TransformerLmTrainer(Trainer):
  # The model's config section, defaults filled in (a subclass with other keys sets its own).
  settings = staticmethod(model_config)

  def build_datasets(self):
    c = self.config
    self.m = self.settings(c)
    self.corpus = shakespeare.Corpus.from_text(shakespeare.load(c.data.dir), self.m.val_fraction)
    span = self.m.context + 1  # inputs and the targets shifted by one
    if len(self.corpus.val) < span:
      raise DataError(
        f'the validation split has {len(self.corpus.val)} characters, fewer than '
        f'config.model_config.context + 1 = {span}'
      )
    train_ids = tf.constant(self.corpus.train)
    last_start = len(self.corpus.train) - span

    def to_window(starts):
      w = tf.gather(train_ids, starts[:, None] + tf.range(span)[None])
      return w[:, :-1], w[:, 1:]

    # Endless: windows at uniformly random offsets (seeded), a fresh sample every step.
    train = (
      tf.data.Dataset.random(seed=c.seed)
      .map(lambda r: tf.cast(r % (last_start + 1), tf.int32))
      .batch(c.train.batch_size, drop_remainder=True)
      .map(to_window, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
      .prefetch(tf.data.AUTOTUNE)
    )
    # One pass over non-overlapping windows covering the validation split.
    val = windows(self.corpus.val, span, self.m.context)
    eval_ = (
      tf.data.Dataset.from_tensor_slices((val[:, :-1], val[:, 1:]))
      .batch(c.train.batch_size)
      .cache()
      .prefetch(tf.data.AUTOTUNE)
    )
    return Datasets(train=train, eval=eval_, train_examples=int(last_start + 1))

  def build_model(self):
    return build_transformer(len(self.corpus.vocab), self.m, self.config)

  def compute_loss(self, batch, *, training):
    """Per sequence: the mean cross-entropy over its positions (nats per character), float32."""
    inputs, targets = batch
    logits = tf.cast(self.logits(inputs, training), tf.float32)
    per_char = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=targets, logits=logits)
    correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), targets), tf.float32)
    return tf.reduce_mean(per_char, -1), {'accuracy': tf.reduce_mean(correct, -1)}

  def logits(self, inputs, training=False):
    """The model's logits [batch, time, vocab] for token ids [batch, time]."""
    return self.model(inputs, training=training)

  # ---- sampling ----------------------------------------------------------------------------
  def sample(
    self, prompt: str = '\n', length: int = 500, temperature: float = 0.8, seed: int = 0
  ) -> str:
    """`length` characters continuing `prompt`, sampled at `temperature` from the model."""
    if temperature <= 0:
      raise ValueError(f'temperature must be > 0, got {temperature}')
    context = self.m.context
    ids = list(self.corpus.encode(prompt or '\n'))

    @tf.function(
      input_signature=[
        tf.TensorSpec([1, context], tf.int32),
        tf.TensorSpec([], tf.int32),
        tf.TensorSpec([2], tf.int32),
      ]
    )
    def next_id(window, position, rng):
      # Causal: the padding after `position` does not affect the logits at `position`.
      logits = tf.cast(self.logits(window), tf.float32)[0, position]
      return tf.random.stateless_categorical(logits[None] / temperature, 1, rng)[0, 0]

    for i in range(length):
      window = ids[-context:]
      padded = np.zeros([1, context], np.int32)
      padded[0, : len(window)] = window
      ids.append(int(next_id(padded, len(window) - 1, tf.constant([seed, i], tf.int32))))
    return self.corpus.decode(ids)


def generate(
  workdir: str, prompt: str = '\n', length: int = 500, temperature: float = 0.8, seed: int = 0
) -> str:
  """Restores the latest checkpoint of a Transformer LM workdir and samples text from it."""
  from trainer.run import lifecycle
  from trainer.run import config_record

  saved = config_record.read_config(workdir)  # the newest record; reading writes nothing
  if saved is None:
    raise UserError(
      f'{os.path.join(workdir, "config.json")} not found: --workdir must be a '
      'folder a training run wrote'
    )
  trainer = TransformerLmTrainer(ml_collections.ConfigDict(saved), workdir)
  lifecycle.restore(trainer, 'sampling')
  return trainer.sample(prompt, length, temperature, seed)


def main(argv):
  del argv
  from absl import flags

  f = flags.FLAGS
  try:
    print(generate(f.workdir, f.prompt, f.length, f.temperature, f.seed))
  except UserError as e:
    import sys

    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)


if __name__ == '__main__':
  from absl import app, flags

  flags.DEFINE_string('workdir', None, 'a workdir written by a transformer_lm training run')
  flags.DEFINE_string('prompt', '\n', 'text to continue')
  flags.DEFINE_integer('length', 500, 'characters to sample')
  flags.DEFINE_float('temperature', 0.8, 'softmax temperature (lower: more conservative)')
  flags.DEFINE_integer('seed', 0, 'sampling seed')
  flags.mark_flags_as_required(['workdir'])
  app.run(main)
