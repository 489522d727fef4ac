"""Issue 11's table, row by row: a new user's mistakes in their own hooks, on a small
Fashion-MNIST-like CNN (28x28x1 images, 10 classes) over synthetic data. Each mistake is a
one-line UserError naming the hook, what it returned and the fix, raised before the workdir is
opened (nothing written); or, for the last three rows, training that works (no .repeat()) or
starts with a clear message (float16 variables: an error unless allowed; float16 logits: a
warning)."""

import contextlib
import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl import logging
from tensorflow.python.framework import config as tf_config  # op determinism: on, off, state

from tiny import tiny_config
from trainer import Datasets, Trainer, TrainStep
from trainer.errors import ConfigError, UserError

N = 256


def images_and_labels():
  rng = np.random.default_rng(0)
  x = rng.random((N, 28, 28, 1), dtype=np.float32)
  y = rng.integers(0, 10, N).astype(np.int32)
  return x, y


class FashionTrainer(Trainer):
  """Correct hooks; each test breaks one of them as the issue's table did."""

  labels_column = False  # y.reshape(-1, 1)
  eval_batched = True
  repeat = True
  hidden_dtype = None
  logits_dtype = 'float32'

  def build_model(self):
    return keras.Sequential(
      [
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(4, 3, activation='relu'),
        keras.layers.MaxPooling2D(4),
        keras.layers.Flatten(),
        keras.layers.Dense(16, activation='relu', dtype=self.hidden_dtype),
        keras.layers.Dense(10, dtype=self.logits_dtype),
      ],
      name='fashion',
    )

  def build_datasets(self):
    x, y = images_and_labels()
    if self.labels_column:
      y = y.reshape(-1, 1)
    batch = self.config.train.batch_size
    data = tf.data.Dataset.from_tensor_slices((x, y))
    train = data.shuffle(N, seed=0)
    if self.repeat:
      train = train.repeat()
    train = train.batch(batch, drop_remainder=True)
    return Datasets(
      train=train, eval=data.batch(batch) if self.eval_batched else data, train_examples=N
    )

  def logits(self, images, training):
    return tf.cast(self.model(images, training=training), tf.float32)

  def compute_loss(self, batch, *, training):
    images, labels = batch
    logits = self.logits(images, training)
    loss = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), labels), tf.float32)
    return loss, {'accuracy': correct}


def config(**overrides):
  return tiny_config(**{'model': 'fashion', 'train.steps': 0, 'train.epochs': 1, **overrides})


def rejected(trainer_class, tmp_path, error=UserError) -> str:
  workdir = tmp_path / 'work'
  with pytest.raises(error) as info:
    trainer_class(config(), str(workdir))
  message = str(info.value)
  assert message and '\n' not in message
  assert not workdir.exists()  # nothing written
  return message


def test_correct_hooks_pass_and_train(tmp_path):
  metrics = FashionTrainer(config(), str(tmp_path / 'work')).train()
  assert set(metrics) == {'loss', 'accuracy'}


def test_labels_shaped_b_by_1(tmp_path):
  class Column(FashionTrainer):
    labels_column = True

  message = rejected(Column, tmp_path)
  assert message.startswith("compute_loss returned the metric 'accuracy' of shape [32, 32]")
  assert 'int32 [32, 1]' in message and 'y.reshape(-1)' in message


def test_metric_returned_as_the_batch_mean(tmp_path):
  class Mean(FashionTrainer):
    def compute_loss(self, batch, *, training):
      loss, metrics = super().compute_loss(batch, training=training)
      return loss, {'accuracy': tf.reduce_mean(metrics['accuracy'])}

  message = rejected(Mean, tmp_path)
  assert "the metric 'accuracy' as a scalar (float32 [])" in message
  assert 'one value per example, shape [B]' in message


def test_scalar_loss(tmp_path):
  class ScalarLoss(FashionTrainer):
    def compute_loss(self, batch, *, training):
      loss, metrics = super().compute_loss(batch, training=training)
      return tf.reduce_mean(loss), metrics

  message = rejected(ScalarLoss, tmp_path)
  assert message.startswith('compute_loss returned the loss as a scalar (float32 [])')
  assert 'drop the tf.reduce_mean' in message


