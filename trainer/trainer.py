"""The Trainer base class: a model subclasses it and fills in three hooks.

  build_model()      -> a Keras model (built under the strategy's scope and the precision policy)
  build_datasets()   -> Datasets(train, eval, train_examples): `train` a tf.data of global
                        batches (repeated by the trainer when finite, trainer/epochs.py),
                        `eval` one pass over the eval set (remainder kept)
  compute_loss(batch, *, training) -> (per-example loss [B] float32,
                                       {metric name: per-example value [B]})

and, beyond them (each with a working default):

  build_optimizer(learning_rate)   -> the optimizer (default from config.optimizer)
  build_metrics()    -> {name: stateful Keras metric} updated from compute_loss's entry `name`
                        (a tuple of update_state arguments); default {}
  build_train_step() -> the TrainStep (trainer/train_step.py states its public contract)
  checkpoint_items() -> {name: trackable} saved in every checkpoint
  build_actions()    -> callables run at log, eval and save boundaries (trainer/actions.py)

The framework owns the rest: precision policy, strategy scope, loss scaling (trainer/loss_scale.py),
the compiled inner loop (trainer/train_step.py), this outer loop (logging, TensorBoard, eval,
checkpoints, resume, actions), and the config saved as JSON in the workdir.
"""
from __future__ import annotations

import math
import os
import time
from typing import NamedTuple

import keras
import ml_collections
import numpy as np
import tensorflow as tf
from absl import flags, logging

from trainer import config as config_lib
from trainer import (actions, audit, contract, distribute, epochs, forensics,
                     lifecycle, numerics, optimizers, precision, preemption, profiling, progress)
from trainer import workdir as workdir_lib
from trainer.errors import NonFiniteError
from trainer.loss_scale import LossScaler, all_finite, state_variable
from trainer.train_step import EvalLoop, TrainStep


class Datasets(NamedTuple):
  train: tf.data.Dataset  # global batches, drop_remainder=True; repeated here when finite
  eval: tf.data.Dataset  # one pass, batched, remainder kept
  train_examples: int = 0  # one epoch = train_examples // batch_size (see trainer/epochs.py)


def _jit(setting: str) -> bool:
  if setting == 'auto':
    return bool(tf.config.list_physical_devices('GPU') or tf.config.list_logical_devices('TPU'))
  return setting == 'true'


