"""The Runner: what runs a Trainer (Orbit's Controller to the Trainer's Task).

`Trainer.train()` is `trainer.runner.train()`. The runner owns the run folder (trainer/run/
workdir.py: lock, config record, checkpoint manager, TensorBoard writer), the outer loop around
the compiled inner loop (`TrainStep.run`), progress lines, evals, checkpoints, preemption, the
numerics recorder, forensics and the collapse report. It reads the trainer's parts (model,
optimizer, loss scaler, global step, train step) and calls its hooks; it keeps nothing of its
own on the trainer.

The outer loop, per compiled call of `steps_per_loop` steps: at a log step, the progress line
and a 'log' event; at an eval step (and the last step) an eval and an 'eval' event; at a
checkpoint step (the last step, a requested stop) a finite-checked save and a 'save' event; a
preemption notice saves and raises `Preempted`. Every event goes to the built-in actions first
(the numerics line, the config's early stopping and best checkpoint), then to the trainer's
`build_actions()`, all through the same API (trainer/run/actions.py).
"""
from __future__ import annotations

import math
import os
import time

import numpy as np
import tensorflow as tf
from absl import flags, logging

from trainer.errors import NonFiniteError
from trainer.insight import audit, forensics, numerics
from trainer.run import actions, epochs, lifecycle, preemption, profiling, progress
from trainer.run.workdir import Workdir
from trainer.step import contract
from trainer.step.eval_step import EvalLoop
from trainer.step.loss_scale import all_finite