def test_loss_of_shape_b_by_10(tmp_path):
  class WideLoss(FashionTrainer):
    def compute_loss(self, batch, *, training):
      images, labels = batch
      logits = self.logits(images, training)
      loss = tf.nn.softmax_cross_entropy_with_logits(tf.one_hot(labels, 10), logits)[:, None]
      return loss * tf.ones([1, 10]), {}

  message = rejected(WideLoss, tmp_path)
  assert message.startswith('compute_loss returned the loss of shape [32, 10] (float32 [32, 10])')
  assert 'it must be [B]' in message


def test_only_the_loss_returned(tmp_path):
  class LossOnly(FashionTrainer):
    def compute_loss(self, batch, *, training):
      return super().compute_loss(batch, training=training)[0]

  message = rejected(LossOnly, tmp_path)
  assert message.startswith('compute_loss returned float32 [32]; return a pair')
  assert 'return loss, {}' in message


def test_eval_dataset_not_batched(tmp_path):
  class Unbatched(FashionTrainer):
    eval_batched = False

  message = rejected(Unbatched, tmp_path)
  assert message.startswith('build_datasets returned an unbatched Datasets.eval')
  assert 'float32 [28, 28, 1], int32 []' in message
  assert '.batch(config.train.batch_size)' in message


def test_no_repeat_on_the_train_set_trains_past_the_epoch(tmp_path):
  class Finite(FashionTrainer):
    repeat = False

  # 256 examples / 32 = 8 batches per epoch; three epochs cross the end of the data twice.
  trainer = Finite(config(**{'train.epochs': 3}), str(tmp_path / 'work'))
  assert trainer.total_steps == 24
  trainer.train()
  assert int(trainer.global_step.numpy()) == 24


def test_float16_layer_is_an_error_unless_allowed(tmp_path):
  class Half(FashionTrainer):
    hidden_dtype = 'float16'

  trainer = Half(config(), str(tmp_path / 'work'))
  with pytest.raises(ConfigError) as info:
    trainer.train()
  message = str(info.value)
  assert '\n' not in message and 'low-precision variables' in message
  assert 'config.precision.allow_low_precision_variables=True' in message
  assert int(trainer.global_step.numpy()) == 0
  allowed = Half(
    config(**{'precision.allow_low_precision_variables': True, 'train.steps': 4}),
    str(tmp_path / 'allowed'),
  )
  allowed.train()
  assert int(allowed.global_step.numpy()) == 4


def test_low_precision_logits_warn_when_training_starts(tmp_path, monkeypatch):
  """Bfloat16 logits warn when the loss computes on them in bfloat16 (a hand-written
  log-softmax), not when compute_loss casts them to float32 first (issue 58)."""

  class CastLogits(FashionTrainer):
    logits_dtype = None  # follows the mixed policy: bfloat16 logits, cast by self.logits

  class HalfLogits(CastLogits):
    def compute_loss(self, batch, *, training):
      images, labels = batch
      logits = self.model(images, training=training)
      log_p = tf.nn.log_softmax(logits)  # in bfloat16
      loss = -tf.reduce_sum(tf.one_hot(labels, 10, dtype=log_p.dtype) * log_p, -1)
      return tf.cast(loss, tf.float32), {}

  for trainer_class, expected in ((CastLogits, 0), (HalfLogits, 1)):
    warnings = []
    monkeypatch.setattr(logging, 'warning', lambda msg, *args: warnings.append(msg % args))
    config_ = config(**{'precision.policy': 'mixed_bfloat16', 'train.steps': 2})
    trainer_class(config_, str(tmp_path / trainer_class.__name__)).train()
    hazards = [w for w in warnings if w.startswith('precision hazard')]
    assert len(hazards) == expected, hazards
  assert 'low-precision logits' in hazards[0] and 'LogSoftmax on it in bfloat16' in hazards[0]
  assert 'tf.cast(logits, tf.float32)' in hazards[0] and 'dtype="float32"' in hazards[0]


