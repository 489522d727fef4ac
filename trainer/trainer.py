"""The Trainer: what a model writes. A subclass fills in three hooks,

  build_model()      -> a Keras model (built under the strategy's scope and the precision policy)
  build_datasets()   -> Datasets(train, eval, train_examples) (trainer/data/datasets.py)
  compute_loss(batch, *, training) -> (per-example loss [B] float32,
                                       {metric name: per-example value [B]})

and, beyond them, overrides any of these (each has a working default):

  build_learning_rate() -> a keras LearningRateSchedule of the global step (default from
                        config.optimizer)
  build_optimizer(learning_rate)   -> the optimizer (default from config.optimizer)
  build_metrics()    -> {name: stateful Keras metric} updated from compute_loss's entry `name`
                        (a tuple of update_state arguments); default {}
  build_train_step() -> the TrainStep (trainer/step/train_step.py states its public contract)
  checkpoint_items() -> {name: trackable} saved in every checkpoint
  build_actions()    -> callables run at log, eval and save boundaries (trainer/run/actions.py),
                        and keras.callbacks.Callback objects (trainer/run/keras_callbacks.py)

What runs is not here: `Trainer.train()` hands the trainer to a `Runner` (trainer/run/runner.py),
which owns the run folder, checkpoints, the outer loop, progress, eval, preemption and the
numerics tools. The parts the hooks build and read (`config`, `strategy`, `policy`, `datasets`,
`model`, `optimizer`, `loss_scaler`, `global_step`, `learning_rate`, `train_step`, ...) are made
by trainer/run/build.py and kept here. A name the framework owns (build.FRAMEWORK_NAMES) cannot be
redefined by a subclass: that is a one-line UserError when the class is defined (a helper named
`save` once switched checkpointing off without a word).
"""

from __future__ import annotations

import functools
import time

from typing import Any

import keras
import ml_collections
import tensorflow as tf

from trainer.data.datasets import Datasets
from trainer.errors import UserError
from trainer.run import build
from trainer.run.runner import Runner
from trainer.optim import optimizers
from trainer.step.train_step import TrainStep


