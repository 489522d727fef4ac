"""The Runner: what runs a Trainer (Orbit's Controller to the Trainer's Task).

`Trainer.train()` is `trainer.runner.train()`. The runner owns the run folder (trainer/run/
workdir.py: lock, config record, checkpoint manager, TensorBoard writer), the outer loop around
the compiled inner loop (`TrainLoop.run`), progress lines, evals, checkpoints, preemption, the
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

import tensorflow as tf
from absl import flags, logging

from trainer.errors import CollapseError, DivergenceError, NonFiniteError, UserError
from trainer.insight import audit, forensics, numerics
from trainer.insight.divergence import DivergenceMonitor
from trainer.run import (
  actions,
  checkpoints,
  epochs,
  goodput,
  health,
  lifecycle,
  preemption,
  profiling,
  progress,
)
from trainer.run.workdir import Workdir
from trainer.data import checks
from trainer.step import contract
from trainer.step.eval_step import EvalLoop
from trainer.step.loop import TrainLoop
from trainer.step.loss_scale import state_variable


class Runner:
  """Runs `trainer` (built: trainer/run/build.py). `workdir` is its run folder (a Workdir)."""

  def __init__(self, trainer, started: float | None = None, first_eval_batch=None):
    if not flags.FLAGS.is_parsed():  # used from Python, not launch.py: show the progress lines
      logging.set_verbosity(logging.INFO)
    self.trainer = t = trainer
    self.config = c = t.config
    with t.strategy.scope():
      self.eval_loop = EvalLoop(
        strategy=t.strategy,
        compute_loss=t.compute_loss,
        metric_names=t.metric_names,
        metrics=t.eval_metrics,
      )
      self.train_loop = TrainLoop(  # the compiled call of steps_per_loop steps
        t.train_step,
        forensics=c.numerics.forensics_first > 0 or c.numerics.forensics_every > 0,
        element_spec=t.datasets.train.element_spec,
      )
    # The first eval batch (read by build unless given): the start-of-run loss, the probe's.
    self.first_eval_batch = (
      checks.first_eval_batch(t.datasets) if first_eval_batch is None else first_eval_batch
    )
    self.numerics = numerics.Recorder(
      t, c.numerics.every, self.write_scalars, batch=self.first_eval_batch
    )
    user_actions = list(t.build_actions())
    contract.check_actions(user_actions)
    config_actions = actions.from_config(c, self.eval_loop.reports)
    self.actions = [numerics.NumericsLine(self.numerics), *config_actions, *user_actions]
    self.actions_state = actions.state(config_actions + user_actions)  # checkpointed
    self.items = {**t.checkpoint_items(), 'actions': self.actions_state}
    # Recovery (train.recover_tries): the learning rate's factor, lowered by each recovery and
    # checkpointed; the optimizer reads the schedule through it (traced at the first step).
    self.lr_factor = None
    if c.train.recover_lr_factor != 1.0:
      with t.strategy.scope():
        self.lr_factor = state_variable(1.0, tf.float64, 'lr_factor')
      schedule, factor = t.learning_rate, self.lr_factor
      # In float64: factors such as 1e-40 (taming a learning rate of 1e38) are no float32.
      t.learning_rate = lambda step: tf.cast(
        tf.cast(schedule(step), tf.float64) * factor, tf.float32
      )
      self.items['lr_factor'] = self.lr_factor
    self.recoveries = 0
    self.health = health.Health()
    self.clock = goodput.Clock(started)
    self.checkpoint = tf.train.Checkpoint(**self.items)
    self.forensics = forensics.RateLimiter(c.numerics.forensics_first, c.numerics.forensics_every)
    self.divergence = DivergenceMonitor(c.numerics.divergence_factor)
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
      init=(lambda: lifecycle.init_from(t, source)) if source else None
    )
    if restored:
      logging.info('resumed from %s at step %d', restored, int(t.global_step.numpy()))
    return int(t.global_step.numpy())

  def save(self) -> str:
    """Writes a checkpoint of the items at the current global step, after checking every
    variable finite: a non-finite state is never saved (NonFiniteError naming the step and the
    variables), so every checkpoint on disk, and the newest one rotation keeps, is finite."""
    step = int(self.trainer.global_step.numpy())
    self.check_finite_state()  # before anything is written for this save
    healthy = self.health.healthy(int(self.trainer.train_step.guard.consecutive.numpy()))
    with self.clock.timing('checkpoint'):
      return self.workdir.save(step, healthy=healthy, loss=self.health.loss)

  def check_finite_state(self) -> None:
    """Raises NonFiniteError when a variable of the checkpoint items (model, optimizer, loss
    scaler, counters, actions' state, a custom step's own plain tf.Variables) holds inf or NaN
    (one reduction on the device; the names are looked up only then)."""
    bad = checkpoints.nonfinite(self.checkpoint_variables())
    if not bad:
      return
    newest = self.workdir.latest_checkpoint
    raise NonFiniteError(
      f'step {int(self.trainer.global_step.numpy())}: the training state is not finite '
      f'({checkpoints.describe_nonfinite(bad)}); not saved. '
      + (f'The newest checkpoint, {newest}, is finite; ' if newest else '')
      + 'lower config.optimizer.learning_rate, use a loss scale, or check the input data.'
    )

  def checkpoint_variables(self) -> list:
    """Every variable a checkpoint saves (what check_finite_state checks)."""
    return checkpoints.variables(self.items)

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
    p = self.config.precision  # precision hazards: one warning line each
    audit.check_at_start(
      tr.model,
      tr.policy,
      p.allow_low_precision_variables,
      p.master_weights != 'float32',
      audit.forward(tr),
    )
    step = self.restore()
    self.clock.skipped_from = int(tr.train_step.skipped_steps.numpy())  # this process's skips
    total = tr.total_steps
    logging.info(
      'training %s: %d steps, global batch %d, policy %s, loss scale %s, %d replica(s)',
      type(tr).__name__,
      total,
      t.batch_size,
      tr.policy,
      tr.loss_scaler.mode,
      tr.strategy.num_replicas_in_sync,
    )
    if step >= total:
      logging.info(
        'the run is already at step %d of %d: nothing to train, evaluating only (to '
        'train further, raise config.train.steps or config.train.epochs)',
        step,
        total,
      )
    train_ds = tr.datasets.train.skip(step) if step else tr.datasets.train
    iterator = iter(tr.strategy.experimental_distribute_dataset(train_ds))
    self._train_iterator = iterator  # kept past train(): tearing it down waits for tf.data
    ticker = progress.Progress(total=total, log_every=t.log_every, first_step=step)
    self.numerics.start(step)
    if self.divergence.factor > 0 and step < total:
      self.divergence.start(self.first_loss(), resumed=step > 0 or bool(t.init_from))
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
          try:
            step = watcher.call(self.run_steps, iterator, n)  # Ctrl-C twice: at once
          except CollapseError as e:  # its steps ran (all skipped): train time, not start-up
            ran = max(int(tr.global_step.numpy()) - step, 1)
            self.clock.steps(time.perf_counter() - start, ran, start)
            step = self.recover(str(e), error=e)  # or raises e: no recovery left
            continue
          elapsed += time.perf_counter() - start
          self.clock.steps(time.perf_counter() - start, n, start)
          profiler.after(step)
          steps_timed += n
          if ticker.due(step):  # the first call, log_every, the last step, or 30 s passed
            logged = self.log_progress(step, steps_timed / elapsed)
            line = self.check_divergence(step, logged)  # before this step's save
            self.act('log', step, logged)
            elapsed, steps_timed = 0.0, 0
            self.health.observe(logged.get('loss'), diverged=line is not None)
            if line is not None:
              if t.recover_tries:  # the last healthy checkpoint, unless no try is left
                restored = self.recover(line)
                if restored != step:
                  step = restored
                  continue
              self.stop_on_divergence(line)  # with config.numerics.divergence_stop
          # The final eval too, before the last save: what its actions record (best eval,
          # evals without improvement) is in the checkpoint a longer run resumes from.
          if step == total or (t.eval_every and step % t.eval_every == 0):
            with self.clock.timing('eval'):
              last_eval = watcher.call(self.log_eval, step)
          saved = step % t.checkpoint_every == 0 or step == total or self.stop_reason is not None
          if saved:
            self.act('save', step, checkpoint=self.save())
          if watcher.should_stop(tr.strategy):  # a collective under multi_worker
            path = self.save() if not saved else None
            with self.clock.timing('checkpoint'):
              self.workdir.sync()  # a background write completes before the process ends
            raise preemption.Preempted(
              watcher.reason, step, total, path or self.workdir.latest_checkpoint
            )
          ticker.draw(step)  # the live bar, on a terminal
        with self.clock.timing('checkpoint'):
          self.workdir.sync()  # the last background write, complete and recorded
      finally:
        profiler.stop()
        self._sync_quietly()  # after an error too: never leave a background write running
        self.log_goodput(step)
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
      raise NonFiniteError(
        f'the final eval at step {step} has loss {metrics["loss"]}: the '
        'model does not compute finite outputs; see the skipped steps in '
        'the log, lower config.optimizer.learning_rate or check the data.'
      )
    health.check_end(
      self.divergence, self.health, metrics['loss'], step, self.workdir.healthy_record()
    )
    return metrics

  def run_steps(self, iterator, num_steps: int) -> int:
    """The inner loop: `num_steps` steps from `iterator` (a distributed iterator over
    `datasets.train`) in one compiled call; returns the global step after them. The call
    returns its counters (TrainLoop.run); the host raises CollapseError when the guard stopped
    the loop. With forensics on, a skipped step that gets forensics ends the compiled call
    early: it is replayed, and a second call runs the rest."""
    tr, loop = self.trainer, self.train_loop
    guard = tr.train_step.guard
    target = int(tr.global_step.numpy()) + num_steps
    skipped = int(tr.train_step.skipped_steps.numpy()) if loop.forensics else 0
    while True:
      if loop.forensics:  # the compiled loop stops after the next skip that gets forensics
        stop_at = self.forensics.next_after(skipped)
        loop.stop_at_skip.assign(stop_at)
      counters = loop.run(iterator, num_steps)
      skipped = counters.skipped_steps
      step = counters.global_step
      if counters.consecutive >= guard.max_consecutive_skips > 0:
        guard.check(
          step=step,
          scaler=tr.loss_scaler,
          checkpoint=self.workdir.latest_checkpoint,
          healthy=health.describe(self.workdir.healthy_record()),
        )
      if step >= target:
        break
      # Stopped early, right after a skipped step: replay it, then run the rest of the call.
      self.record_forensics(step - 1)
      num_steps = target - step
    if loop.forensics and skipped == stop_at:
      self.record_forensics(step - 1)  # the skip was the call's last step
    return step

  def record_forensics(self, step: int) -> None:
    """Replays skipped step `step` eagerly, layer by layer, from the current weights (a skip
    changed none), and writes <workdir>/forensics/step-N/ (trainer/insight/forensics.py)."""
    if not self.is_chief:
      return
    tr = self.trainer
    # The step's own batch, kept on the device by the compiled loop when it stopped after the
    # skip (trainer/step/kept_batch.py: re-reading element N of the pipeline gives another
    # batch when it reshuffles, augments at random or is non-deterministic).
    kept = self.train_loop.kept_batch
    batch = kept.read() if kept is not None else None
    if batch is None:
      logging.warning(
        "step %d: the skipped step's batch was not kept; replaying element %d of "
        'datasets.train, which differs when the pipeline reshuffles',
        step,
        step,
      )
      batch = next(iter(tr.datasets.train.skip(step)))
    self.workdir.open_for_writing(step)
    try:
      forensics.record(tr, batch, step, loss_scale=float(tr.train_step.guard.last_scale.numpy()))
    except UserError as e:  # a planted symlink, a full disk: refused, said in one line
      logging.warning('step %d: %s; training goes on', step, e)
    except Exception as e:  # pylint: disable=broad-except  (diagnostics never end a run)
      logging.warning(
        'step %d: the forensic replay failed (%s: %s); training goes on',
        step,
        type(e).__name__,
        (str(e).strip().splitlines() or [''])[-1][:200],
      )

  def log_progress(self, step: int, steps_per_sec: float) -> dict[str, float]:
    """Reads and resets the step outputs' sums; writes the progress line and TensorBoard
    scalars; returns the metrics it logged."""
    tr = self.trainer
    outputs = self.train_loop.read_outputs()
    counts = {k: outputs.pop(k) for k in ('steps', 'skipped', 'nonfinite_loss') if k in outputs}
    lr = float(tr.learning_rate(step))
    scale = float(tr.loss_scaler.scale.numpy())
    skipped = int(tr.train_step.skipped_steps.numpy())
    nonfinite = counts.get('nonfinite_loss', 0)
    logging.info(
      progress.line(
        step=step,
        total=tr.total_steps,
        metrics=outputs,
        learning_rate=lr,
        scale=scale,
        skipped=skipped,
        steps_per_sec=steps_per_sec,
        nonfinite_loss=nonfinite,
      )
    )
    self.write_scalars(
      'train',
      {
        **outputs,
        'learning_rate': lr,
        'loss_scale': scale,
        'skipped_steps': skipped,
        'nonfinite_loss_steps': nonfinite,
        'steps_per_sec': steps_per_sec,
      },
      step,
    )
    return outputs

  def recover(self, reason: str, error: Exception | None = None) -> int:
    """After a collapse (`error`) or a diverged loss: restores the last healthy checkpoint and
    returns its step, the data iterator going on past the batches that failed (trainer/run/
    health.py); at most train.recover_tries times. Then a collapse raises as without recovery
    and a divergence is left to the collapse guard."""
    tr, t = self.trainer, self.config.train
    record = self.workdir.healthy_record()
    failed = int(tr.global_step.numpy())
    if self.recoveries >= t.recover_tries or record is None:
      if error is None:
        logging.warning(
          '%s; no recovery left (%d of config.train.recover_tries=%d done, %s)',
          reason,
          self.recoveries,
          t.recover_tries,
          health.describe(record),
        )
        return failed
      if self.recoveries:
        raise CollapseError(
          f'{error} ({self.recoveries} recoveries of '
          f'config.train.recover_tries={t.recover_tries} done)'
        ) from None
      raise error
    factor = float(self.lr_factor.numpy()) if self.lr_factor is not None else 1.0
    path = self.workdir.healthy_path()
    assert path is not None  # a record names it (checked above)
    checkpoints.restore(self.items, path)
    self.recoveries += 1
    if self.lr_factor is not None:
      factor *= t.recover_lr_factor
      self.lr_factor.assign(factor)
    step = int(tr.global_step.numpy())
    self.health.bad = False
    self.clock.redone(failed - step)
    logging.warning(
      'recovery %d of %d: %s; restored the checkpoint (%s) and go on from step %d '
      'with the data after step %d%s',
      self.recoveries,
      t.recover_tries,
      reason.split('. ')[0],
      health.describe(record),
      step,
      failed,
      f', learning rate x{factor:g}' if self.lr_factor is not None else '',
    )
    self.write_scalars(
      'recovery',
      {'recoveries': self.recoveries, 'redone_steps': failed - step, 'lr_factor': factor},
      failed,
    )
    return step

  def _sync_quietly(self) -> None:
    try:
      self.workdir.sync()
    except Exception as e:  # pylint: disable=broad-except  (an error is already on its way)
      logging.warning('the last checkpoint write failed too (%s)', e)

  def log_goodput(self, step: int) -> None:
    """The goodput line and its scalars (trainer/run/goodput.py); never raises (it runs while
    a run ends, maybe with an error that must not be masked)."""
    try:
      self.clock.count_skipped(int(self.trainer.train_step.skipped_steps.numpy()))
      shares = self.clock.shares()
      logging.info(self.clock.line(shares))
      if self.workdir.latest_checkpoint is not None:  # the run folder is open for writing
        self.write_scalars('goodput', shares, step)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning('goodput not reported (%s: %s)', type(e).__name__, e)

  def first_loss(self) -> float:
    """The mean loss of the first eval batch at the current weights (one forward pass): where
    the divergence monitor's running minimum starts."""
    tr = self.trainer
    per_example, _ = tr.compute_loss(self.first_eval_batch, training=False)
    return float(tf.reduce_mean(tf.cast(per_example, tf.float32)))

  def check_divergence(self, step: int, logged: dict[str, float]) -> str | None:
    """At a log step: the divergence line (trainer/insight/divergence.py), logged as a warning
    and returned, when the logged loss diverged; else None."""
    if 'loss' not in logged:
      return None
    line = self.divergence.update(step, logged['loss'], float(self.trainer.learning_rate(step)))
    if line is not None:
      logging.warning(line)
    return line

  def stop_on_divergence(self, line: str) -> None:
    """With config.numerics.divergence_stop: DivergenceError (the newest checkpoint on disk,
    written before the divergence was seen, stays the newest)."""
    if self.config.numerics.divergence_stop:
      newest = self.workdir.latest_checkpoint
      raise DivergenceError(
        line
        + '. Stopped (config.numerics.divergence_stop=True); '
        + (
          f'the newest checkpoint, {newest}, was written before it'
          if newest
          else 'no checkpoint was written yet'
        )
      )

  def log_eval(self, step: int) -> dict[str, float]:
    """One eval, its line, its scalars and an 'eval' event; the metrics with '_step'."""
    metrics = self.evaluate()
    logging.info('eval at step %d: %s', step, ', '.join(f'{k} {v:.4f}' for k, v in metrics.items()))
    self.write_scalars('eval', metrics, step)
    self.health.observe_eval(metrics['loss'], self.divergence.first)  # before this step's save
    self.act('eval', step, metrics)
    return {**metrics, '_step': step}
