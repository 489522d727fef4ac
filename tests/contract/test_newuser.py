"""A new user's mistakes, found by writing a first model from the README: each is one line
naming the hook and the fix, raised before the workdir is touched (or a warning line where the
run can still be right)."""

import gc
import logging as logging_lib

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl import logging

from tiny import TinyTrainer, tiny_config
from trainer import Datasets, Trainer
from trainer.data import checks
from trainer.insight import audit
from trainer.errors import UserError


def rejected(trainer_class, tmp_path, **overrides) -> str:
  workdir = tmp_path / 'work'
  with pytest.raises(UserError) as info:
    trainer_class(tiny_config(**overrides), str(workdir))
  message = str(info.value)
  assert message and '\n' not in message
  assert not workdir.exists()  # nothing written
  return message


@pytest.fixture
def warnings(monkeypatch):
  lines = []
  monkeypatch.setattr(logging, 'warning', lambda msg, *args: lines.append(msg % args))
  return lines


def points(n=256):
  rng = np.random.default_rng(0)
  x = rng.normal(size=(n, 8)).astype(np.float32)
  return x, (x[:, 0] > 0).astype(np.int32)


# ---- the audit ------------------------------------------------------------------------------
def test_functional_model_has_no_input_layer_hazard():
  """A functional model lists its InputLayer, whose float32 output is the input as fed: not a
  layer that 'computes in float32' (this warned on every keras.Model(inputs, outputs))."""
  keras.mixed_precision.set_global_policy('mixed_bfloat16')
  inputs = keras.Input((8,))
  hidden = keras.layers.Dense(16, activation='relu')(inputs)
  model = keras.Model(inputs, keras.layers.Dense(4, dtype='float32')(hidden))
  _, hazards = audit.audit(model, 'mixed_bfloat16')
  assert hazards == []


# ---- build_datasets -------------------------------------------------------------------------
def batched_by(size, drop_remainder=True):
  class Trainer(TinyTrainer):
    def build_datasets(self):
      x, y = points()
      data = tf.data.Dataset.from_tensor_slices((x, y))
      return Datasets(
        train=data.repeat().batch(size, drop_remainder=drop_remainder), eval=data.batch(size)
      )

  return Trainer


def test_train_batches_of_another_size_than_the_config(tmp_path):
  """Batches of 8 with batch_size 32 trained silently with the loss divided by 32 (a quarter of
  the loss and of the learning rate, and a progress line showing both)."""
  message = rejected(batched_by(8), tmp_path)
  assert message.startswith('build_datasets returned Datasets.train with leading dimension 8 ')
  assert 'config.train.batch_size=32' in message and 'drop_remainder=True' in message


def test_train_batches_of_unknown_size_warn(tmp_path, warnings):
  batched_by(32, drop_remainder=False)(tiny_config(), str(tmp_path / 'work'))
  assert any('batches of unknown size' in w and 'drop_remainder=True' in w for w in warnings)


def test_empty_eval_set(tmp_path):
  class Empty(TinyTrainer):
    def build_datasets(self):
      datasets = super().build_datasets()
      return datasets._replace(eval=datasets.eval.take(0))

  message = rejected(Empty, tmp_path)
  assert message.startswith('build_datasets returned an empty Datasets.eval')


def test_a_repeated_eval_set_is_one_line_before_training(tmp_path):
  """Issue 35: an eval set with .repeat() passed the hook check, trained, then the final eval
  never ended. Its cardinality is INFINITE before training: one line, nothing written."""

  class Repeated(TinyTrainer):
    def build_datasets(self):
      datasets = super().build_datasets()
      return datasets._replace(eval=datasets.eval.repeat())

  message = rejected(Repeated, tmp_path)
  assert message.startswith('build_datasets returned an infinite Datasets.eval')
  assert '.repeat()' in message


def test_an_eval_set_longer_than_the_bound_is_one_line_before_training(tmp_path):
  """config.train.eval_max_batches: an eval set tf.data knows to be longer (16 batches of 32
  here) is refused at the hook check, naming the key."""
  message = rejected(TinyTrainer, tmp_path, **{'train.eval_max_batches': 10})
  assert message.startswith('build_datasets returned a Datasets.eval of 16 batches, more than ')
  assert 'config.train.eval_max_batches=10' in message
  TinyTrainer(tiny_config(**{'train.eval_max_batches': 16}), str(tmp_path / 'ok'))  # its length