def test_clean_model_starts_without_hazard_warnings(tmp_path, monkeypatch):
  warnings = []
  monkeypatch.setattr(logging, 'warning', lambda msg, *args: warnings.append(msg % args))
  FashionTrainer(
    config(**{'precision.policy': 'mixed_bfloat16', 'train.steps': 2}), str(tmp_path / 'work')
  ).train()
  assert not [w for w in warnings if w.startswith('precision hazard')]


def test_a_contract_error_exits_2_from_launch(tmp_path):
  """The launcher path: a models/ module with a scalar loss; error line, exit 2, no workdir."""
  import subprocess
  import sys

  from conftest import ROOT as root, TESTS

  script = tmp_path / 'run.py'
  script.write_text(f"""
import sys
sys.path[:0] = [{root!r}, {TESTS!r}, {os.path.dirname(os.path.abspath(__file__))!r}]
import launch, models
from test_contract import FashionTrainer
import tensorflow as tf

class ScalarLoss(FashionTrainer):
  def compute_loss(self, batch, *, training):
    loss, metrics = super().compute_loss(batch, training=training)
    return tf.reduce_mean(loss), metrics

models.get_trainer_class = lambda name: ScalarLoss
from absl import app
app.run(launch.main, flags_parser=launch.parse_flags)
""")
  workdir = tmp_path / 'work'
  result = subprocess.run(
    [sys.executable, str(script), f'--config={root}/configs/mnist.py', f'--workdir={workdir}'],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=root,
  )
  assert result.returncode == 2, result.stderr[-2000:]
  errors = [l for l in result.stderr.splitlines() if l.startswith('error: ')]
  assert errors == [errors[0]] and 'compute_loss returned the loss as a scalar' in errors[0]
  assert 'Traceback' not in result.stderr
  assert not workdir.exists()


@contextlib.contextmanager
def op_determinism(on: bool):
  """TensorFlow's op determinism on or off for the block, then as it was: it is process-wide,
  and a run with config.train.deterministic leaves it on for every later test of the process."""
  before = tf_config.is_op_determinism_enabled()
  (tf_config.enable_op_determinism if on else tf_config.disable_op_determinism)()
  try:
    yield
  finally:
    (tf_config.enable_op_determinism if before else tf_config.disable_op_determinism)()


def _mapped(f):
  """A FashionTrainer whose train and eval batches go through `f(images, labels)`."""

  class Mapped(FashionTrainer):
    def build_datasets(self):
      d = super().build_datasets()
      return Datasets(train=d.train.map(f), eval=d.eval.map(f), train_examples=N)

  return Mapped


class _DictModel(FashionTrainer):
  def build_model(self):
    inputs = keras.Input((28, 28, 1))
    return keras.Model(inputs, {'logits': keras.layers.Dense(10)(keras.layers.Flatten()(inputs))})


class _DictModelKerasLoss(_DictModel):
  def compute_loss(self, batch, *, training):  # the README's: the Keras loss gets the dict first
    images, labels = batch
    logits = self.model(images, training=training)
    loss = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    return loss, {}


class _NoInputLayer(FashionTrainer):
  def build_model(self):  # no keras.Input: Keras cannot add the missing axis itself
    return keras.Sequential(
      [keras.layers.Conv2D(4, 3), keras.layers.Flatten(), keras.layers.Dense(10)]
    )


