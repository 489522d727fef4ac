"""The compiled step: skip semantics, the global step, clipping, checkpoints."""

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from tiny import TinyTrainer, tiny_config
from trainer import Datasets
from trainer.optim import optimizers


def snapshot(trainer):
  weights = [v.numpy().copy() for v in trainer.model.trainable_variables]
  slots = [v.numpy().copy() for v in trainer.optimizer.variables]
  return weights, slots


def run_steps(trainer, n):
  iterator = iter(trainer.strategy.experimental_distribute_dataset(trainer.datasets.train))
  trainer.runner.train_loop.run(iterator, n)


@pytest.mark.parametrize('policy', ['float32', 'mixed_float16'])
def test_nonfinite_step_is_skipped_bit_identically(tiny_trainer, policy):
  trainer = tiny_trainer(
    **{
      'debug.inject_nonfinite_steps': '3',
      'precision.policy': policy,
      'precision.loss_scale': 'dynamic',
    }
  )
  run_steps(trainer, 3)  # steps 0, 1, 2 apply
  before = snapshot(trainer)
  scale = float(trainer.loss_scaler.scale.numpy())
  applied = int(trainer.optimizer.iterations.numpy())
  run_steps(trainer, 1)  # step 3 is poisoned
  after = snapshot(trainer)
  for a, b in zip(before[0] + before[1], after[0] + after[1]):
    np.testing.assert_array_equal(a, b)  # bit-identical weights and optimizer slots
  assert int(trainer.global_step.numpy()) == 4
  assert int(trainer.train_step.skipped_steps.numpy()) == 1
  assert int(trainer.optimizer.iterations.numpy()) == applied
  assert float(trainer.loss_scaler.scale.numpy()) == scale * 0.5
  run_steps(trainer, 1)  # step 4 applies again
  assert any(
    not np.array_equal(a, v.numpy()) for a, v in zip(after[0], trainer.model.trainable_variables)
  )


def test_skip_without_loss_scaling(tiny_trainer):
  trainer = tiny_trainer(**{'debug.inject_nonfinite_every': 2, 'precision.loss_scale': 'none'})
  run_steps(trainer, 6)  # steps 2 and 4 injected
  assert int(trainer.train_step.skipped_steps.numpy()) == 2
  assert int(trainer.optimizer.iterations.numpy()) == 4
  assert int(trainer.global_step.numpy()) == 6
  assert all(np.isfinite(v.numpy()).all() for v in trainer.model.trainable_variables)


def test_first_call_traces_the_step_once_and_sums_every_output(tiny_trainer):
  """Start-up cost: the first compiled call traces `step` once (not again for its output names,
  nor again because the sums were created during the trace), and the loop's sums come back
  right: 6 steps, one injected non-finite, read as counts and means."""
  trainer = tiny_trainer(**{'debug.inject_nonfinite_steps': '2', 'precision.loss_scale': 'none'})
  step, traced = trainer.train_step.step, []

  def counting_step(iterator):
    traced.append(1)
    return step(iterator)

  trainer.train_step.step = counting_step
  run_steps(trainer, 4)
  run_steps(trainer, 2)  # a new iterator of the same type: no new trace either
  assert len(traced) == 1
  logs = trainer.runner.train_loop.read_outputs()
  assert (logs['steps'], logs['skipped'], logs['nonfinite_loss']) == (6, 1, 0)
  assert 0.0 < logs['accuracy'] <= 1.0 and np.isfinite(logs['loss'])
  assert trainer.runner.train_loop.read_outputs()['steps'] == 0  # read resets the sums


class RowsAboveZero(keras.metrics.Metric):
  """A user's stateful metric with Python control flow on a tensor in update_state."""

  def __init__(self):
    super().__init__(name='rows_above_zero')
    self.total = self.add_weight(name='total', initializer='zeros')

  def update_state(self, x):
    for row in tf.range(tf.shape(x)[0]):  # a loop over a tensor: autograph's while loop
      if tf.reduce_max(x[row]) > 0.0:
        self.total.assign_add(1.0)

  def result(self):
    return self.total


