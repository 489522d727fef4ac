"""A KerasHub causal LM (GPT-2's architecture), randomly initialised, on Tiny Shakespeare.

KerasHub (`pip install -e '.[keras-hub]'`) builds the model: `keras_hub.models.GPT2Backbone`
(token and position embeddings, pre-norm decoder layers `transformer_layer_<i>`, a final
`layer_norm`) inside `GPT2CausalLM`, whose logits come from the token embedding itself (a tied
`ReversibleEmbedding`). No weights are downloaded: the backbone is built from the config's sizes.
The data, the windows and the sampling are models/transformer_lm.py's; the logits are cast to
float32 before the loss. Under a mixed policy KerasHub's layers compute in the policy's dtype and
keep float32 variables; its attention softmax runs in float32 (Keras's dot-product attention).

Model keys (config.model_config, unchecked by the schema): context, hidden_dim, num_layers,
num_heads, intermediate_dim, dropout, val_fraction. The layers' paths, as every tool prints them:
`gpt2_causal_lm/gpt2_backbone/transformer_layer_1/feedforward_intermediate_dense`.
"""

from __future__ import annotations

import ml_collections
import tensorflow as tf

from models import model_section
from models.transformer_lm import TransformerLmTrainer
from trainer.errors import ConfigError

MODEL_DEFAULTS = dict(
  context=128,
  hidden_dim=128,
  num_layers=2,
  num_heads=4,
  intermediate_dim=512,
  dropout=0.0,
  val_fraction=0.1,
)


def model_config(config) -> ml_collections.ConfigDict:
  """config.model_config with the defaults above filled in."""
  return model_section(config, MODEL_DEFAULTS, 'the KerasHub LM')


def build_gpt2(vocab_size: int, m):
  """A randomly initialised `GPT2CausalLM` of the sizes in `m` (no preprocessor: it takes token
  ids and a padding mask)."""
  try:
    import keras_hub  # pylint: disable=import-outside-toplevel  (an optional extra)
  except ImportError:
    raise ConfigError(
      "config.model='keras_hub_lm' needs KerasHub: pip install -e '.[keras-hub]'"
    ) from None
  backbone = keras_hub.models.GPT2Backbone(
    vocabulary_size=vocab_size,
    num_layers=m.num_layers,
    num_heads=m.num_heads,
    hidden_dim=m.hidden_dim,
    intermediate_dim=m.intermediate_dim,
    dropout=m.dropout,
    max_sequence_length=m.context,
  )
  return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


class KerasHubLmTrainer(TransformerLmTrainer):
  settings = staticmethod(model_config)

  def build_model(self):
    return build_gpt2(len(self.corpus.vocab), self.m)

  def logits(self, inputs, training=False):
    mask = tf.ones_like(inputs, tf.bool)  # every window is full: nothing is padding
    return self.model({'token_ids': inputs, 'padding_mask': mask}, training=training)