class Trainer:
  """Subclass it, fill in the hooks, then `MyTrainer(config, workdir).train()`."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str, *,
               strategy: tf.distribute.Strategy | None = None):
    if not flags.FLAGS.is_parsed():  # used from Python, not launch.py: show the progress line
      logging.set_verbosity(logging.INFO)
    contract.check_hooks(self, Trainer)  # before any hook runs
    self.config = config_lib.validate(config)
    self.workdir = workdir_lib.local_path(workdir)
    c = self.config
    # First: the thread pools and multi_worker and tpu must be set up before anything touches
    # TF devices.
    distribute.set_threads(c)
    self.strategy = strategy or distribute.build(c)
    distribute.check_batch(self.strategy, c.train.batch_size)
    if c.train.deterministic:
      tf.config.experimental.enable_op_determinism()
    keras.utils.set_random_seed(c.seed)
    self.policy = precision.apply(c.precision.policy)

    # A finite train dataset is repeated; one epoch is its cardinality when known.
    self.datasets, steps_per_epoch = epochs.prepare(self.build_datasets(), c.train.batch_size)
    epochs.check_length(self.datasets, steps_per_epoch, c)
    self.total_steps = c.train.steps or c.train.epochs * steps_per_epoch

    self.jit_compile = _jit(c.train.jit_compile)
    with self.strategy.scope():
      self.model = precision.build_model(self.build_model, c.precision.float32_layers)
      # Two sets of the stateful metrics: one the train loop updates, one the eval loop.
      self.train_metrics = self.build_metrics()
      contract.check_metrics(self.train_metrics)
      self.eval_metrics = self.build_metrics()
      # One eager forward pass builds the model, checks the hooks' contract (one-line errors
      # before anything is written) and tells the metric names.
      self.global_step = state_variable(0, tf.int64, 'global_step')  # a loss may read it
      batch = contract.first_eval_batch(self.datasets)  # the datasets: checked by epochs.prepare
      self.metric_names = tuple(contract.probe(batch, self.compute_loss,
                                               stateful=self.train_metrics))
      if type(self).build_train_step is Trainer.build_train_step:  # a custom step may differ
        contract.check_gradient(batch, self.compute_loss, self.model)
      if c.precision.float8:  # after the probe: quantize needs a built model
        precision.quantize_float8(self.model)
      self.loss_scaler = LossScaler.from_config(c.precision, self.policy)
      self.learning_rate = optimizers.schedule(c.optimizer, self.total_steps)
      self.optimizer = self.build_optimizer(lambda: self.learning_rate(self.global_step))
      self.train_step = self.build_train_step()
      self.eval_loop = EvalLoop(strategy=self.strategy, compute_loss=self.compute_loss,
                                metric_names=self.metric_names, metrics=self.eval_metrics)
    self.actions = list(self.build_actions())
    contract.check_actions(self.actions)
    self._actions_state = actions.state(self.actions)  # checkpointed: see checkpoint_items
    self.checkpoint = tf.train.Checkpoint(**self.checkpoint_items())
    self.numerics = numerics.Recorder(self, c.numerics.every)
    self._forensics = forensics.RateLimiter(c.numerics.forensics_first,
                                            c.numerics.forensics_every)
    self._stop_reason = None
    # The run folder: config record, checkpoints, summaries, lock (trainer/workdir.py).
    self.run_dir = workdir_lib.Workdir(self.workdir, self.checkpoint, c, strategy=self.strategy,
                                       items=self.checkpoint_items())
    self.is_chief = self.run_dir.is_chief  # writes the workdir (multi_worker)

  # ---- hooks -------------------------------------------------------------------------------
  def build_model(self) -> keras.Model:
    raise NotImplementedError('a Trainer subclass must define build_model()')

  def build_datasets(self) -> Datasets:
    raise NotImplementedError('a Trainer subclass must define build_datasets()')

  def compute_loss(self, batch, *, training: bool):
    raise NotImplementedError('a Trainer subclass must define compute_loss()')

  def build_optimizer(self, learning_rate) -> keras.optimizers.Optimizer:
    """`learning_rate` is a no-argument callable (the schedule at the global step)."""
    return optimizers.build(self.config.optimizer, learning_rate)

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

  def checkpoint_items(self) -> dict:
    """{name: trackable} written in every checkpoint and restored on resume (the default also
    holds the actions' state: best eval so far, evals without improvement); extend it for
    what a custom step adds (`{**super().checkpoint_items(), 'g_optimizer': ...}`)."""
    return {'model': self.model, 'optimizer': self.optimizer, 'loss_scaler': self.loss_scaler,
            'global_step': self.global_step, 'skipped_steps': self.train_step.skipped_steps,
            'consecutive_skips': self.train_step.guard.consecutive,
            'actions': self._actions_state}

  def build_actions(self) -> list:
    """Callables run at log, eval and save boundaries (trainer/actions.py); default: the
    config's early_stopping and best_checkpoint."""
    return actions.from_config(self.config)

  def request_stop(self, reason: str) -> None:
    """Asks the outer loop to end after the current boundary (with a checkpoint)."""
    self._stop_reason = reason

  # ---- workdir (trainer/workdir.py) -------------------------------------------------------
  def restore(self) -> int:
    """For training: checks the workdir and the config against its record, takes the workdir's
    lock, restores the newest readable checkpoint (or `train.init_from` when there is none), then
    records the config and opens the checkpoint manager and summary writer; returns the global
    step. Eval, export and sampling restore read-only instead (`lifecycle.restore`)."""
    source = self.config.train.init_from
    restored = self.run_dir.restore_for_training(
        init=(lambda: lifecycle.init_from(self, source)) if source else None)
    if restored:
      logging.info('resumed from %s at step %d', restored, int(self.global_step.numpy()))
    return int(self.global_step.numpy())

  def save(self) -> str:
    """Writes a checkpoint of `checkpoint_items()` at the current global step, after checking
    every variable finite: a non-finite state is never saved (NonFiniteError naming the step and
    the variables), so every checkpoint on disk, and the newest one rotation keeps, is finite."""
    step = int(self.global_step.numpy())
    self.check_finite_state()  # before anything is written for this save
    return self.run_dir.save(step)

  def check_finite_state(self) -> None:
    """Raises NonFiniteError when a model or optimizer variable holds inf or NaN (one reduction
    on the device; the names are looked up only then)."""
    variables = [v for v in self.checkpoint_variables() if v.dtype.is_floating]
    if bool(_all_finite(variables)):
      return
    bad = [getattr(v, 'path', None) or v.name for v in variables
           if not np.isfinite(v.numpy()).all()]
    newest = self.run_dir.latest_checkpoint
    raise NonFiniteError(
        f'step {int(self.global_step.numpy())}: the training state is not finite (inf or NaN in '
        f'{len(bad)} variables, first: {", ".join(bad[:3])}); not saved. '
        + (f'The newest checkpoint, {newest}, is finite; ' if newest else '')
        + 'lower config.optimizer.learning_rate, use a loss scale, or check the input data.')

  def checkpoint_variables(self) -> list:
    """The model's and optimizers' variables (what check_finite_state checks)."""
    seen, found = set(), []
    for item in self.checkpoint_items().values():
      variables = [item] if isinstance(item, tf.Variable) else getattr(item, 'variables', [])
      for v in variables:
        v = getattr(v, 'value', v)  # the tf.Variable behind a Keras variable
        # (a Keras optimizer lists a callable learning rate among its variables)
        if isinstance(v, tf.Variable) and id(v) not in seen:
          seen.add(id(v))
          found.append(v)
    return found

  # ---- loops -------------------------------------------------------------------------------
  def evaluate(self) -> dict[str, float]:
    """One pass over the whole eval set; returns {'loss': ..., <metric>: ...}."""
    dataset = self.strategy.experimental_distribute_dataset(self.datasets.eval)
    return self.eval_loop.evaluate(dataset)

  def _write_scalars(self, prefix: str, values: dict[str, float], step: int):
    self.run_dir.write_scalars(prefix, values, step)

  def _act(self, kind: str, step: int, metrics=None, checkpoint=None) -> None:
    event = actions.Event(kind, step, dict(metrics or {}), self, checkpoint)
    for action in self.actions:
      action(event)

  def train(self) -> dict[str, float]:
    """Trains to `total_steps` (resuming from the workdir), evaluates; returns eval metrics.
    Ends early, with a checkpoint, when an action calls `request_stop`."""
    t = self.config.train
    audit.check_at_start(self.model, self.policy,  # precision hazards: one warning line each
                         self.config.precision.allow_low_precision_variables)
    step = self.restore()
    total = self.total_steps
    logging.info('training %s: %d steps, global batch %d, policy %s, loss scale %s, %d '
                 'replica(s)', type(self).__name__, total, t.batch_size, self.policy,
                 self.loss_scaler.mode, self.strategy.num_replicas_in_sync)
    if step >= total:
      logging.info('the run is already at step %d of %d: nothing to train, evaluating only (to '
                   'train further, raise config.train.steps or config.train.epochs)', step, total)
    train_ds = self.datasets.train.skip(step) if step else self.datasets.train
    iterator = iter(self.strategy.experimental_distribute_dataset(train_ds))
    # Kept past train()'s return: tearing it down waits for tf.data's threads.
    self._train_iterator = iterator
    ticker = progress.Progress(total=total, log_every=t.log_every, first_step=step)
    self.numerics.start(step)
    elapsed, steps_timed = 0.0, 0
    last_eval = None
    profiler = profiling.StepProfiler(t.profile_steps, os.path.join(self.workdir, 'tensorboard'))
    with preemption.Watcher() as watcher, epochs.end_of_data(self):
      try:
        while step < total and self._stop_reason is None:
          # Calls end on multiples of steps_per_loop (eval_every and checkpoint_every are
          # multiples of it): a resume from another step (a longer train.steps, a changed
          # steps_per_loop, an early-stop or end-of-data save) comes back onto that grid.
          n = min(t.steps_per_loop - step % t.steps_per_loop, total - step)
          profiler.before(step, step + n)
          start = time.perf_counter()
          step = watcher.call(self.run_steps, iterator, n)  # Ctrl-C twice: at once
          elapsed += time.perf_counter() - start
          profiler.after(step)
          steps_timed += n
          if ticker.due(step):  # the first call, log_every, the last step, or 30 s passed
            self._act('log', step, self.log_progress(step, steps_timed / elapsed))
            elapsed, steps_timed = 0.0, 0
            if self.numerics.due(step):
              logging.info(self.numerics.record(step)['line'])
          # The final eval too, before the last save: what its actions record (best eval,
          # evals without improvement) is in the checkpoint a longer run resumes from.
          if step == total or (t.eval_every and step % t.eval_every == 0):
            last_eval = watcher.call(self._log_eval, step)
          saved = (step % t.checkpoint_every == 0 or step == total or
                   self._stop_reason is not None)
          if saved:
            self._act('save', step, checkpoint=self.save())
          if watcher.should_stop(self.strategy):  # a collective under multi_worker
            path = self.run_dir.latest_checkpoint if saved else self.save()
            raise preemption.Preempted(watcher.reason, step, total, path)
          ticker.draw(step)  # the live bar, on a terminal
      finally:
        profiler.stop()
    if self._stop_reason is not None:
      logging.info('%s; stopped at step %d/%d', self._stop_reason, step, total)
      if last_eval is not None and last_eval['_step'] == step:
        return {k: v for k, v in last_eval.items() if k != '_step'}
    if last_eval is not None and last_eval['_step'] == step:
      metrics = dict(last_eval)
    else:  # a finished run started again: nothing to train, evaluate its checkpoint
      metrics = self._log_eval(step)
    metrics.pop('_step')
    if not math.isfinite(metrics['loss']):
      raise NonFiniteError(f'the final eval at step {step} has loss {metrics["loss"]}: the '
                           'model does not compute finite outputs; see the skipped steps in '
                           'the log, lower config.optimizer.learning_rate or check the data.')
    return metrics

  def run_steps(self, iterator, num_steps: int) -> int:
    """The inner loop: `num_steps` steps from `iterator` (a distributed iterator over
    `datasets.train`) in one compiled call; returns the global step after them. Between calls
    the host reads the global step (with the collapse guard on, its counter; with forensics on,
    the skip counter) and raises CollapseError when the guard stopped the loop. With forensics
    on, a skipped step that gets forensics ends the compiled call early: it is replayed, and a
    second call runs the rest. `train()` is the outer loop around it."""
    ts = self.train_step
    target = int(self.global_step.numpy()) + num_steps
    while True:
      if ts.forensics:  # the compiled loop stops after the next skip that gets forensics
        ts.stop_at_skip.assign(self._forensics.next_after(int(ts.skipped_steps.numpy())))
      ts.run(iterator, num_steps)
      step = int(self.global_step.numpy())
      ts.guard.check(step=step, scale=self.loss_scaler.scale,
                     checkpoint=self.run_dir.latest_checkpoint)
      if step >= target:
        break
      # Stopped early, right after a skipped step: replay it, then run the rest of the call.
      self._record_forensics(step - 1)
      num_steps = target - step
    if ts.forensics and int(ts.skipped_steps.numpy()) == int(ts.stop_at_skip.numpy()):
      self._record_forensics(step - 1)  # the skip was the call's last step
    return step

  def _record_forensics(self, step: int) -> None:
    """Replays skipped step `step` eagerly, layer by layer, from the current weights (a skip
    changed none), and writes <workdir>/forensics/step-N/ (trainer/forensics.py)."""
    if not self.is_chief:
      return
    batch = next(iter(self.datasets.train.skip(step)))  # the global batch of that step
    self.run_dir.open_for_writing(step)
    try:
      forensics.record(self, batch, step,
                       loss_scale=float(self.train_step.guard.last_scale.numpy()))
    except Exception as e:  # pylint: disable=broad-except  (diagnostics never end a run)
      logging.warning('step %d: the forensic replay failed (%s: %s); training goes on', step,
                      type(e).__name__, (str(e).strip().splitlines() or [''])[-1][:200])

  def log_progress(self, step: int, steps_per_sec: float) -> dict[str, float]:
    """Reads and resets the step outputs' sums; writes the progress line and TensorBoard
    scalars; returns the metrics it logged."""
    outputs = self.train_step.read_outputs()
    counts = {k: outputs.pop(k) for k in ('steps', 'skipped', 'nonfinite_loss')
              if k in outputs}
    lr = float(self.learning_rate(step))
    scale = float(self.loss_scaler.scale.numpy())
    skipped = int(self.train_step.skipped_steps.numpy())
    nonfinite = counts.get('nonfinite_loss', 0)
    logging.info(progress.line(step=step, total=self.total_steps, metrics=outputs,
                               learning_rate=lr, scale=scale, skipped=skipped,
                               steps_per_sec=steps_per_sec, nonfinite_loss=nonfinite))
    self._write_scalars('train', {**outputs, 'learning_rate': lr, 'loss_scale': scale,
                                  'skipped_steps': skipped, 'nonfinite_loss_steps': nonfinite,
                                  'steps_per_sec': steps_per_sec}, step)
    return outputs

  def _log_eval(self, step: int) -> dict[str, float]:
    metrics = self.evaluate()
    logging.info('eval at step %d: %s', step,
                 ', '.join(f'{k} {v:.4f}' for k, v in metrics.items()))
    self._write_scalars('eval', metrics, step)
    self._act('eval', step, metrics)
    return {**metrics, '_step': step}


@tf.function
def _all_finite(variables) -> tf.Tensor:
  return all_finite([v.read_value() for v in variables])
