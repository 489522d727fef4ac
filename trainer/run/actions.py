"""Outer-loop actions: callables the runner calls at log, eval and save boundaries (Orbit's
train/eval actions).

An action is any callable taking one `Event`. The runner (trainer/run/runner.py) calls its
built-in actions, then those of `Trainer.build_actions()`, after each progress line ('log', with
the train metrics), each eval ('eval', with the eval metrics; the final one too) and each save
('save', with the checkpoint path). An action may end the run with
`event.trainer.request_stop(reason)` (the runner saves a checkpoint at that step and returns the
last eval) and write TensorBoard scalars with `event.scalar(name, value)`. The runner adds the two
shipped here from config keys: `EarlyStopping` (config.early_stopping.*) and `BestCheckpoint`
(config.best_checkpoint.*). An action that is a `tf.Module` (both are) is saved in every
checkpoint under `actions` (`state`): a resumed run goes on comparing with the best eval before
the restart and counting the evals without improvement.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Collection
from typing import Any, NamedTuple

import ml_collections
import tensorflow as tf
from absl import logging

from trainer.run import checkpoint_files, checkpoints
from trainer.run import workdir
from trainer.errors import ConfigError


class Event(NamedTuple):
  """What an action is called with."""

  kind: str  # 'log', 'eval' or 'save'
  step: int  # the global step
  metrics: dict[str, float]  # train metrics ('log'), eval metrics ('eval'), {} ('save')
  trainer: Any  # the Trainer: its parts (model, optimizer, ...) and request_stop(reason)
  checkpoint: str | None = None  # 'save' only: the checkpoint's path
  runner: Any = None  # the Runner (trainer/run/runner.py): the run folder, `is_chief`

  def scalar(self, name: str, value: float) -> None:
    """Writes `value` as the TensorBoard scalar `actions/<name>` at this event's step (the
    run's event file; a no-op outside a run)."""
    if self.runner is not None:
      self.runner.write_scalars('actions', {name: float(value)}, self.step)


def _direction(metric: str, mode: str) -> str:
  """'min' or 'max'; mode 'auto' is 'min' for losses and errors, 'max' otherwise."""
  if mode != 'auto':
    return mode
  return 'min' if any(w in metric for w in ('loss', 'error', 'perplexity')) else 'max'


class _Tracker(tf.Module):
  """The best value of one eval metric so far (checkpointed)."""

  KEY = ''  # its config section

  def __init__(self, metric: str, mode: str, min_delta: float = 0.0) -> None:
    super().__init__(name=type(self).__name__)
    self.metric, self.mode, self.min_delta = metric, _direction(metric, mode), min_delta
    # A flag rather than +-inf: every floating variable of a checkpoint is checked finite.
    self._best = tf.Variable(0.0, dtype=tf.float64, trainable=False, name='best')
    self._has_best = tf.Variable(False, trainable=False, name='has_best')

  @property
  def best(self) -> float:
    if bool(self._has_best.numpy()):
      return float(self._best.numpy())
    return math.inf if self.mode == 'min' else -math.inf

  def value(self, event: Event) -> float:
    if self.metric not in event.metrics:
      raise ConfigError(
        f'{type(self).__name__}: no eval metric {self.metric!r}; the eval '
        f'reports {", ".join(event.metrics)}.'
      )
    return event.metrics[self.metric]

  def improved(self, value: float) -> bool:
    if not math.isfinite(value):
      return False
    better = (
      value < self.best - self.min_delta
      if self.mode == 'min'
      else value > self.best + self.min_delta
    )
    if better:
      self._best.assign(value)
      self._has_best.assign(True)
    return better


class EarlyStopping(_Tracker):
  """Stops training when `metric` has not improved by more than `min_delta` for `patience`
  evals in a row."""

  KEY = 'early_stopping'

  def __init__(
    self, metric: str, mode: str = 'auto', patience: int = 3, min_delta: float = 0.0
  ) -> None:
    super().__init__(metric, mode, min_delta)
    self.patience = int(patience)
    self._waited = tf.Variable(0, dtype=tf.int64, trainable=False, name='waited')

  @property
  def waited(self) -> int:
    return int(self._waited.numpy())

  def __call__(self, event: Event) -> None:
    if event.kind != 'eval':
      return
    value = self.value(event)
    if self.improved(value):
      self._waited.assign(0)
      return
    self._waited.assign_add(1)
    if self.waited >= self.patience:
      event.trainer.request_stop(
        f'early stopping: eval {self.metric} has not improved on {self.best:.4g} for '
        f'{self.waited} evals (config.early_stopping.patience={self.patience})'
      )