def test_an_eval_set_of_unknown_length_past_the_bound_is_one_line_when_reached(tmp_path):
  """A generator that loops has no known length: the eval stops at the batch past the bound,
  in one line naming the key, after the trained steps were saved."""

  class Looping(TinyTrainer):
    def build_datasets(self):
      datasets = super().build_datasets()
      x, y = next(iter(datasets.eval))

      def forever():
        while True:
          yield x.numpy(), y.numpy()

      spec = datasets.eval.element_spec
      looping = tf.data.Dataset.from_generator(forever, output_signature=spec)
      return datasets._replace(eval=looping)

  trainer = Looping(tiny_config(**{'train.steps': 5, 'train.eval_max_batches': 3}), str(tmp_path))
  with pytest.raises(UserError) as info:
    trainer.train()
  message = str(info.value)
  assert '\n' not in message
  assert message.startswith('the eval set yielded more than config.train.eval_max_batches=3 ')
  assert (tmp_path / 'checkpoints' / 'ckpt-5.index').exists()  # saved before the eval


# ---- compute_loss ---------------------------------------------------------------------------
def test_metrics_as_a_list(tmp_path):
  """It said 'compute_loss returned a tuple of 2', which is what the README asks for."""

  class ListMetrics(TinyTrainer):
    def compute_loss(self, batch, *, training):
      loss, metrics = super().compute_loss(batch, training=training)
      return loss, list(metrics.values())

  message = rejected(ListMetrics, tmp_path)
  assert message.startswith('compute_loss returned (loss, list); the second item must be a dict')


@pytest.mark.parametrize('name', ['loss', 'skipped', 'learning_rate'])
def test_metric_with_a_name_the_trainer_uses(tmp_path, name):
  """A metric named 'loss' replaced the loss in the progress line and the eval; 'skipped' or
  'steps' vanished into the step counters."""

  class Clash(TinyTrainer):
    def compute_loss(self, batch, *, training):
      loss, metrics = super().compute_loss(batch, training=training)
      return loss, {name: metrics['accuracy']}

  message = rejected(Clash, tmp_path)
  assert message.startswith(f"compute_loss returned a metric named '{name}', a name the trainer")


def test_loss_without_gradients(tmp_path):
  """A loss cut off from the model (NumPy, .numpy(), tf.stop_gradient) failed at the first
  compiled call with a Keras traceback ('No gradients provided for any variable'), after the
  workdir was written."""

  class Cut(TinyTrainer):
    def compute_loss(self, batch, *, training):
      x, y = batch
      logits = tf.stop_gradient(self.model(x, training=training))
      return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True), {}

  message = rejected(Cut, tmp_path)
  assert message.startswith('compute_loss returned a loss (float32 [32]) that does not depend on')


def test_an_error_in_compute_loss_names_the_batch(tmp_path):
  class Typo(TinyTrainer):
    def compute_loss(self, batch, *, training):
      x, y, w = batch  # the batch is (x, y)
      return super().compute_loss((x, y), training=training)

  with pytest.raises(ValueError) as info:
    Typo(tiny_config(), str(tmp_path / 'work'))
  assert 'first eval batch, float32 [32, 8], int32 [32]' in ''.join(info.value.__notes__)


def test_nonfinite_loss_at_the_initial_weights_warns(tmp_path, warnings):
  class LogZero(TinyTrainer):
    def compute_loss(self, batch, *, training):
      x, _ = batch
      return -tf.math.log(tf.reduce_sum(self.model(x, training=training), -1) * 0.0), {}

  LogZero(tiny_config(), str(tmp_path / 'work'))
  assert any(
    w.startswith('compute_loss returned a non-finite loss (inf) for 32 of 32 examples')
    for w in warnings
  )


# ---- the hooks' signatures and results ------------------------------------------------------
def test_compute_loss_without_training(tmp_path):
  class NoTraining(TinyTrainer):
    def compute_loss(self, batch):  # pylint: disable=arguments-differ
      return super().compute_loss(batch, training=False)

  message = rejected(NoTraining, tmp_path)
  assert message.startswith('NoTraining.compute_loss(batch) cannot be called as the trainer')
  assert message.endswith('define it as `def compute_loss(self, batch, *, training):`')


