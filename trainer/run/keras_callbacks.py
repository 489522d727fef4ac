"""Keras callbacks beside the actions: `Trainer.build_actions()` may return
`keras.callbacks.Callback` objects among its actions, and the runner (trainer/run/runner.py)
calls them with Keras's protocol and log keys (`loss`, each metric, `val_loss`, `val_<metric>`)
at the boundaries it has:

  on_train_begin, on_train_end      around `train()`; the end gets the last epoch's logs
  on_epoch_begin, on_epoch_end      an epoch is an eval interval: it ends at each eval (every
                                    train.eval_every steps and the last step), with the train
                                    metrics of the last progress line and the eval's as val_<name>
  on_train_batch_begin, _end        once per progress line, as fit's with steps_per_execution:
                                    begin before the first compiled call after a line, end at the
                                    line with its metrics; `batch` counts the epoch's steps
  on_test_begin, on_test_end        around each eval, with its metrics

`callback.model` is the Keras model. During `train()` its `optimizer` is `OptimizerView`, whose
`learning_rate` is the rate the optimizer applies and can be set (ReduceLROnPlateau,
LearningRateScheduler) when config.optimizer.schedule is 'constant': the trainer's schedule times
a factor, checkpointed with the run (during a warm-up, the rate it ramps up to). A cosine
schedule, or a build_learning_rate of one's own, owns the rate: setting it is refused in one line
(before training, for the two Keras classes).
`model.stop_training = True` ends the run at the boundary with a checkpoint, and the run folder
records the stop: the same command reruns to that step and trains no further. A callback's own
state (EarlyStopping's wait, best) is Python, not checkpointed: a resumed run starts it afresh.
`Trainer.train()` returns `History`, the final eval metrics with each epoch's logs.
"""

from __future__ import annotations

import difflib
import math

import keras
import numpy as np

from trainer.errors import UserError
from trainer.optim import optimizers

# fit features the trainer does in its own way: refused with the way.
REFUSED = {
  'BackupAndRestore': 'the trainer checkpoints and resumes the run itself '
  '(config.train.checkpoint_every; the same command resumes)',
}


class History(dict):
  """What `Trainer.train()` returns: the final eval metrics (`{'loss': ..., <metric>: ...}`) and,
  as `keras.callbacks.History`, `history` (`{log key: [value per epoch]}`), `epoch` (the epochs'
  numbers) and `params` (`epochs`, `steps` per epoch). A resumed run's History has the epochs
  this process ran."""

  def __init__(self, params: dict):
    super().__init__()
    self.history: dict[str, list[float]] = {}
    self.epoch: list[int] = []
    self.params = params


class OptimizerView:
  """`model.optimizer` as the callbacks see it: the trainer's optimizer (attributes read
  through), with a `learning_rate` that is the rate it applies and that the callbacks may set."""

  def __init__(self, trainer):
    self._optimizer, self._trainer = trainer.optimizer, trainer

  def __getattr__(self, name):
    return getattr(self._optimizer, name)

  @property
  def learning_rate(self) -> float:
    """The rate the optimizer applies; with the trainer's constant schedule, the rate it holds
    after the warm-up (what a callback sets: reading and setting agree during a warm-up too)."""
    rate, schedule = _own_schedule(self._trainer)
    if rate is None or schedule is None:
      return float(self._optimizer.learning_rate)
    factor = 1.0 if rate.factor is None else float(rate.factor.numpy())
    return float(np.float32(schedule.peak * factor))  # as Recoverable computes it

  @learning_rate.setter
  def learning_rate(self, value) -> None:
    value = float(value)
    rate, schedule = _own_schedule(self._trainer)
    if rate is None:  # the optimizer's own rate: Keras's setter (a variable, or a refusal)
      try:
        self._optimizer.learning_rate = value
      except TypeError:
        raise UserError(refusal(self._trainer, 'a callback')) from None
      return
    if schedule is None:
      raise UserError(refusal(self._trainer, 'a callback'))
    # The factor that makes the constant rate `value` (a warm-up ramps up to it).
    rate.settable().assign(value / schedule.peak)


def _own_schedule(trainer):
  """(the trainer's Recoverable rate, its ConfigSchedule when 'constant' else None) when the
  optimizer reads the trainer's rate (optimizers.AtGlobalStep); (None, None) when it has its own."""
  # pylint: disable-next=protected-access  (Keras keeps what it was given there)
  given = getattr(trainer.optimizer, '_learning_rate', None)
  if not isinstance(given, optimizers.AtGlobalStep) or given.schedule is not trainer.learning_rate:
    return None, None
  rate = trainer.learning_rate
  inner = rate.schedule if isinstance(rate, optimizers.Recoverable) else None
  constant = isinstance(inner, optimizers.ConfigSchedule) and inner.kind == 'constant'
  return (rate if isinstance(rate, optimizers.Recoverable) else None), (inner if constant else None)


def refusal(trainer, who: str) -> str:
  """The one line refusing `who` to set the learning rate the trainer's schedule owns."""
  kind = trainer.config.optimizer.schedule
  owner = (
    f"config.optimizer.schedule='{kind}'"
    if kind != 'constant'
    else 'the schedule of build_learning_rate or build_optimizer'
  )
  return (
    f'{who} sets the learning rate, but {owner} owns it (a rate set now would not hold): use '
    "config.optimizer.schedule='constant', or leave the callback out"
  )


