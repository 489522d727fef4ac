"""An op XLA cannot compile in the user's code, under config.train.jit_compile: one UserError line
naming the op, the user's line that made it and the key, for the train step and for the eval; an
eval's refusal comes after the trained steps are saved."""

import os

import numpy as np
import pytest
import tensorflow as tf

from tiny import TinyTrainer, tiny_config
from trainer import UserError
from trainer.step import user_code


class NumpyMetric(TinyTrainer):
  """A metric through tf.numpy_function (no XLA kernel): in the eval only, or in training too."""

  in_training = False

  def compute_loss(self, batch, *, training):
    loss, metrics = super().compute_loss(batch, training=training)
    if self.in_training or not training:
      odd = tf.numpy_function(lambda v: v * 0, [metrics['accuracy']], tf.float32)  # LINE
      metrics['odd'] = tf.ensure_shape(odd, metrics['accuracy'].shape)
    return loss, metrics


LINE = next(n for n, text in enumerate(open(__file__), 1) if text.rstrip().endswith('# LINE'))
WHERE = f'test_xla_refusal.py:{LINE} in compute_loss'


class EverywhereNumpyMetric(NumpyMetric):
  in_training = True


def test_the_train_steps_refusal_is_one_line_naming_the_op_and_the_users_line(tmp_path):
  trainer = EverywhereNumpyMetric(tiny_config(**{'train.jit_compile': 'true'}), str(tmp_path))
  with pytest.raises(UserError) as raised:
    trainer.train()
  message = str(raised.value)
  assert '\n' not in message
  assert message.startswith('config.train.jit_compile: XLA cannot compile the train step')
  assert f'PyFunc (tf.numpy_function), created at {WHERE}' in message, message
  assert isinstance(raised.value.__cause__, tf.errors.InvalidArgumentError)


def test_the_evals_refusal_comes_after_the_trained_steps_are_saved(tmp_path):
  config = tiny_config(**{'train.jit_compile': 'true', 'train.steps': 10})
  with pytest.raises(UserError, match=f'cannot compile the eval: it holds PyFunc .*{WHERE}'):
    NumpyMetric(config, str(tmp_path)).train()
  assert tf.train.latest_checkpoint(os.path.join(tmp_path, 'checkpoints')).endswith('ckpt-10')


def test_without_xla_the_same_code_trains_and_evaluates(tmp_path):
  metrics = EverywhereNumpyMetric(tiny_config(**{'train.steps': 5}), str(tmp_path)).train()
  assert metrics['odd'] == 0 and np.isfinite(metrics['loss'])


def test_tf_print_is_named_and_other_errors_pass_through():
  compiled = tf.function(lambda x: (tf.print(x), x)[1], jit_compile=True)
  with pytest.raises(tf.errors.InvalidArgumentError) as raised:
    tf.function(lambda x: compiled(x))(tf.constant(1.0))
  assert user_code.xla_refusal(raised.value).startswith('StringFormat (tf.print), created at')
  assert user_code.xla_refusal(tf.errors.InvalidArgumentError(None, None, 'bad shape')) is None
  with pytest.raises(tf.errors.InvalidArgumentError, match='bad shape'):
    with user_code.xla_errors('the eval'):
      raise tf.errors.InvalidArgumentError(None, None, 'bad shape')