class BranchingTrainer(TinyTrainer):
  def build_metrics(self):
    return {'rows_above_zero': RowsAboveZero()}

  def compute_loss(self, batch, *, training):
    loss, metrics = super().compute_loss(batch, training=training)
    if tf.reduce_mean(loss) > 1e6:  # Python `if` on a tensor: a tf.cond once converted
      loss = tf.zeros_like(loss)
    metrics['rows_above_zero'] = (batch[0],)
    return loss, metrics


def test_autograph_converts_the_users_code_and_not_the_frameworks(tmp_path):
  """The compiled loop traces the framework's code with autograph off (it states its control
  flow itself; converting it was most of the step's trace) and converts what the user wrote, as
  any tf.function does: Python control flow on tensors in compute_loss and in a custom metric's
  update_state works, in the step, the numerics probe and the eval loop (unconverted, each raises
  "Using a symbolic `tf.Tensor` as a Python `bool` is not allowed")."""
  from unittest import mock
  from tensorflow.python.autograph.impl import api

  trainer = BranchingTrainer(tiny_config(), str(tmp_path))
  with mock.patch.object(api, '_convert_actual', wraps=api._convert_actual) as convert:
    run_steps(trainer, 3)
  converted = {f'{c.args[0].__module__}.{c.args[0].__qualname__}' for c in convert.call_args_list}
  assert 'test_train_step.BranchingTrainer.compute_loss' in converted
  assert 'tiny.TinyTrainer.compute_loss' in converted  # its super() call, recursively
  assert 'test_train_step.RowsAboveZero.update_state' in converted
  assert not [name for name in converted if name.startswith('trainer.')]
  logs = trainer.runner.train_loop.read_outputs()
  assert logs['steps'] == 3 and np.isfinite(logs['loss'])
  assert 0 < logs['rows_above_zero'] <= 3 * 32  # rows of 3 batches of 32 random normals
  from trainer.insight import numerics  # the numerics probe's pass converts compute_loss too

  stats, overall = numerics.Probe(trainer).measure()
  assert stats and overall['grad_nonfinite'] == 0.0
  with mock.patch.object(api, '_convert_actual', wraps=api._convert_actual) as convert:
    results = trainer.evaluate()  # and so does the eval loop
  converted = {f'{c.args[0].__module__}.{c.args[0].__qualname__}' for c in convert.call_args_list}
  assert 'test_train_step.RowsAboveZero.update_state' in converted
  assert not [name for name in converted if name.startswith('trainer.')]
  assert 0 < results['rows_above_zero'] <= 512 and np.isfinite(results['loss'])


def test_a_custom_steps_hook_may_use_python_control_flow_on_tensors(tmp_path):
  from trainer import TrainStep

  class CountingStep(TrainStep):
    def compute_gradients(self, batch):
      outputs, grads = super().compute_gradients(batch)
      n = tf.constant(0)
      while n < 3:  # a tf.while_loop once converted
        n += 1
      outputs['loops'] = tf.cast(n, tf.float32)
      return outputs, grads

  class CountingTrainer(TinyTrainer):
    def build_train_step(self):
      return CountingStep(self)

  trainer = CountingTrainer(tiny_config(), str(tmp_path))
  run_steps(trainer, 2)
  assert trainer.runner.train_loop.read_outputs()['loops'] == 3.0


def test_a_custom_step_returning_a_non_scalar_output_is_named(tmp_path):
  from trainer import TrainStep
  from trainer.errors import UserError

  class VectorStep(TrainStep):
    def step(self, iterator):
      outputs = super().step(iterator)
      outputs['per_class'] = tf.ones([4])
      return outputs

  class VectorTrainer(TinyTrainer):
    def build_train_step(self):
      return VectorStep(self)

  trainer = VectorTrainer(tiny_config(), str(tmp_path))
  with pytest.raises(UserError, match=r"VectorStep.step returned 'per_class' of shape \(4,\)"):
    run_steps(trainer, 2)