def test_build_datasets_taking_the_config(tmp_path):
  class WithConfig(TinyTrainer):
    def build_datasets(self, config):  # pylint: disable=arguments-differ
      return super().build_datasets()

  message = rejected(WithConfig, tmp_path)
  assert 'define it as `def build_datasets(self):`' in message


def test_a_positional_training_argument_is_fine(tmp_path):
  class Positional(TinyTrainer):
    def compute_loss(self, batch, training):  # pylint: disable=arguments-differ
      return super().compute_loss(batch, training=training)

  Positional(tiny_config(**{'train.steps': 2}), str(tmp_path / 'work')).train()


def test_misspelled_compute_loss(tmp_path):
  class Misspelled(TinyTrainer):
    compute_losses = TinyTrainer.compute_loss
    compute_loss = Trainer.compute_loss  # as if TinyTrainer had not defined it

  message = rejected(Misspelled, tmp_path)
  assert message.startswith('Misspelled does not define compute_loss')


def test_build_model_returning_none(tmp_path):
  class NoReturn(TinyTrainer):
    def build_model(self):
      super().build_model()

  message = rejected(NoReturn, tmp_path)
  assert message.startswith('build_model returned None; return a keras.Model')


def test_a_model_class_named_with_an_underscore(tmp_path):
  """Keras names a model `_Net` '__net', which TensorFlow refuses as a root name scope: it
  trained, then failed at the first evaluation (Keras's fit fails at its first step)."""

  class _Net(keras.Model):  # pylint: disable=invalid-name
    def __init__(self, **kwargs):
      super().__init__(**kwargs)
      self.dense = keras.layers.Dense(4, dtype='float32')

    def call(self, x):
      return self.dense(x)

  class Underscore(TinyTrainer):
    def build_model(self):
      return _Net()

  message = rejected(Underscore, tmp_path)
  assert message.startswith(
    "build_model returned a model named '__net' (Keras names it after its class, _Net)"
  )
  _Net.__name__ = 'Net'  # the same model, named 'net': trains and evaluates
  Underscore(tiny_config(**{'train.steps': 2}), str(tmp_path / 'named')).train()


@pytest.mark.parametrize('key', ['early_stopping', 'best_checkpoint'])
def test_a_misspelled_eval_metric_for_an_action(key, tmp_path):
  """It failed at the first eval, after steps of training and before any checkpoint."""
  message = rejected(TinyTrainer, tmp_path, **{f'{key}.metric': 'acuracy', 'train.eval_every': 5})
  assert message == (
    f"config.{key}.metric='acuracy' is not an eval metric; the eval reports "
    "loss, accuracy (did you mean 'accuracy'?)"
  )


def test_a_loss_written_for_whole_batches_passes_the_gradient_check(tmp_path):
  """The gradient check runs on one example; a loss that reshapes by the batch size failed
  there with a bare TensorFlow error. It now checks on the whole first eval batch instead."""

  class WholeBatches(TinyTrainer):
    def compute_loss(self, batch, *, training):
      loss, metrics = super().compute_loss(batch, training=training)
      return tf.reshape(tf.reshape(loss, [self.config.train.batch_size, 1]), [-1]), metrics

  WholeBatches(tiny_config(**{'train.steps': 2}), str(tmp_path / 'work')).train()

  class Broken(TinyTrainer):
    def compute_loss(self, batch, *, training):
      if training:
        raise RuntimeError('broken')
      return super().compute_loss(batch, training=training)

  with pytest.raises(RuntimeError) as info:
    Broken(tiny_config(), str(tmp_path / 'broken'))
  assert info.value.__notes__ == [
    '(raised by compute_loss(batch, training=True) on the first eval batch, float32 [32, 8], '
    'int32 [32], when the trainer checked its hooks: trainer/step/contract.py)'
  ]


