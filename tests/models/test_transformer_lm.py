"""Tiny Shakespeare loader, the Transformer LM trainer and its sampling helper, on the real text."""

import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from configs import shakespeare as shakespeare_config
from models import transformer_lm
from trainer.data import shakespeare
from conftest import ROOT
from trainer.errors import ConfigError, DataError

DATA = os.path.join(
  ROOT,
  '..',
  'shared',
  'data',
  'tinyshakespeare',
)


def test_corpus_split_is_the_last_ten_percent_of_the_characters():
  text = shakespeare.load(DATA)
  assert len(text) == 1_115_394
  corpus = shakespeare.Corpus.from_text(text)
  assert len(corpus.vocab) == 65 and corpus.vocab == ''.join(sorted(corpus.vocab))
  assert len(corpus.val) == 111_539 and len(corpus.train) + len(corpus.val) == len(text)
  assert corpus.decode(corpus.val) == text[-111_539:]
  assert corpus.decode(corpus.train[:40]) == text[:40]
  np.testing.assert_array_equal(corpus.encode(text[:1000]), corpus.train[:1000])


def test_loader_errors_name_the_culprit(tmp_path):
  with pytest.raises(DataError, match='config.data.dir'):
    shakespeare.load(str(tmp_path / 'nowhere'))
  with pytest.raises(DataError, match='missing'):
    shakespeare.load(str(tmp_path))
  (tmp_path / 'input.txt').write_text('too short')
  with pytest.raises(DataError, match='only 9 characters'):
    shakespeare.load(str(tmp_path))
  (tmp_path / 'input.txt').write_text('another corpus. ' * 100)  # accepted: not the original
  assert shakespeare.load(str(tmp_path)).startswith('another corpus.')


def _tiny_config(policy):
  config = shakespeare_config.get_config()
  config.data.dir = DATA
  config.model_config.update(context=32, d_model=32, num_heads=2, num_layers=1)
  config.train.update(
    batch_size=32, steps=200, steps_per_loop=50, log_every=100, eval_every=0, checkpoint_every=200
  )
  config.optimizer.update(learning_rate=1e-2, warmup_steps=20)
  config.precision.policy = policy
  return config


def test_unknown_model_key_is_a_config_error(tmp_path):
  config = _tiny_config('float32')
  config.model_config.n_layers = 2
  with pytest.raises(ConfigError, match='config.model_config.n_layers'):
    transformer_lm.TransformerLmTrainer(config, str(tmp_path))


def test_loss_is_float32_per_sequence_under_mixed_float16(tmp_path):
  trainer = transformer_lm.TransformerLmTrainer(_tiny_config('mixed_float16'), str(tmp_path))
  batch = next(iter(trainer.datasets.eval))
  loss, metrics = trainer.compute_loss(batch, training=False)
  assert trainer.model.layers[-1].compute_dtype == 'float32'
  assert loss.dtype == tf.float32 and loss.shape == [32]
  assert metrics['accuracy'].shape == [32]
  # An untrained model is close to uniform over the 65 characters.
  assert abs(float(tf.reduce_mean(loss)) - math.log(65)) < 0.5
  keras.mixed_precision.set_global_policy('float32')


def test_trains_and_samples_from_its_checkpoint(tmp_path):
  from trainer.nn import layers

  workdir = str(tmp_path / 'run')
  trainer = transformer_lm.TransformerLmTrainer(_tiny_config('mixed_bfloat16'), workdir)
  kernels = [layers._gelu_forward.compiled, layers._gelu_backward.compiled]
  traces = lambda: [k.experimental_get_tracing_count() for k in kernels]
  before = traces()
  metrics = trainer.train()
  # The train step ran GELU as XLA kernels (trainer/nn/fused.py): forward and backward traced;
  # the sampling below calls the model outside the trainer's steps, as plain ops.
  assert all(a > b for a, b in zip(traces(), before))
  after_training = traces()
  assert metrics['loss'] < 2.9  # uniform is ln 65 = 4.17; unigram frequencies give ~3.3
  keras.mixed_precision.set_global_policy('float32')

  text = transformer_lm.generate(workdir, prompt='ROMEO:', length=60, seed=1)
  assert text.startswith('ROMEO:') and len(text) == 66
  assert set(text) <= set(trainer.corpus.vocab)
  assert transformer_lm.generate(workdir, prompt='ROMEO:', length=60, seed=1) == text
  assert ' ' in text[6:]  # it has learnt at least that words are separated by spaces
  assert traces() == after_training