def test_the_schedule_is_traced_once_per_graph_not_once_per_read(tmp_path):
  """Keras reads an optimizer's learning-rate callable at every use, AdamW's weight decay once
  per variable; each read put the schedule's ops into the step again. Now the step's graph
  computes it once where the finite check reads it and once in the update's branch."""
  calls = []

  class Counted(TinyTrainer):
    def build_learning_rate(self):  # the schedule the optimizer's reads go through
      schedule = super().build_learning_rate()

      class Counting(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
          calls.append(1)
          return schedule(step)

      return Counting()

  config = {
    'optimizer.name': 'adamw',
    'optimizer.weight_decay': 0.1,
    'optimizer.schedule': 'cosine',
    'train.steps': 10,
  }
  trainer = Counted(tiny_config(**config), str(tmp_path / 'work'))
  run_steps(trainer, 3)
  assert len(trainer.model.trainable_variables) == 4 and len(calls) == 2
  schedule = optimizers.schedule(trainer.config.optimizer, trainer.total_steps)  # not counted
  expected = float(schedule(3))  # the rate the next update uses, read eagerly
  assert float(trainer.optimizer.learning_rate) == pytest.approx(expected)
  assert len(calls) == 3  # eager reads compute it every time


def test_learning_rate_follows_global_step_not_optimizer_iterations(tiny_trainer):
  trainer = tiny_trainer(
    **{'optimizer.schedule': 'cosine', 'train.steps': 10, 'debug.inject_nonfinite_steps': '0,1,2'}
  )
  run_steps(trainer, 5)
  assert int(trainer.optimizer.iterations.numpy()) == 2
  expected = float(trainer.learning_rate(5))
  assert float(trainer.optimizer.learning_rate.numpy()) == pytest.approx(expected)
  assert expected < trainer.config.optimizer.learning_rate


def test_clipping_acts_on_unscaled_gradients(tiny_trainer):
  """With a static scale of 1024 and clip_norm c, the update equals the float32 unscaled run."""
  common = {
    'optimizer.name': 'sgd',
    'optimizer.momentum': 0.0,
    'optimizer.clip_norm': 0.01,
    'optimizer.learning_rate': 1.0,
    'train.steps': 1,
  }
  results = []
  for scale in ('none', '1024'):
    trainer = tiny_trainer(**common, **{'precision.loss_scale': scale})
    w0 = [v.numpy().copy() for v in trainer.model.trainable_variables]
    run_steps(trainer, 1)
    delta = [v.numpy() - a for v, a in zip(trainer.model.trainable_variables, w0)]
    results.append(delta)
    norm = np.sqrt(sum((d.astype('float64') ** 2).sum() for d in delta))  # lr = 1
    assert norm == pytest.approx(0.01, rel=1e-3)  # the tiny model's raw gradient norm is >> 0.01
  for a, b in zip(*results):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9)


class EmbeddingTrainer(TinyTrainer):
  """Embedding(10, 4) -> mean -> Dense 4 over sequences that repeat token 0: the embedding's
  gradient is an IndexedSlices with one row per lookup, many at the same index."""

  def build_model(self):
    return keras.Sequential(
      [
        keras.Input((6,), dtype='int32'),
        keras.layers.Embedding(10, 4),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(4, dtype='float32'),
      ],
      name='embedding',
    )

  def build_datasets(self):
    rng = np.random.default_rng(7)
    x = np.where(rng.random((64, 6)) < 0.7, 0, rng.integers(1, 10, (64, 6))).astype(np.int32)
    y = (x.sum(1) % 4).astype(np.int32)
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    return Datasets(
      train=ds.repeat().batch(32, drop_remainder=True), eval=ds.batch(32), train_examples=64
    )