def test_an_unbatched_train_set_of_sequences(tmp_path):
  """Sequences [T] against eval batches [B, T]: the batch-size check took T for a batch size
  ('leading dimension 8 ... not config.train.batch_size=32')."""

  class Sequences(TinyTrainer):
    def build_datasets(self):
      tokens = np.zeros([512, 8], np.int32)
      return Datasets(
        train=tf.data.Dataset.from_tensor_slices((tokens, tokens)).repeat(),
        eval=tf.data.Dataset.from_tensor_slices((tokens, tokens)).batch(32),
        train_examples=512,
      )

  message = rejected(Sequences, tmp_path)
  assert message == (
    'build_datasets returned an unbatched Datasets.train: its elements (int32 '
    '[8], int32 [8]) have one axis fewer than the eval batches (int32 [?, 8], '
    'int32 [?, 8]); add .batch(config.train.batch_size, drop_remainder=True) to '
    'the train dataset'
  )

  # Ten crops per eval image ([B, 10, 8] against train [B, 8]; labels [B] both) are batched.
  data = TinyTrainer(tiny_config(**{'train.steps': 1}), str(tmp_path / 'crops')).datasets
  checks.check_datasets(
    data._replace(eval=data.eval.map(lambda x, y: (tf.stack([x] * 10, 1), y))), batch_size=32
  )
  # Two views per train image ([32, 2, 8] against eval [?, 8]; labels [B] both) are batched too.
  checks.check_datasets(
    data._replace(train=data.train.map(lambda x, y: (tf.stack([x] * 2, 1), y))), batch_size=32
  )
  # And train batches of unknown size against eval crops with per-crop labels.
  unsized = tf.data.Dataset.from_tensor_slices(
    (np.zeros([64, 8], np.float32), np.zeros([64], np.int32))
  ).batch(32)
  crops = unsized.map(lambda x, y: (tf.stack([x] * 10, 1), tf.stack([y] * 10, 1)))
  checks.check_datasets(Datasets(train=unsized, eval=crops, train_examples=64))


def test_build_metrics_returning_a_list(tmp_path):
  class ListOfMetrics(TinyTrainer):
    def build_metrics(self):
      return [keras.metrics.AUC()]

  assert rejected(ListOfMetrics, tmp_path).startswith('build_metrics returned list; return a dict')


def test_action_without_the_event_argument(tmp_path):
  """It failed at the first progress line, with a traceback, after the workdir was written."""

  def hello():
    print('hello')

  class Hello(TinyTrainer):
    def build_actions(self):
      return super().build_actions() + [hello]

  message = rejected(Hello, tmp_path)
  assert message.startswith('build_actions: action hello cannot be called with one event')


# ---- resuming -------------------------------------------------------------------------------
def test_resume_with_a_changed_model_says_so(tmp_path, warnings):
  """The checkpoints were called 'unreadable' and the error asked whether they were written by
  another model; it is the model that changed, and the error says so."""
  workdir = str(tmp_path / 'work')
  TinyTrainer(tiny_config(**{'train.steps': 5}), workdir).train()

  class Wider(TinyTrainer):
    def build_model(self):
      return keras.Sequential(
        [
          keras.Input((8,)),
          keras.layers.Dense(32, activation='relu'),
          keras.layers.Dense(4, dtype='float32'),
        ],
        name='tiny',
      )

  with pytest.raises(UserError) as info:
    Wider(tiny_config(**{'train.steps': 10}), workdir).train()
  message = str(info.value)
  assert '\n' not in message and message.startswith('no checkpoint in ')
  assert 'another model than the one build_model() makes now' in message
  assert any('does not match this run' in w and "its 'model'" in w for w in warnings)
  assert not any('unreadable' in w for w in warnings)
  # TF's restore, failing half-way, logged one 'Value in checkpoint could not be found' line per
  # variable when collected (69 lines after the error, at exit, in a new user's run).
  tf_lines = []
  handler = logging_lib.Handler()
  handler.emit = lambda record: tf_lines.append(record.getMessage())
  logging_lib.getLogger('tensorflow').addHandler(handler)
  try:
    info = None
    gc.collect()
  finally:
    logging_lib.getLogger('tensorflow').removeHandler(handler)
  assert not [line for line in tf_lines if 'could not be found' in line]


def test_the_gradient_check_leaves_a_mirrored_run_alone(tmp_path):
  """Under MirroredStrategy the variables are distributed (no handle outside a replica
  context): the probe's gradient check must not touch them (it crashed every mirrored run)."""
  config = tiny_config(
    **{'train.steps': 2, 'distribute.strategy': 'mirrored', 'distribute.devices': 'CPU:0'}
  )
  TinyTrainer(config, str(tmp_path / 'work')).train()