@pytest.mark.parametrize(
  'trainer_class, expected',
  [
    (  # one-hot labels with a sparse loss
      _mapped(lambda x, y: (x, tf.one_hot(y, 10))),
      'the labels (32, 10) have the rank of the predictions (32, 10): one-hot (or [B, 1]) labels '
      'given to a sparse loss, which takes class indices [B]; use '
      'keras.losses.categorical_crossentropy for one-hot labels, or give the sparse loss '
      'tf.argmax(labels, -1)',
    ),
    (  # a model returning a dict
      _DictModel,
      "a dict (keys 'logits') reached a TensorFlow op that takes a tensor: the model returns a "
      "dict; take the output the loss needs, e.g. self.model(x, training=training)['logits']",
    ),
    (  # the same, given straight to a Keras loss (an AttributeError on .shape, a traceback once)
      _DictModelKerasLoss,
      'a dict reached a TensorFlow op that takes a tensor: the model returns a dict; take the '
      "output the loss needs, e.g. self.model(x, training=training)['logits']",
    ),
    (  # labels 1..10 for 10 classes
      _mapped(lambda x, y: (x, y + 1)),
      "labels outside the model's 10 classes [0, 10): 3 of 32 labels are 10 (the batch's labels "
      'run 1..10); labels are class indices 0..9: shift them to start at 0 (labels - 1)',
    ),
    (  # float labels compared with int32 predictions
      _mapped(lambda x, y: (x, tf.cast(y, tf.float32))),
      'tf.equal got an int32 and a float tensor (input #1 is float): float labels compared with '
      "integer predictions (or the reverse); cast one to the other's dtype, e.g. "
      'tf.cast(labels, tf.int32), or make the labels integers in build_datasets',
    ),
    (  # images [B, 28, 28] for a Conv2D
      type('NoChannel', (_NoInputLayer, _mapped(lambda x, y: (x[..., 0], y))), {}),
      "layer 'conv2d' takes inputs of rank 4 (batch, ..., channels) and got (32, 28, 28): the "
      'images have no channel axis; add one in build_datasets, x[..., None] '
      '(tf.expand_dims(x, -1)), or keras.Input with the channel axis',
    ),
  ],
)
def test_data_mistakes_inside_compute_loss_are_one_line_with_the_fix(
  trainer_class, expected, tmp_path
):
  """Issue 35: each was a 25-46-line traceback from inside Keras or TensorFlow (one printing
  every label of the batch) ending with the '(raised by compute_loss(...))' note, no fix. The
  original exception stays the UserError's __cause__ (launch.py --traceback prints both)."""
  with op_determinism(False):  # the kernels whose messages these are (an earlier test may set it)
    message = rejected(trainer_class, tmp_path)
  message = re.sub(r"'conv2d_\d+'", "'conv2d'", message)  # Keras's layer names
  assert message.startswith('compute_loss(batch, training=False) on the first eval batch (')
  assert message.endswith(f'): {expected}'), message
  assert len(message) < 400


def test_a_label_outside_the_classes_under_op_determinism_is_one_line(tmp_path):
  """With op determinism on (config.train.deterministic, or any earlier run in the process) the
  sparse cross-entropy gathers by label and fails in GatherV2 naming one label: the same hint,
  from that label (it passed through as a bare traceback once another test had switched
  determinism on)."""
  from trainer.data import hints

  error = tf.errors.InvalidArgumentError(
    None, None, 'indices[21] = 10 is not in [0, 10) [Op:GatherV2] name: '
  )
  assert hints.hint(error) == (
    "labels outside the model's 10 classes [0, 10): a label is 10; labels are class indices "
    '0..9: shift them to start at 0 (labels - 1) if they start at 1, else give the last layer '
    '11 units'
  )
  with op_determinism(True):  # as config.train.deterministic sets it
    message = rejected(_mapped(lambda x, y: (x, y + 1)), tmp_path)
  assert "labels outside the model's 10 classes [0, 10)" in message and '\n' not in message


def test_launch_traceback_flag_prints_the_original_exception(tmp_path):
  """--traceback keeps the traceback a data hint replaces available."""
  from conftest import ROOT as root, TESTS

  script = tmp_path / 'run.py'
  script.write_text(f"""
import sys
sys.path[:0] = [{root!r}, {TESTS!r}, {os.path.dirname(os.path.abspath(__file__))!r}]
import launch, models, test_contract
models.get_trainer_class = lambda name: test_contract._DictModel
from absl import app
app.run(launch.main, flags_parser=launch.parse_flags)
""")
  import subprocess
  import sys

  for extra, env, shown in (
    ([], {}, False),
    (['--traceback'], {}, True),
    ([], {'TRAINER_TRACEBACK': '1'}, True),
  ):
    result = subprocess.run(
      [
        sys.executable,
        str(script),
        f'--config={root}/configs/mnist.py',
        f'--workdir={tmp_path / "w"}',
        *extra,
      ],
      capture_output=True,
      text=True,
      timeout=120,
      cwd=root,
      env={**os.environ, **env},
    )
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [l for l in result.stderr.splitlines() if l.startswith('error: ')]
    assert len(errors) == 1 and "a dict (keys 'logits')" in errors[0]
    assert ('unsupported type' in result.stderr) == shown, extra
    assert ('Traceback' in result.stderr) == shown, extra