def test_clipping_takes_an_embedding_gradient_at_its_dense_norm(tmp_path):
  """The clipped update's norm is clip_norm, also when the embedding's rows repeat an index:
  the norm of the IndexedSlices' rows as they are (tf.linalg.global_norm) is smaller than the
  dense gradient's, and clipping by it let a larger update through."""
  config = tiny_config(
    **{
      'optimizer.name': 'sgd',
      'optimizer.momentum': 0.0,
      'optimizer.clip_norm': 0.01,
      'optimizer.learning_rate': 1.0,
      'train.batch_size': 32,
      'train.steps': 1,
    }
  )
  trainer = EmbeddingTrainer(config, str(tmp_path / 'work'))
  batch = next(iter(trainer.datasets.train))
  with tf.GradientTape() as tape:
    loss = tf.reduce_mean(trainer.compute_loss(batch, training=True)[0])
  grads = tape.gradient(loss, trainer.model.trainable_variables)
  assert isinstance(grads[0], tf.IndexedSlices)
  dense = float(tf.linalg.global_norm([tf.convert_to_tensor(g) for g in grads]))
  assert float(tf.linalg.global_norm(grads)) < 0.9 * dense  # the rows' norm under-reports
  w0 = [v.numpy().copy() for v in trainer.model.trainable_variables]
  run_steps(trainer, 1)
  delta = [v.numpy() - a for v, a in zip(trainer.model.trainable_variables, w0)]
  assert np.sqrt(sum((d.astype('float64') ** 2).sum() for d in delta)) == pytest.approx(
    0.01, rel=1e-4
  )  # lr = 1: the update is the clipped gradient
  np.testing.assert_allclose(
    delta[0], -0.01 / dense * tf.convert_to_tensor(grads[0]).numpy(), rtol=1e-4, atol=1e-9
  )


def test_checkpoint_round_trip_restores_scale_counter_and_step(tiny_trainer, tmp_path):
  trainer = tiny_trainer(
    **{
      'precision.policy': 'mixed_float16',
      'precision.growth_interval': 4,
      'precision.initial_scale': 8.0,
      'debug.inject_nonfinite_steps': '1',
    }
  )
  run_steps(trainer, 7)
  state = (
    float(trainer.loss_scaler.scale.numpy()),
    int(trainer.loss_scaler.good_steps.numpy()),
    int(trainer.global_step.numpy()),
    int(trainer.train_step.skipped_steps.numpy()),
  )
  assert state == (8.0, 1, 7, 1)  # 8 -> 4 at step 1, 4 finite steps -> 8 at step 5, 1 since
  weights, slots = snapshot(trainer)
  trainer.runner.save()

  # The same config: a resume with a changed one is an error (trainer/run/workdir.py).
  fresh = tiny_trainer(
    **{
      'precision.policy': 'mixed_float16',
      'precision.growth_interval': 4,
      'precision.initial_scale': 8.0,
      'debug.inject_nonfinite_steps': '1',
    }
  )
  assert int(fresh.global_step.numpy()) == 0
  assert fresh.runner.restore() == 7
  assert (
    float(fresh.loss_scaler.scale.numpy()),
    int(fresh.loss_scaler.good_steps.numpy()),
    int(fresh.global_step.numpy()),
    int(fresh.train_step.skipped_steps.numpy()),
  ) == state
  for a, b in zip(weights + slots, sum(snapshot(fresh), [])):
    np.testing.assert_array_equal(a, b)


def test_train_resumes_at_saved_step(tiny_trainer):
  first = tiny_trainer(**{'train.steps': 10})
  first.train()
  second = tiny_trainer(**{'train.steps': 20})
  assert second.runner.restore() == 10
  second.train()
  assert int(second.global_step.numpy()) == 20
  assert int(second.optimizer.iterations.numpy()) == 20