class Runner:
  """Runs `trainer` (built: trainer/run/build.py). `workdir` is its run folder (a Workdir)."""

  def __init__(self, trainer):
    if not flags.FLAGS.is_parsed():  # used from Python, not launch.py: show the progress lines
      logging.set_verbosity(logging.INFO)
    self.trainer = t = trainer
    c = t.config
    self.config = c
    with t.strategy.scope():
      self.eval_loop = EvalLoop(strategy=t.strategy, compute_loss=t.compute_loss,
                                metric_names=t.metric_names, metrics=t.eval_metrics)
    self.numerics = numerics.Recorder(t, c.numerics.every, self.write_scalars)
    user_actions = list(t.build_actions())
    contract.check_actions(user_actions)
    config_actions = actions.from_config(c)
    self.actions = [numerics.NumericsLine(self.numerics), *config_actions, *user_actions]
    self.actions_state = actions.state(config_actions + user_actions)  # checkpointed
    self.items = {**t.checkpoint_items(), 'actions': self.actions_state}
    self.checkpoint = tf.train.Checkpoint(**self.items)
    self.forensics = forensics.RateLimiter(c.numerics.forensics_first, c.numerics.forensics_every)
    self.stop_reason: str | None = None
    self.workdir = Workdir(t.workdir, self.checkpoint, c, strategy=t.strategy, items=self.items)
    self.is_chief = self.workdir.is_chief  # writes the run folder (multi_worker)
    self._train_iterator = None

  # ---- the run folder --------------------------------------------------------------------
  def restore(self) -> int:
    """For training: checks the run folder and the config against its record, takes the lock,
    restores the newest readable checkpoint (or `train.init_from` when there is none), then
    records the config and opens the checkpoint manager and summary writer; returns the global
    step. Eval, export and sampling restore read-only instead (`lifecycle.restore`)."""
    t = self.trainer
    source = self.config.train.init_from
    restored = self.workdir.restore_for_training(
        init=(lambda: lifecycle.init_from(t, source)) if source else None)
    if restored:
      logging.info('resumed from %s at step %d', restored, int(t.global_step.numpy()))
    return int(t.global_step.numpy())

  def save(self) -> str:
    """Writes a checkpoint of the items at the current global step, after checking every
    variable finite: a non-finite state is never saved (NonFiniteError naming the step and the
    variables), so every checkpoint on disk, and the newest one rotation keeps, is finite."""
    step = int(self.trainer.global_step.numpy())
    self.check_finite_state()  # before anything is written for this save
    return self.workdir.save(step)

  def check_finite_state(self) -> None:
    """Raises NonFiniteError when a checkpointed variable holds inf or NaN (one reduction on the
    device; the names are looked up only then)."""
    variables = [v for v in self.checkpoint_variables() if v.dtype.is_floating]
    if bool(_all_finite(variables)):
      return
    bad = [getattr(v, 'path', None) or v.name for v in variables
           if not np.isfinite(v.numpy()).all()]
    newest = self.workdir.latest_checkpoint
    raise NonFiniteError(
        f'step {int(self.trainer.global_step.numpy())}: the training state is not finite (inf '
        f'or NaN in {len(bad)} variables, first: {", ".join(bad[:3])}); not saved. '
        + (f'The newest checkpoint, {newest}, is finite; ' if newest else '')
        + 'lower config.optimizer.learning_rate, use a loss scale, or check the input data.')

  def checkpoint_variables(self) -> list:
    """Every tf.Variable the checkpoint items hold (what check_finite_state checks)."""
    seen, found = set(), []
    for item in self.items.values():
      variables = [item] if isinstance(item, tf.Variable) else getattr(item, 'variables', [])
      for v in variables:
        v = getattr(v, 'value', v)  # the tf.Variable behind a Keras variable
        # (a Keras optimizer lists a callable learning rate among its variables)
        if isinstance(v, tf.Variable) and id(v) not in seen:
          seen.add(id(v))
          found.append(v)
    return found

  def write_scalars(self, prefix: str, values: dict[str, float], step: int) -> None:
    """TensorBoard scalars `<prefix>/<name>` at `step` (the chief's run folder)."""
    self.workdir.write_scalars(prefix, values, step)

  def request_stop(self, reason: str) -> None:
    """Ends the outer loop after the current boundary (with a checkpoint)."""
    self.stop_reason = reason

  # ---- the outer loop --------------------------------------------------------------------
  def evaluate(self) -> dict[str, float]:
    """One pass over the whole eval set; returns {'loss': ..., <metric>: ...}."""
    t = self.trainer
    return self.eval_loop.evaluate(t.strategy.experimental_distribute_dataset(t.datasets.eval))

  def act(self, kind: str, step: int, metrics=None, checkpoint=None) -> None:
    """Calls every action with one Event."""
    event = actions.Event(kind, step, dict(metrics or {}), self.trainer, checkpoint, self)
    for action in self.actions:
      action(event)

  def train(self) -> dict[str, float]:
    """Trains to `total_steps` (resuming from the run folder), evaluates; returns the eval
    metrics. Ends early, with a checkpoint, when an action calls `request_stop`."""
    tr, t = self.trainer, self.config.train
    audit.check_at_start(tr.model, tr.policy,  # precision hazards: one warning line each
                         self.config.precision.allow_low_precision_variables)
    step = self.restore()
    total = tr.total_steps
    logging.info('training %s: %d steps, global batch %d, policy %s, loss scale %s, %d '
                 'replica(s)', type(tr).__name__, total, t.batch_size, tr.policy,
                 tr.loss_scaler.mode, tr.strategy.num_replicas_in_sync)
    if step >= total:
      logging.info('the run is already at step %d of %d: nothing to train, evaluating only (to '
                   'train further, raise config.train.steps or config.train.epochs)', step, total)
    train_ds = tr.datasets.train.skip(step) if step else tr.datasets.train
    iterator = iter(tr.strategy.experimental_distribute_dataset(train_ds))
    self._train_iterator = iterator  # kept past train(): tearing it down waits for tf.data
    ticker = progress.Progress(total=total, log_every=t.log_every, first_step=step)
    self.numerics.start(step)
    elapsed, steps_timed = 0.0, 0
    last_eval = None
    profiler = profiling.StepProfiler(t.profile_steps, os.path.join(tr.workdir, 'tensorboard'))
    with preemption.Watcher() as watcher, epochs.end_of_data(self):
      try:
        while step < total and self.stop_reason is None:
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
            self.act('log', step, self.log_progress(step, steps_timed / elapsed))
            elapsed, steps_timed = 0.0, 0
          # The final eval too, before the last save: what its actions record (best eval,
          # evals without improvement) is in the checkpoint a longer run resumes from.
          if step == total or (t.eval_every and step % t.eval_every == 0):
            last_eval = watcher.call(self.log_eval, step)
          saved = (step % t.checkpoint_every == 0 or step == total or
                   self.stop_reason is not None)
          if saved:
            self.act('save', step, checkpoint=self.save())
          if watcher.should_stop(tr.strategy):  # a collective under multi_worker
            path = self.workdir.latest_checkpoint if saved else self.save()
            raise preemption.Preempted(watcher.reason, step, total, path)
          ticker.draw(step)  # the live bar, on a terminal
      finally:
        profiler.stop()
    if self.stop_reason is not None:
      logging.info('%s; stopped at step %d/%d', self.stop_reason, step, total)
      if last_eval is not None and last_eval['_step'] == step:
        return {k: v for k, v in last_eval.items() if k != '_step'}
    if last_eval is not None and last_eval['_step'] == step:
      metrics = dict(last_eval)
    else:  # a finished run started again: nothing to train, evaluate its checkpoint
      metrics = self.log_eval(step)
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
    second call runs the rest."""
    tr = self.trainer
    ts = tr.train_step
    target = int(tr.global_step.numpy()) + num_steps
    while True:
      if ts.forensics:  # the compiled loop stops after the next skip that gets forensics
        ts.stop_at_skip.assign(self.forensics.next_after(int(ts.skipped_steps.numpy())))
      ts.run(iterator, num_steps)
      step = int(tr.global_step.numpy())
      ts.guard.check(step=step, scale=tr.loss_scaler.scale,
                     checkpoint=self.workdir.latest_checkpoint)
      if step >= target:
        break
      # Stopped early, right after a skipped step: replay it, then run the rest of the call.
      self.record_forensics(step - 1)
      num_steps = target - step
    if ts.forensics and int(ts.skipped_steps.numpy()) == int(ts.stop_at_skip.numpy()):
      self.record_forensics(step - 1)  # the skip was the call's last step
    return step

  def record_forensics(self, step: int) -> None:
    """Replays skipped step `step` eagerly, layer by layer, from the current weights (a skip
    changed none), and writes <workdir>/forensics/step-N/ (trainer/insight/forensics.py)."""
    if not self.is_chief:
      return
    tr = self.trainer
    batch = next(iter(tr.datasets.train.skip(step)))  # the global batch of that step
    self.workdir.open_for_writing(step)
    try:
      forensics.record(tr, batch, step,
                       loss_scale=float(tr.train_step.guard.last_scale.numpy()))
    except Exception as e:  # pylint: disable=broad-except  (diagnostics never end a run)
      logging.warning('step %d: the forensic replay failed (%s: %s); training goes on', step,
                      type(e).__name__, (str(e).strip().splitlines() or [''])[-1][:200])

  def log_progress(self, step: int, steps_per_sec: float) -> dict[str, float]:
    """Reads and resets the step outputs' sums; writes the progress line and TensorBoard
    scalars; returns the metrics it logged."""
    tr = self.trainer
    outputs = tr.train_step.read_outputs()
    counts = {k: outputs.pop(k) for k in ('steps', 'skipped', 'nonfinite_loss')
              if k in outputs}
    lr = float(tr.learning_rate(step))
    scale = float(tr.loss_scaler.scale.numpy())
    skipped = int(tr.train_step.skipped_steps.numpy())
    nonfinite = counts.get('nonfinite_loss', 0)
    logging.info(progress.line(step=step, total=tr.total_steps, metrics=outputs,
                               learning_rate=lr, scale=scale, skipped=skipped,
                               steps_per_sec=steps_per_sec, nonfinite_loss=nonfinite))
    self.write_scalars('train', {**outputs, 'learning_rate': lr, 'loss_scale': scale,
                                 'skipped_steps': skipped, 'nonfinite_loss_steps': nonfinite,
                                 'steps_per_sec': steps_per_sec}, step)
    return outputs

  def log_eval(self, step: int) -> dict[str, float]:
    """One eval, its line, its scalars and an 'eval' event; the metrics with '_step'."""
    metrics = self.evaluate()
    logging.info('eval at step %d: %s', step,
                 ', '.join(f'{k} {v:.4f}' for k, v in metrics.items()))
    self.write_scalars('eval', metrics, step)
    self.act('eval', step, metrics)
    return {**metrics, '_step': step}


@tf.function
def _all_finite(variables) -> tf.Tensor:
  return all_finite([v.read_value() for v in variables])