class BestCheckpoint(_Tracker):
  """Keeps the model weights of the best eval by `metric` in <workdir>/best/ (a checkpoint of
  the model alone, loadable with train.init_from=<workdir>/best, and best.json with the step
  and the metric). Only the chief writes."""

  KEY = 'best_checkpoint'

  def __init__(self, metric: str, mode: str = 'auto') -> None:
    super().__init__(metric, mode)
    self._manager = None

  def __call__(self, event: Event) -> None:
    if event.kind != 'eval':
      return
    value = self.value(event)
    trainer = event.trainer
    before = (self._best.numpy(), self._has_best.numpy())
    if not self.improved(value) or (event.runner is not None and not event.runner.is_chief):
      return
    # As every save: a non-finite weight is never written (an eval can be finite with a NaN in
    # a weight it does not reach); the best so far stays the one on disk.
    bad = checkpoints.nonfinite(checkpoints.variables({'model': trainer.model}))
    if bad:
      self._best.assign(before[0])
      self._has_best.assign(before[1])
      logging.warning(
        'best eval %s %.4f at step %d not saved: the model is not finite (%s)',
        self.metric,
        value,
        event.step,
        checkpoints.describe_nonfinite(bad),
      )
      return
    folder = os.path.join(trainer.workdir, 'best')
    if self._manager is None:
      # As for the run's own checkpoints: rotation must delete only this run's best/ files.
      checkpoint_files.own_state(os.path.join(folder, 'checkpoints'), drop_foreign=True)
      self._manager = tf.train.CheckpointManager(
        tf.train.Checkpoint(model=trainer.model), os.path.join(folder, 'checkpoints'), max_to_keep=1
      )
    # One-line errors for a full disk; best.json written atomically, never through a symlink.
    path = checkpoints.save(self._manager, event.step, resumed_from=False)
    workdir.write_json(
      os.path.join(folder, 'best.json'),
      {
        'step': event.step,
        'metric': self.metric,
        'value': value,
        'checkpoint': os.path.relpath(path, folder),
      },
    )
    logging.info('best eval %s %.4f at step %d: saved %s', self.metric, value, event.step, path)


def state(actions: list) -> tf.Module:
  """The checkpoint item of `actions`: the ones that are tf.Modules, by class name (and a
  number after the first of a class)."""
  module, counts = tf.Module(name='actions'), {}  # type: tuple[tf.Module, dict[str, int]]
  for action in actions:
    if isinstance(action, tf.Module):
      name = type(action).__name__
      counts[name] = counts.get(name, 0) + 1
      setattr(module, name if counts[name] == 1 else f'{name}_{counts[name]}', action)
  return module


def from_config(config: ml_collections.ConfigDict, reported: Collection[str]) -> list:
  """The actions the config asks for (early_stopping.metric, best_checkpoint.metric). A metric
  the eval does not report (`reported`: its names) is a ConfigError now, before training, not at
  the first eval, after steps without a checkpoint."""
  actions: list[_Tracker] = []
  if config.early_stopping.metric:
    e = config.early_stopping
    actions.append(EarlyStopping(e.metric, e.mode, e.patience, e.min_delta))
  if config.best_checkpoint.metric:
    actions.append(BestCheckpoint(config.best_checkpoint.metric, config.best_checkpoint.mode))
  for action in actions:
    if action.metric not in reported:
      close = difflib.get_close_matches(action.metric, reported, n=1, cutoff=0.6)
      raise ConfigError(
        f'config.{action.KEY}.metric={action.metric!r} is not an eval metric; '
        f'the eval reports {", ".join(reported)}'
        + (f' (did you mean {close[0]!r}?)' if close else '')
      )
  return actions