def test_grad_accumulation_with_a_custom_compute_gradients_is_a_warning(tmp_path, caplog):
  """grad_accum_steps is applied by TrainStep.compute_gradients; an override gets the whole
  batch, which was silent."""
  from trainer import TrainStep

  class WholeBatch(TrainStep):
    def compute_gradients(self, batch):
      return super().compute_gradients(batch)

  class Custom(TinyTrainer):
    def build_train_step(self):
      return WholeBatch(self)

  Custom(tiny_config(**{'train.grad_accum_steps': 2}), str(tmp_path / 'a'))
  assert (
    'config.train.grad_accum_steps=2 is applied by TrainStep.compute_gradients, which '
    'WholeBatch overrides'
  ) in caplog.text
  caplog.clear()
  TinyTrainer(tiny_config(**{'train.grad_accum_steps': 2}), str(tmp_path / 'b'))
  assert 'grad_accum_steps' not in caplog.text  # the default step splits the batch itself


@pytest.mark.parametrize(
  'mistake, expected',
  [
    (
      'per_example_loss',
      "returned 'loss' of shape (32,): return the loss averaged over the global batch, a scalar",
    ),
    ('swapped', 'returned (grads, outputs); return (outputs, grads)'),
    ('one_short', 'returned 3 gradients for 4 variables'),
  ],
)
def test_a_custom_compute_gradients_mistake_is_one_line_naming_the_step(
  tmp_path, mistake, expected
):
  """Mistakes a custom compute_gradients makes, which failed deep inside the step (a shape
  mismatch assigning the guard's counter, a string dtype in the loss scaler, a matmul of the
  wrong dimensions in Adam): one UserError naming the step class."""
  from trainer import TrainStep, UserError

  class Mine(TrainStep):
    def compute_gradients(self, batch):
      x, y = batch
      with tf.GradientTape() as tape:
        logits = tf.cast(self.model(x, training=True), tf.float32)
        per_example = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        loss = self.share_loss(per_example)
      grads = tape.gradient(loss, self.variables)
      if mistake == 'per_example_loss':
        return {'loss': per_example}, grads
      if mistake == 'swapped':
        return grads, {'loss': loss}
      return {'loss': loss}, grads[:-1]

  class Custom(TinyTrainer):
    def build_train_step(self):
      return Mine(self)

  trainer = Custom(tiny_config(**{'train.steps': 5}), str(tmp_path))
  with pytest.raises(UserError) as info:
    trainer.train()
  assert str(info.value).startswith('Mine.compute_gradients ' + expected), str(info.value)


# ---- the skip line names its cause ------------------------------------------------------------


def _skip_lines(err: str) -> list[str]:
  return [line for line in err.splitlines() if line.startswith('skipped step ')]


def test_the_skip_line_names_injected_gradients(tiny_trainer, capfd):
  trainer = tiny_trainer(**{'debug.inject_nonfinite_steps': '2'})
  run_steps(trainer, 3)
  kernel = trainer.model.trainable_variables[0].path
  assert _skip_lines(capfd.readouterr().err) == [
    'skipped step 2 (non-finite gradients injected by config.debug.inject_nonfinite_steps, no '
    f'update): loss scale 1, non-finite in 1 of 4 variables, first: {kernel}'
  ]


class InfLoss(TinyTrainer):
  """The loss (and so every gradient) is inf x loss at global step 1: real, not injected."""

  def compute_loss(self, batch, *, training):
    loss, metrics = super().compute_loss(batch, training=training)
    return loss * tf.where(tf.equal(self.global_step, 1), float('inf'), 1.0), metrics


def test_the_skip_line_names_non_finite_gradients(tmp_path, capfd):
  trainer = InfLoss(tiny_config(), str(tmp_path / 'w'))
  run_steps(trainer, 3)
  lines = _skip_lines(capfd.readouterr().err)
  assert len(lines) == 1 and int(trainer.train_step.skipped_steps.numpy()) == 1
  assert lines[0].startswith(
    'skipped step 1 (non-finite gradients, no update): loss scale 1, non-finite in 4 of 4 '
    'variables, first: '
  )