def test_build_model_adapts_a_normalization_on_self_datasets(tmp_path):
  """Issue 35: build_model may read self.datasets (documented) for Normalization.adapt; the
  train set it sees is one pass as build_datasets returned it (it was already repeated for
  ever there, so an adapt over it never ended)."""
  seen = {}

  class Adapted(FashionTrainer):
    repeat = False  # a finite train set, as a newcomer writes it

    def build_model(self):
      train = self.datasets.train
      seen['cardinality'] = int(train.cardinality())
      norm = keras.layers.Normalization(axis=None)
      if seen['cardinality'] >= 0:  # an endless set would never end the adapt
        norm.adapt(train.map(lambda x, y: x))
      seen['mean'] = float(np.asarray(norm.mean).reshape(-1)[0]) if norm.built else None
      return keras.Sequential([keras.Input((28, 28, 1)), norm, *super().build_model().layers])

  trainer = Adapted(config(), str(tmp_path / 'work'))
  x, _ = images_and_labels()
  assert seen['cardinality'] == N // 32  # one pass of the drop_remainder batches
  assert seen['mean'] == pytest.approx(float(x[: (N // 32) * 32].mean()), rel=1e-4)
  assert int(trainer.datasets.train.cardinality()) == tf.data.INFINITE_CARDINALITY
  trainer.train()


def test_a_forgotten_super_init_is_one_line(tmp_path):
  """A Trainer or TrainStep subclass whose __init__ never called super().__init__: an
  AttributeError from deep inside the launcher ('no attribute runner', twice chained) or the
  build ('no attribute global_step'), exit status 1; now one line naming the class."""

  class NoSuper(FashionTrainer):
    def __init__(self, config, workdir):
      self.extra = 1

  message = rejected(NoSuper, tmp_path)
  assert message.startswith('NoSuper.__init__ did not call super().__init__(config, workdir)')

  class NoSuperStep(TrainStep):
    def __init__(self, trainer):
      self.extra = 1

  class WithStep(FashionTrainer):
    def build_train_step(self):
      return NoSuperStep(self)

  message = rejected(WithStep, tmp_path)
  assert message.startswith('NoSuperStep.__init__ did not call super().__init__(trainer)')

  class Calls(FashionTrainer):  # one that calls it is built as before
    def __init__(self, config, workdir):
      self.extra = 1
      super().__init__(config, workdir)

  assert Calls(config(), str(tmp_path / 'calls')).extra == 1


def test_a_keras_style_train_step_on_a_step_is_refused(tmp_path):
  """Keras's Model.train_step written on a TrainStep ran never, without a word."""

  class KerasStyle(TrainStep):
    def train_step(self, batch):
      return {}

  class WithStep(FashionTrainer):
    def build_train_step(self):
      return KerasStyle(self)

  message = rejected(WithStep, tmp_path)
  assert message.startswith('KerasStyle.train_step is never called') and 'compute_gradients' in (
    message
  )


def test_a_keras_fit_hook_on_the_model_is_a_warning(tmp_path, caplog):
  """A keras.Model with its own train_step (Keras's custom fit) trained without it, silently."""

  class FitNet(keras.Model):
    def __init__(self, **kwargs):
      super().__init__(**kwargs)
      self.flat, self.dense = keras.layers.Flatten(), keras.layers.Dense(10, dtype='float32')

    def call(self, x, training=False):
      return self.dense(self.flat(x))

    def train_step(self, data):
      raise AssertionError('never called')

  class WithFitNet(FashionTrainer):
    def build_model(self):
      return FitNet(name='fit_net')

  with caplog.at_level('WARNING'):
    WithFitNet(config(), str(tmp_path / 'w'))
  said = [r.getMessage() for r in caplog.records if 'fit()' in r.getMessage()]
  assert len(said) == 1 and said[0].startswith('FitNet overrides train_step, Keras fit()')
  caplog.clear()
  with caplog.at_level('WARNING'):
    FashionTrainer(config(), str(tmp_path / 'plain'))  # a Sequential: no line
  assert not [r for r in caplog.records if 'fit()' in r.getMessage()]