class Trainer:
  """Subclass it, fill in the hooks, then `MyTrainer(config, workdir).train()`."""

  # The parts trainer/run/build.py sets, in this order: what the hooks read.
  config: ml_collections.ConfigDict  # validated: every key of the schema
  workdir: str  # the run folder's path
  strategy: tf.distribute.Strategy
  policy: str  # the resolved precision policy ('mixed_bfloat16', ...)
  datasets: Datasets  # as build_datasets returned them, a finite train set repeated
  total_steps: int
  jit_compile: bool
  model: keras.Model
  train_metrics: dict[str, Any]  # build_metrics(), the train loop's instances
  eval_metrics: dict[str, Any]  # build_metrics(), the eval loop's instances
  global_step: tf.Variable  # int64; advances on every step, skipped or not
  metric_names: tuple[str, ...]  # compute_loss's metric names
  loss_scaler: Any  # a trainer.LossScaler (trainer/step/loss_scale.py)
  learning_rate: Any  # step -> rate: build_learning_rate() times the recovery factor
  optimizer: keras.optimizers.Optimizer
  train_step: TrainStep
  runner: Runner

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    build.check_names(cls.__name__, vars(cls))  # a framework name redefined: one line, now
    if '__init__' in vars(cls):  # a forgotten super().__init__: one line, not an AttributeError
      setattr(cls, '__init__', _checked_init(vars(cls)['__init__']))

  def __init__(
    self,
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    strategy: tf.distribute.Strategy | None = None,
  ):
    started = time.perf_counter()  # goodput: start-up counts from here
    build.check_names(type(self).__name__, vars(self))  # set before super().__init__()
    # The config validated, then strategy, policy, datasets, model, metrics, optimizer, loss
    # scaler and step, the hook contract checked on the first eval batch before anything is
    # written (trainer/run/build.py).
    batch = build.build(self, config, workdir, strategy)
    self.runner = Runner(self, started=started, first_eval_batch=batch)

  # ---- hooks -------------------------------------------------------------------------------
  def build_model(self) -> keras.Model:
    """The Keras model, built once under the strategy's scope and the precision policy (with
    `precision.float32_layers` in float32); give the last layer `dtype='float32'`. The datasets
    are built first: `self.datasets` is what build_datasets returned (a finite train set is
    one pass here; the trainer repeats it afterwards), e.g. for
    `norm.adapt(self.datasets.train.map(lambda x, y: x))` (a train set with its own .repeat()
    never ends: adapt on `.take(n)` of it)."""
    raise NotImplementedError('a Trainer subclass must define build_model()')

  def build_datasets(self) -> Datasets:
    """`Datasets(train, eval, train_examples=0)`: `train` yields global batches
    (`config.train.batch_size`, drop_remainder=True; repeated by the trainer when finite), `eval`
    one batched pass over the eval set (trainer/data/ready.py builds both in one call)."""
    raise NotImplementedError('a Trainer subclass must define build_datasets()')

  def compute_loss(self, batch: Any, *, training: bool) -> tuple[tf.Tensor, dict[str, Any]]:
    """`(loss, {name: value})` for one batch of the datasets: the per-example loss `[B]` (the
    trainer averages it over the global batch) computed from `self.model`, and per-example
    metrics `[B]` (or a stateful metric's `update_state` arguments, see `build_metrics`)."""
    raise NotImplementedError('a Trainer subclass must define compute_loss()')

  def build_learning_rate(self) -> keras.optimizers.schedules.LearningRateSchedule:
    """The learning rate as a function of the global step (which advances on every step,
    skipped or not), built once; default: config.optimizer's warm-up, then constant or cosine.
    The trainer multiplies it by the recovery factor (config.train.recover_lr_factor) and keeps
    the product as `learning_rate`; `build_optimizer` gets it at the global step."""
    return optimizers.schedule(self.config.optimizer, self.total_steps)

  def build_optimizer(self, learning_rate) -> keras.optimizers.Optimizer:
    """`learning_rate` is a Keras LearningRateSchedule: `learning_rate` (the hook's schedule
    with the recovery factor) at the global step, whatever step Keras passes. Pass it to any
    Keras optimizer (`keras.optimizers.Lion(learning_rate=learning_rate)`); an optimizer given a
    schedule of its own follows that one, and the progress line logs what it uses."""
    c = self.config
    return optimizers.build(
      c.optimizer,
      learning_rate,
      master_weights=c.precision.master_weights,
      seed=c.seed,
      step=self.global_step,
    )

  def build_metrics(self) -> dict[str, keras.metrics.Metric]:
    """Stateful Keras metrics by name (e.g. {'auc': keras.metrics.AUC(from_logits=True)}):
    `compute_loss` returns, under the same name, the tuple of `update_state` arguments
    (e.g. `(labels, logits)`). Called twice (train and eval sets), under the strategy's
    scope; updated per replica, read and reset on the host at log and eval time."""
    return {}

  def build_train_step(self) -> TrainStep:
    """The step the compiled loop runs; subclass TrainStep for a custom one (its docstring
    states the contract). Called under the strategy's scope, after the optimizer is made."""
    return TrainStep(self)

  def checkpoint_items(self) -> dict[str, Any]:
    """{name: trackable} written in every checkpoint and restored on resume; extend it for what
    a custom step adds (`{**super().checkpoint_items(), 'g_optimizer': ...}`). The runner adds
    its own item, 'actions' (the actions' state: best eval so far, evals without improvement)."""
    return {
      'model': self.model,
      'optimizer': self.optimizer,
      'loss_scaler': self.loss_scaler,
      'global_step': self.global_step,
      **self.train_step.state.checkpoint_items(),  # 'skipped_steps', 'consecutive_skips'
    }

  def build_actions(self) -> list:
    """Callables taking one `trainer.Event`, run at log, eval and save boundaries
    (trainer/run/actions.py), and Keras callbacks (`keras.callbacks.EarlyStopping(...)`,
    CSVLogger, TensorBoard, your own), called with fit's protocol and log keys; an epoch is an
    eval interval (trainer/run/keras_callbacks.py). Default: none; the runner adds the built-in
    actions (the config's early_stopping and best_checkpoint, the numerics line) before these."""
    return []

  # ---- what a user calls -------------------------------------------------------------------
  def train(self) -> dict[str, float]:
    """Trains to `total_steps` (resuming from the workdir), evaluates; returns the final eval
    metrics, a dict that is also a History (`history`: each epoch's logs, as fit's). Ends early,
    with a checkpoint, when an action calls `request_stop` or a Keras callback sets
    `model.stop_training`; the run folder records the stop, and a rerun trains no further."""
    return self.runner.train()

  def evaluate(self) -> dict[str, float]:
    """One pass over the whole eval set at the current weights; {'loss': ..., <metric>: ...}."""
    metrics = self.runner.evaluate()
    assert metrics is not None  # nothing stops it
    return metrics

  def request_stop(self, reason: str) -> None:
    """Asks the outer loop to end after the current boundary (with a checkpoint)."""
    self.runner.request_stop(reason)


def _checked_init(init):
  """`init` (a subclass's __init__), then one UserError line when it returned without running
  Trainer.__init__ (which builds everything and sets `runner` last): without it the first use
  was an AttributeError deep in the launcher, twice chained."""

  @functools.wraps(init)
  def __init__(self, *args, **kwargs):
    init(self, *args, **kwargs)
    if 'runner' not in vars(self):
      name = type(self).__name__
      raise UserError(
        f'{name}.__init__ did not call super().__init__(config, workdir): the trainer is not '
        f'built; call it in {name}.__init__ (after setting what the hooks read)'
      )

  return __init__