class InfRate(TinyTrainer):
  """A learning rate that is inf at global step 1: the gradients stay finite."""

  def build_optimizer(self, learning_rate):
    return keras.optimizers.SGD(
      learning_rate=lambda: tf.where(tf.equal(self.global_step, 1), float('inf'), 0.1)
    )


def test_the_skip_line_names_a_non_finite_learning_rate(tmp_path, capfd):
  """It read 'non-finite gradients ... non-finite in 0 of 4 variables, first: ' (no name)."""
  trainer = InfRate(tiny_config(**{'precision.policy': 'mixed_float16'}), str(tmp_path / 'w'))
  run_steps(trainer, 3)
  assert _skip_lines(capfd.readouterr().err) == [
    'skipped step 1 (non-finite learning rate, no update): loss scale 32768'
  ]
  assert int(trainer.train_step.skipped_steps.numpy()) == 1


class InfFromStep1(TinyTrainer):
  """Every training gradient is non-finite from global step 1 on: a run that skips every step."""

  def compute_loss(self, batch, *, training):
    loss, metrics = super().compute_loss(batch, training=training)
    if training:
      loss = loss * tf.where(self.global_step >= 1, float('inf'), 1.0)
    return loss, metrics


def test_a_run_of_skips_is_its_first_line_then_one_line_per_progress_line(tmp_path, capfd, caplog):
  """A skip right after a skip gets no line of its own; the host sums them up, one line before
  each progress line. It printed 19 lines here, one per step."""
  config = tiny_config(
    **{
      'train.steps': 20,
      'train.log_every': 10,
      'precision.max_consecutive_skips': 0,
      'numerics.forensics_first': 0,
      'numerics.forensics_every': 0,
      'numerics.divergence_factor': 0,  # the logged loss is NaN: not a divergence here
    }
  )
  trainer = InfFromStep1(config, str(tmp_path / 'w'))
  with caplog.at_level('INFO'):
    trainer.train()
  assert int(trainer.train_step.skipped_steps.numpy()) == 19
  lines = _skip_lines(capfd.readouterr().err)
  assert len(lines) == 1, lines
  assert lines[0].startswith(
    'skipped step 1 (non-finite gradients, no update): loss scale 1, non-finite in 4 of 4 '
    'variables, first: '
  )
  logged = [r.getMessage() for r in caplog.records]
  progress_at = [i for i, m in enumerate(logged) if m.startswith('step ') and '/20 (' in m]
  summaries = {i: m for i, m in enumerate(logged) if ' more skipped steps ' in m}
  # The first call (5 steps), log_every, the end: each interval skipped, each gets one line,
  # right before its progress line.
  assert len(progress_at) >= 3 and [i + 1 for i in summaries] == progress_at, logged
  covered = []
  for message in summaries.values():
    first, last, count = re.match(
      r'steps (\d+)-(\d+): (\d+) more skipped steps in a row', message
    ).groups()
    assert int(count) == int(last) - int(first) + 1, message
    assert message.endswith('loss scale 1 at the last skip'), message
    covered += range(int(first), int(last) + 1)
  assert covered == list(range(2, 20))  # every skip after the first, once


def test_apply_or_skip_takes_one_flag_per_group(tmp_path):
  """One regime: a custom step that passes a single flag gets one line (not autograph's
  many-line StagingError around it)."""
  from trainer import TrainStep, UserError

  class OneFlag(TrainStep):
    def step(self, iterator):
      outputs, grads, nonfinite, saved = self.strategy.run(
        self.replica_step, args=(next(iterator),)
      )
      skipped = self.apply_or_skip(self.all_replicas_finite(nonfinite), grads, saved)
      return self.with_counters({}, skipped)

  class OneFlagTrainer(TinyTrainer):
    def build_train_step(self):
      return OneFlag(self)

  trainer = OneFlagTrainer(tiny_config(), str(tmp_path / 'w'))
  with pytest.raises(UserError, match=r'apply_or_skip takes one finite flag per update group') as e:
    run_steps(trainer, 1)
  assert '\n' not in str(e.value)