def split(actions: list) -> tuple[list, list]:
  """(the actions, the Keras callbacks) of what build_actions returned."""
  callbacks = [a for a in actions if isinstance(a, keras.callbacks.Callback)]
  return [a for a in actions if not isinstance(a, keras.callbacks.Callback)], callbacks


class Callbacks:
  """The Keras callbacks of a run, called by the runner (the module docstring says when); also an
  action (its 'log' and 'eval' events end a batch and an epoch). `history` is what train()
  returns."""

  def __init__(self, callbacks: list, trainer, log_keys: list[str]):
    self.callbacks, self.trainer = callbacks, trainer
    c = trainer.config.train
    steps = c.eval_every or trainer.total_steps
    self.history = History(
      {'verbose': 0, 'epochs': math.ceil(trainer.total_steps / steps), 'steps': steps}
    )
    self._epoch: tuple[int, int] | None = None  # the open epoch's (number, first step)
    self._batch = False  # a batch began and its progress line has not come yet
    self._train: dict = {}  # the last progress line's metrics
    self._last: dict = {}  # the last epoch's logs
    self._running = self._stop_asked = False
    keys = ['loss', *log_keys]
    keys += ['val_' + k for k in keys] + ['learning_rate']
    for callback in callbacks:
      _check(callback, keys, trainer)
    rate, constant = _own_schedule(trainer)
    if callbacks and rate is not None and constant is not None:
      rate.settable()  # before the step is traced: a callback may set the rate

  def train_begin(self) -> None:
    model = self.trainer.model
    if self.callbacks:
      model.optimizer, model.stop_training = OptimizerView(self.trainer), False
    self.history = History(self.history.params)
    for callback in self.callbacks:
      callback.set_model(model)
      callback.set_params(self.history.params)
      _orient(callback)
    self._running = True
    self._call('on_train_begin', {})

  def batch_begin(self, step: int) -> None:
    """Before a compiled call."""
    if not self._running or self._batch:
      return
    if self._epoch is None:
      every = self.trainer.config.train.eval_every
      self._epoch = (step // every if every else 0, step)
      self._call('on_epoch_begin', self._epoch[0])
    self._batch = True
    self._call('on_train_batch_begin', step - self._epoch[1])

  def test_begin(self) -> None:
    if self._running:
      self._call('on_test_begin', {})

  def __call__(self, event) -> None:
    if not self._running:
      return
    if event.kind == 'log':
      self._train = dict(event.metrics)
      if self._batch:
        self._batch = False
        first = self._epoch[1] if self._epoch else 0
        self._call('on_train_batch_end', event.step - 1 - first, dict(event.metrics))
    elif event.kind == 'eval':
      self._call('on_test_end', dict(event.metrics))
      if self._epoch is not None:
        logs = {**self._train, **{'val_' + k: v for k, v in event.metrics.items()}}
        number, self._epoch = self._epoch[0], None
        self._call('on_epoch_end', number, logs)
        self.history.epoch.append(number)
        for k, v in logs.items():
          self.history.history.setdefault(k, []).append(v)
        self._last = logs

  def train_end(self, metrics: dict) -> History:
    """on_train_end; the History of the run with the final `metrics`."""
    if self._running:
      self._running = False
      self._call('on_train_end', dict(self._last))
    self.history.update(metrics)
    return self.history

  def _call(self, hook: str, *args) -> None:
    model = self.trainer.model
    for callback in self.callbacks:
      getattr(callback, hook)(*args)
      if getattr(model, 'stop_training', False) and not self._stop_asked:
        self._stop_asked = True  # the first callback's reason: the runner stops at the boundary
        self.trainer.request_stop(
          f'{type(callback).__name__} (a Keras callback) set model.stop_training in {hook}'
        )


def _check(callback, keys: list[str], trainer) -> None:
  """One-line errors before training for a callback the run cannot serve: a fit feature done
  another way here, a rate it would set that a schedule owns, a monitor no log has."""
  name = type(callback).__name__
  if name in REFUSED:
    raise UserError(f'build_actions: keras.callbacks.{name} is not used here: {REFUSED[name]}')
  sets_rate = (keras.callbacks.ReduceLROnPlateau, keras.callbacks.LearningRateScheduler)
  rate, constant = _own_schedule(trainer)
  if isinstance(callback, sets_rate) and rate is not None and constant is None:
    raise UserError(f'build_actions: {refusal(trainer, name)}')
  monitor = getattr(callback, 'monitor', None)
  if isinstance(monitor, str) and monitor not in keys:
    close = difflib.get_close_matches(monitor, keys, n=1, cutoff=0.6)
    raise UserError(
      f'build_actions: {name}(monitor={monitor!r}) names no log key; the logs have '
      f'{", ".join(keys)}' + (f' (did you mean {close[0]!r}?)' if close else '')
    )


def _orient(callback) -> None:
  """A monitor with mode='auto' that Keras cannot orient (anything but a loss on a model that was
  not compiled): one line now, not a ValueError at the first epoch's end."""
  if getattr(callback, 'monitor_op', 0) is None and hasattr(callback, '_set_monitor_op'):
    try:
      callback._set_monitor_op()  # pylint: disable=protected-access  (what Keras calls first)
    except ValueError:
      raise UserError(
        f'build_actions: {type(callback).__name__}(monitor={callback.monitor!r}) cannot tell '
        "whether it should rise or fall: pass mode='max' or mode='min'"
      ) from None