def test_a_finished_run_says_it_trains_nothing(tmp_path, monkeypatch):
  """Running a finished run again printed 'training ...: 5 steps' and an eval, as if it had
  trained; it says there is nothing to train."""
  workdir = str(tmp_path / 'work')
  TinyTrainer(tiny_config(**{'train.steps': 5}), workdir).train()
  lines = []
  monkeypatch.setattr(logging, 'info', lambda msg, *args: lines.append(msg % args))
  TinyTrainer(tiny_config(**{'train.steps': 5}), workdir).train()
  assert any(
    line.startswith('the run is already at step 5 of 5: nothing to train') for line in lines
  )


def test_resume_with_another_optimizer_names_the_optimizer(tmp_path, warnings):
  """An optimizer change was reported as 'another model than the one build_model() makes'."""
  workdir = str(tmp_path / 'work')
  TinyTrainer(tiny_config(**{'train.steps': 5, 'optimizer.name': 'sgd'}), workdir).train()
  with pytest.raises(UserError) as info:
    TinyTrainer(
      tiny_config(
        **{'train.steps': 10, 'optimizer.name': 'adam', 'train.accept_config_change': True}
      ),
      workdir,
    ).train()
  message = str(info.value)
  assert 'another optimizer state than config.optimizer builds now' in message
  assert 'build_model' not in message
  assert any("its 'optimizer' does not match" in w for w in warnings)


def test_an_action_added_on_resume_starts_fresh(tmp_path):
  """Adding early stopping to a resumed run failed: the checkpoint had no state for it."""
  workdir = str(tmp_path / 'work')
  TinyTrainer(tiny_config(**{'train.steps': 5}), workdir).train()
  trainer = TinyTrainer(
    tiny_config(
      **{
        'train.steps': 10,
        'train.eval_every': 5,
        'early_stopping.metric': 'loss',
        'early_stopping.patience': 100,
        'train.accept_config_change': True,
      }
    ),
    workdir,
  )
  trainer.train()
  assert int(trainer.global_step.numpy()) == 10


def test_an_eval_path_with_other_weights_is_not_a_loss_without_gradient(tmp_path):
  """The gradient check differentiated compute_loss(training=False); a trainer that evaluates an
  average of the weights (a copy with no trainable variables) was refused."""

  class AveragedEval(TinyTrainer):
    def build_model(self):
      model = super().build_model()
      self.average = keras.models.clone_model(model)
      self.average.trainable = False
      return model

    def compute_loss(self, batch, *, training):
      x, y = batch
      logits = tf.cast((self.model if training else self.average)(x, training=training), tf.float32)
      return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True), {}

  trainer = AveragedEval(tiny_config(**{'train.steps': 2}), str(tmp_path / 'work'))
  trainer.train()
  assert int(trainer.global_step.numpy()) == 2


def test_a_hook_set_on_the_instance_counts(tmp_path):
  """compute_loss assigned in __init__ before super().__init__() was 'does not define'."""

  class Assigned(Trainer):
    build_datasets, build_model = TinyTrainer.build_datasets, TinyTrainer.build_model

    def __init__(self, config, workdir):
      self.compute_loss = lambda batch, *, training: TinyTrainer.compute_loss(
        self, batch, training=training
      )
      super().__init__(config, workdir)

  trainer = Assigned(tiny_config(**{'train.steps': 2}), str(tmp_path / 'a'))
  trainer.train()
  assert int(trainer.global_step.numpy()) == 2


def test_a_metric_with_the_three_methods_is_accepted(tmp_path):
  class Count:
    """Not a keras.metrics.Metric: update_state, result and reset_state are enough."""

    def __init__(self):
      self.total = keras.Variable(0.0, trainable=False)

    def update_state(self, values):
      self.total.assign_add(tf.reduce_sum(values))

    def result(self):
      return self.total.value

    def reset_state(self):
      self.total.assign(0.0)

  class Counted(TinyTrainer):
    def build_metrics(self):
      return {'examples': Count()}

    def compute_loss(self, batch, *, training):
      loss, metrics = super().compute_loss(batch, training=training)
      return loss, {**metrics, 'examples': (tf.ones_like(loss),)}

  trainer = Counted(tiny_config(**{'train.steps': 2}), str(tmp_path / 'w'))
  assert trainer.train()['examples'] > 0
