"""The Runner: what runs a Trainer (Orbit's Controller to the Trainer's Task).

`Trainer.train()` is `trainer.runner.train()`. The runner owns the run folder (trainer/run/
workdir.py: lock, config record, checkpoint manager, TensorBoard writer), the outer loop around
the compiled inner loop (`TrainLoop.run`), progress lines, evals, checkpoints, preemption, the
numerics recorder, forensics and the collapse report; what it does when training goes wrong is
one policy (trainer/run/recovery.py). It reads the trainer's parts (model, optimizer, update
groups, global step, train step) and calls its hooks; it keeps nothing of its own on the
trainer and rebinds none of its attributes.

The outer loop, per compiled call of `steps_per_loop` steps: at a log step, the progress line
and a 'log' event (and the recovery policy's look at the loss); at a checkpoint step (the last
step, a requested stop) a finite-checked save and a 'save' event; at an eval step (and the last
step) an eval and an 'eval' event, after the save, so that an eval that fails or hangs loses no
trained step; when the eval changed the actions' checkpointed state (best eval, evals without
improvement, a learning rate a Keras callback set) the step is saved again with it, and the run
folder records the eval as done. A resumed run whose restored step was due an eval that did not
complete (Ctrl-C or a kill during it) evaluates that step first. A requested stop is recorded in
the run folder: a rerun trains no further. A preemption notice saves and raises `Preempted`.
`train_steps(n)` runs the calls and their log steps alone, for a benchmark or a loop of one's own.
Every event goes to the built-in actions first (the numerics line, the config's early stopping
and best checkpoint), then to the trainer's `build_actions()`, all through the same API
(trainer/run/actions.py); the Keras callbacks among them are called last, as fit calls them
(trainer/run/keras_callbacks.py).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time

import numpy as np
import tensorflow as tf
from absl import flags, logging

from trainer import config as config_lib
from trainer import compile_cache, onednn
from trainer.errors import CollapseError, NonFiniteError
from trainer.insight import audit, forensics, numerics
from trainer.run import (
  actions,
  build,
  checkpoints,
  epochs,
  goodput,
  health,
  keras_callbacks,
  lifecycle,
  preemption,
  profiling,
  progress,
  recovery,
)
from trainer.run.workdir import Workdir
from trainer.data import checks
from trainer.optim import optimizers
from trainer.step import contract
from trainer.step.eval_step import EvalLoop
from trainer.step.loop import TrainLoop

EVAL_REPORT_SECONDS = 30.0  # a long eval prints its progress this often


class Runner:
  """Runs `trainer` (built: trainer/run/build.py): `train`, `train_steps` (the outer loop's calls
  alone), `evaluate`, `request_stop`; `workdir` is its run folder (a Workdir): `restore`, `save`,
  `on_disk`, `write_scalars`."""

  def __init__(self, trainer, started: float | None = None, first_eval_batch=None):
    if not flags.FLAGS.is_parsed():  # used from Python, not launch.py: show the progress lines
      logging.set_verbosity(logging.INFO)
    self.trainer = t = trainer
    self.config = c = t.config
    self._grappler = build.grappler(c.train.grappler)
    self.eval_loop, self.train_loop = self._loops()
    # The first eval batch (read by build unless given): the start-of-run loss, the probe's.
    self._first_eval_batch = (
      checks.first_eval_batch(t.datasets) if first_eval_batch is None else first_eval_batch
    )
    self.numerics = numerics.Recorder(
      t, c.numerics.every, self.write_scalars, batch=self._first_eval_batch
    )
    # Keras callbacks among the actions: driven as fit drives them (trainer/run/keras_callbacks.py).
    user_actions, callbacks = keras_callbacks.split(list(t.build_actions()))
    contract.check_actions(user_actions)
    config_actions = actions.from_config(c, self.eval_loop.reports)
    reported = [k for k in self.eval_loop.reports if k != 'loss']
    self.callbacks = keras_callbacks.Callbacks(callbacks, t, reported)  # may make the lr factor
    self.actions = [
      numerics.NumericsLine(self.numerics),
      *config_actions,
      *user_actions,
      self.callbacks,
    ]
    self._actions_state = actions.state(config_actions + user_actions)  # checkpointed
    self.items = {**t.checkpoint_items(), 'actions': self._actions_state}
    # The schedule's recovery factor (train.recover_lr_factor != 1), checkpointed.
    rate = t.learning_rate
    factor = rate.factor if isinstance(rate, optimizers.Recoverable) else None
    if factor is not None:
      self.items['lr_factor'] = factor
    self.clock = goodput.Clock(started)
    self.checkpoint = tf.train.Checkpoint(**self.items)
    self._stop_reason: str | None = None
    self.workdir = Workdir(
      t.workdir, self.checkpoint, c, strategy=t.strategy, items=self.items, policy=t.policy
    )
    self.is_chief = self.workdir.is_chief  # writes the run folder (multi_worker)
    self._forensic_stop = forensics.ForensicStop(t, self.train_loop, self.workdir, c.numerics)
    self.recovery = recovery.Recovery(
      c,
      workdir=self.workdir,
      items=self.items,
      factor=factor,
      global_step=t.global_step,
      clock=self.clock,
      write_scalars=self.write_scalars,
    )
    self._train_iterator = None
    self._training = False  # the run folder is open for training (restore ran)
    self._step = 0  # the global step at the last loop boundary (what the exit lines count)
    self._saved_at: int | None = None  # the step of this run's newest save
    self._last_eval: dict[str, float] | None = None  # with '_step'

  def _loops(self) -> tuple[EvalLoop, TrainLoop]:
    """The eval loop and the train loop (the compiled call of steps_per_loop steps), under the
    strategy's scope (they own variables)."""
    t, c = self.trainer, self.config
    with t.strategy.scope():
      eval_loop = EvalLoop(
        strategy=t.strategy,
        compute_loss=t.compute_loss,
        metric_names=t.metric_names,
        metrics=t.eval_metrics,
        jit_compile=t.jit_compile,
        grappler=self._grappler,
      )
      train_loop = TrainLoop(
        t.train_step,
        strategy=t.strategy,
        forensics=c.numerics.forensics_first > 0 or c.numerics.forensics_every > 0,
        element_spec=t.datasets.train.element_spec,
        grappler=self._grappler,
      )
    return eval_loop, train_loop

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
    self._check_finite_state()  # before anything is written for this save
    healthy = self.recovery.healthy(int(self.trainer.train_step.state.guard.consecutive.numpy()))
    with self.clock.timing('checkpoint'):
      path = self.workdir.save(step, healthy=healthy, loss=self.recovery.health.loss)
    self._saved_at = step
    return path

  def _save_or_recover(self, step: int) -> int | None:
    """The save at a checkpoint step and its 'save' event; None when saved. A state that is not
    finite (a NaN put in a weight between steps, a variable the per-step check does not read)
    is a recovery trigger like a collapse: the restored step, or NonFiniteError when no try is
    left (trainer/run/recovery.py)."""
    try:
      checkpoint = self.save()
    except NonFiniteError as e:
      self._step = self.recovery.after_collapse(e)
      return self._step
    self._act('save', step, checkpoint=checkpoint)
    return None

  def _check_finite_state(self) -> None:
    """Raises NonFiniteError when a variable of the checkpoint items (model, optimizer, loss
    scaler, counters, actions' state, a custom step's own plain tf.Variables) holds inf or NaN
    (one reduction on the device; the names are looked up only then)."""
    bad = checkpoints.nonfinite(checkpoints.variables(self.items))
    if not bad:
      return
    newest = self.workdir.latest_checkpoint
    # The updates of each compiled call are checked when it ends (trainer/step/step_state.py):
    # what only a save finds was written elsewhere, and no learning rate or loss scale fixes it.
    if set(bad) <= self.trainer.train_step.state.updated():
      cause = (
        'The optimizer left them finite (checked after each compiled call), so something '
        'between the steps wrote them: an action, a callback or your own code; find that write'
      )
    else:
      cause = (
        'Not an optimizer update: the forward pass writes them (a layer state such as '
        "BatchNormalization's moving statistics) or code between the steps does; check the "
        'input data'
        + (
          ', and whether a layer overflows float16 (--mode=diagnose)'
          if 'float16' in self.trainer.policy
          else ''
        )
      )
    raise NonFiniteError(
      f'step {int(self.trainer.global_step.numpy())}: the training state is not finite '
      f'({checkpoints.describe_nonfinite(bad)}); not saved. '
      + (f'The newest checkpoint, {newest}, is finite. ' if newest else '')
      + cause
    )

  def on_disk(self) -> str:
    """What an exit line says is on disk: the newest checkpoint and its step, or that there is
    none, and how many of the steps trained (to the last loop boundary) the same command redoes;
    '' before training opened the run folder."""
    if not self._training:
      return ''
    newest = self.workdir.newest_for_resume
    at = int(newest.rsplit('-', 1)[-1]) if newest else 0
    redo = f', redoing {self._step - at} steps' if self._step > at else ''
    if newest is None:
      return 'no checkpoint is on disk: the same command starts again from step 0' + redo
    return (
      f'the newest checkpoint on disk is {newest} (step {at}): the same command resumes from it'
      + redo
    )

  def write_scalars(self, prefix: str, values: dict[str, float], step: int) -> None:
    """TensorBoard scalars `<prefix>/<name>` at `step` (the chief's run folder)."""
    self.workdir.write_scalars(prefix, values, step)

  def request_stop(self, reason: str) -> None:
    """Ends the outer loop after the current boundary (with a checkpoint)."""
    self._stop_reason = reason

  # ---- the outer loop --------------------------------------------------------------------
  def evaluate(self, stop=None, step: int | None = None) -> dict[str, float] | None:
    """One pass over the whole eval set; returns {'loss': ..., <metric>: ...}, or None when
    `stop()` (asked between batches) ended it. A long pass logs its progress."""
    t = self.trainer
    return self.eval_loop.evaluate(
      t.strategy.experimental_distribute_dataset(t.datasets.eval),
      stop=stop,
      batch_done=self._eval_progress(step),
      max_batches=int(self.config.train.eval_max_batches),
    )

  def _act(self, kind: str, step: int, metrics=None, checkpoint=None) -> None:
    """Calls every action with one Event."""
    event = actions.Event(kind, step, dict(metrics or {}), self.trainer, checkpoint, self)
    for action in self.actions:
      action(event)

  def train(self) -> keras_callbacks.History:
    """Trains to `total_steps` (resuming from the run folder), saves, evaluates; returns the
    eval metrics (a History: each epoch's logs too). Ends early, with a checkpoint, when an
    action calls `request_stop` or a Keras callback sets `model.stop_training`; the run folder
    records that stop, and a rerun trains no further."""
    t, total = self.config.train, self.trainer.total_steps
    step = self._start()
    recorded = self._stop_reason = self._recorded_stop(step)
    self.callbacks.train_begin()
    with self._running(step) as watcher:
      self._redo_cut_eval(watcher, step)
      while step < total and self._stop_reason is None:
        # Calls end on multiples of steps_per_loop (eval_every and checkpoint_every are
        # multiples of it): a resume from another step (a longer train.steps, a changed
        # steps_per_loop, an early-stop or end-of-data save) comes back onto that grid.
        n = min(t.steps_per_loop - step % t.steps_per_loop, total - step)
        step, boundary = self._advance(watcher, step, n)
        if not boundary:  # a recovery went back to the last healthy checkpoint's step
          continue
        if step % t.checkpoint_every == 0 or step == total or self._stop_reason is not None:
          restored = self._save_or_recover(step)  # before the eval: nothing lost
          if restored is not None:  # the state was not finite: the last healthy checkpoint's
            step = restored
            continue
        if self._eval_due(step):
          self._eval_at(watcher, step)
        self._maybe_preempt(watcher, step)
        self._ticker.draw(step)  # the live bar, on a terminal
      if not self._evaluated(step):  # an early stop off the eval grid; a finished run again
        self._eval_at(watcher, step)
        self._maybe_preempt(watcher, step)
    if self._stop_reason is not None and recorded is None and self._saved_at == step:
      logging.info('%s; stopped at step %d/%d', self._stop_reason, step, total)
      self.workdir.record_stop(step, self._stop_reason)
    return self.callbacks.train_end(self._final_metrics(step))

  def _recorded_stop(self, step: int) -> str | None:
    """The reason of the stop the run folder records at or before the restored `step`."""
    stopped = self.workdir.stopped()
    if stopped is None or step < stopped[0]:
      return None
    self._saved_at = step  # restored from that step's checkpoint: no save again for the stop
    logging.info(
      'the run stopped at step %d (%s): not training further (to train on, delete %s)',
      stopped[0],
      stopped[1],
      os.path.join(self.workdir.checkpoint_dir, 'stopped.json'),
    )
    return stopped[1]

  def train_steps(self, n: int) -> int:
    """Trains `n` more steps as `train()` does between its boundaries (for a benchmark, or a
    loop of one's own): compiled calls ending on multiples of steps_per_loop, the progress lines
    with their 'log' events and the recovery policy's look at the loss. No eval, no checkpoint,
    no signal handling (Ctrl-C raises KeyboardInterrupt), no stop at total_steps. The first call
    starts the run as `train()` does (restore, start line); the data iterator and the progress
    lines' cadence carry on from call to call. Returns the global step reached."""
    if not self._training:
      self._open(self._start())
    spl, step = self.config.train.steps_per_loop, self._step
    target, inline = step + n, preemption.Watcher()  # not entered: it calls inline
    while step < target:
      step, _ = self._advance(inline, step, min(spl - step % spl, target - step))
    return step

  def _start(self) -> int:
    """Before the loop: the precision audit's warnings, the restore, the start line, the
    numerics recorder and the recovery policy; returns the global step."""
    tr, t = self.trainer, self.config.train
    p = self.config.precision  # precision hazards: one warning line each
    audit.check_at_start(
      tr.model,
      tr.policy,
      p.allow_low_precision_variables,
      p.master_weights != 'float32',
      audit.forward(tr),
    )
    self._step = step = self.restore()
    self._training = True
    self.clock.skipped_from = tr.train_step.state.skipped()  # this process's skips
    total = tr.total_steps
    logging.info(
      'training %s: %d steps, global batch %d, policy %s, loss scale %s, %d replica(s), '
      'XLA %s, oneDNN kernels %s, grappler %s',
      type(tr).__name__,
      total,
      t.batch_size,
      tr.policy,
      tr.loss_scaler.mode,
      tr.strategy.num_replicas_in_sync,
      'on' if tr.jit_compile else 'off',
      'on' if onednn.enabled() else 'off',
      'on' if self._grappler else 'off',
    )
    if hint := onednn.hint():  # the kernels are off only because TensorFlow loaded first
      logging.info(hint)
    if tr.jit_compile:
      logging.info(compile_cache.describe())
    if note := config_lib.loss_scale_note(tr.config, tr.policy):  # a cost per trained step
      logging.warning(note)
    if step >= total:
      logging.info(
        'the run is already at step %d of %d: nothing to train, evaluating only (to '
        'train further, raise config.train.steps or config.train.epochs)',
        step,
        total,
      )
    self.numerics.start(step)
    if step < total:  # a resumed or warm-started run has no untrained loss to compare with
      self.recovery.start(self._first_loss, resumed=step > 0 or bool(t.init_from))
    return step

  def _open(self, step: int) -> None:
    """The data iterator from `step` on, the progress ticker and the profiler, kept for the
    calls that follow (and the iterator past them: tearing it down waits for tf.data)."""
    tr, t = self.trainer, self.config.train
    logdir = os.path.join(tr.workdir, 'tensorboard')
    train_ds = tr.datasets.train.skip(step) if step else tr.datasets.train
    self._train_iterator = iter(tr.strategy.experimental_distribute_dataset(train_ds))
    self._ticker = progress.Progress(
      total=tr.total_steps,
      log_every=t.log_every,
      first_step=step,
      max_interval=progress.MAX_INTERVAL,  # its value now, not at import: tests lower it
    )
    self._profiler = profiling.StepProfiler(t.profile_steps, logdir)

  @contextlib.contextmanager
  def _running(self, step: int):
    """Around the loop: `_open`, the signal watcher (`preemption.Watcher`) and the end-of-data
    save; at the end the last background checkpoint write completes, and the goodput line is
    logged (after an error too)."""
    self._open(step)
    with preemption.Watcher(on_disk=self.on_disk) as watcher, epochs.end_of_data(self):
      try:
        yield watcher
        with self.clock.timing('checkpoint'):
          self.workdir.sync()  # the last background write, complete and recorded
      finally:
        self._profiler.stop()
        self._sync_quietly()  # after an error too: never leave a background write running
        self._log_goodput(int(self.trainer.global_step.numpy()))

  def _advance(self, watcher, step: int, n: int) -> tuple[int, bool]:
    """One compiled call of `n` steps (by `watcher.call`), then at a due log step the progress
    line, its 'log' event and the recovery policy's look at it. Returns (the step to go on from,
    whether it is the call's end: False after a recovery went back to an earlier step)."""
    self._profiler.before(step, step + n)
    self.callbacks.batch_begin(step)
    if self.clock.first_call is None:  # nothing is printed while the step is traced
      logging.info(
        'tracing and compiling the train step (the first call: steps %d-%d)', step, step + n
      )
    start = time.perf_counter()
    beat = self._heartbeat(step, step + n)
    try:
      # A second Ctrl-C stops at once (trainer/run/preemption.py).
      self._step = step = watcher.call(self._run_steps, self._train_iterator, n, on_wait=beat)
    except (CollapseError, NonFiniteError) as e:  # its steps ran: train time, not start-up
      ran = max(int(self.trainer.global_step.numpy()) - step, 1)
      self.clock.steps(time.perf_counter() - start, ran, start)
      self._step = self.recovery.after_collapse(e)  # or raises e: no recovery left
      return self._step, False
    self.clock.steps(time.perf_counter() - start, n, start)
    self._ticker.timed(time.perf_counter() - start, n)
    self._profiler.after(step)
    if not self._ticker.due(step):  # the first call, log_every, the last step, or 30 s passed
      return step, True
    logged = self._log_progress(step, self._ticker.steps_per_sec())
    self._act('log', step, logged)
    rate = next(iter(progress.learning_rates(self.trainer.train_step.groups).values()), None)
    self._step = self.recovery.after_log(step, logged, rate)  # before this step's save
    return self._step, self._step == step

  def _heartbeat(self, first: int, last: int):
    """`on_wait` for a compiled call of steps `first` to `last`: the ticker's heartbeat line."""
    started = self._ticker.clock()

    def beat() -> None:
      line = self._ticker.heartbeat(first, last, started)
      if line is not None:
        logging.info(line)

    return beat

  def _eval_at(self, watcher, step: int) -> None:
    """The eval at `step` (Ctrl-C honoured between its batches), then a save when the eval
    changed what the actions keep in the checkpoint (best eval, evals without improvement)
    and `step` was saved, or when an action asked to stop and it was not."""
    kept = self._actions_values()
    single = preemption.workers(self.trainer.strategy) == 1  # else stopping is a collective
    stop = (lambda: watcher.requested) if single else None
    with self.clock.timing('eval'):
      metrics = watcher.call(self._log_eval, step, stop)
    if metrics is None:  # interrupted: _maybe_preempt saves (if needed) and stops
      return
    changed = any(not np.array_equal(a, b) for a, b in zip(kept, self._actions_values()))
    if (changed and self._saved_at == step) or (
      self._stop_reason is not None and self._saved_at != step
    ):
      self._act('save', step, checkpoint=self.save())
    self.workdir.record_eval(step)  # after that save: a resume redoes no eval it has

  def _eval_due(self, step: int) -> bool:
    """Whether the outer loop evaluates at loop boundary `step`: the last step and every
    eval_every."""
    every = self.config.train.eval_every
    return step == self.trainer.total_steps or bool(every and step % every == 0)

  def _redo_cut_eval(self, watcher, step: int) -> None:
    """Before a resumed run trains on: the eval due at the restored `step`, when the run folder
    does not record it completed (Workdir.record_eval). The checkpoint of an eval step is
    written before its eval, so an eval cut by Ctrl-C or a kill would otherwise never happen.
    A run folder from before the record redoes it too (it cannot tell)."""
    done = self.workdir.evaluated_step()
    if step == 0 or not self._eval_due(step) or (done is not None and done >= step):
      return
    logging.info(
      'the run folder records no completed eval at step %d, the restored step (cut by Ctrl-C or '
      'a kill): evaluating it now',
      step,
    )
    # Restored from ckpt-<step>: an eval that changes the actions' state saves it again.
    self._saved_at = step
    self._eval_at(watcher, step)
    self._maybe_preempt(watcher, step)

  def _actions_values(self) -> list:
    """The actions' checkpointed state, with the learning-rate factor a Keras callback sets."""
    factor = [self.items['lr_factor']] if 'lr_factor' in self.items else []
    return [np.array(v.numpy()) for v in [*self._actions_state.variables, *factor]]

  def _evaluated(self, step: int) -> bool:
    return self._last_eval is not None and self._last_eval['_step'] == step

  def _maybe_preempt(self, watcher, step: int) -> None:
    """A signal (on any worker): saves unless `step` is saved, then raises Preempted."""
    if not watcher.should_stop(self.trainer.strategy):  # a collective under multi_worker
      return
    path = self.save() if self._saved_at != step else None
    with self.clock.timing('checkpoint'):
      self.workdir.sync()  # a background write completes before the process ends
    raise preemption.Preempted(
      watcher.reason, step, self.trainer.total_steps, path or self.workdir.newest_for_resume
    )

  def _final_metrics(self, step: int) -> dict[str, float]:
    """The last eval's metrics; NonFiniteError when its loss is not finite."""
    assert self._last_eval is not None and self._last_eval['_step'] == step
    metrics = {k: v for k, v in self._last_eval.items() if k != '_step'}
    if self._stop_reason is None and not math.isfinite(metrics['loss']):
      raise NonFiniteError(
        f'the final eval at step {step} has loss {metrics["loss"]}: the '
        'model does not compute finite outputs; see the skipped steps in '
        'the log, lower config.optimizer.learning_rate or check the data.'
      )
    r = self.recovery
    health.check_end(r.divergence, r.health, metrics['loss'], step, self.workdir.healthy_record())
    return metrics

  def _run_steps(self, iterator, num_steps: int) -> int:
    """The inner loop: `num_steps` steps from `iterator` (a distributed iterator over
    `datasets.train`) in one compiled call (more when a skip stops it for its forensic replay:
    trainer/insight/forensics.py); returns the global step after them. After each call the
    step's state raises what the call found: NonFiniteError when an applied update left the
    state non-finite, CollapseError when the guard stopped the loop (StepState.check)."""
    tr = self.trainer
    check = functools.partial(tr.train_step.state.check, scaler=tr.loss_scaler, kept=self._kept)
    return self._forensic_stop.run(iterator, num_steps, check)

  def _kept(self) -> tuple[str | None, str | None]:
    """The newest checkpoint and the last healthy one in words (what a failure's line names)."""
    return self.workdir.latest_checkpoint, health.describe(self.workdir.healthy_record())

  def _log_progress(self, step: int, steps_per_sec: float) -> dict[str, float]:
    """Reads and resets the step outputs' sums; writes the progress line and TensorBoard
    scalars; returns the metrics it logged. The learning rates and loss scales are read from
    the update groups' optimizers and scalers (what runs), one per group when they differ."""
    tr = self.trainer
    outputs = self.train_loop.read_outputs()
    counts = {k: outputs.pop(k) for k in ('steps', 'skipped', 'nonfinite_loss') if k in outputs}
    groups = tr.train_step.groups
    rates, scales = progress.learning_rates(groups), progress.loss_scales(groups)
    skipped = tr.train_step.state.skipped()
    nonfinite = counts.get('nonfinite_loss', 0)
    unprinted = tr.train_step.state.guard.unprinted()  # skips right after a skip: one line for all
    if unprinted:
      logging.warning(unprinted)
    logging.info(
      progress.line(
        step=step,
        total=tr.total_steps,
        metrics=outputs,
        learning_rate=rates,
        scale=scales,
        skipped=skipped,
        steps_per_sec=steps_per_sec,
        nonfinite_loss=nonfinite,
        steps=counts.get('steps', 0),
      )
    )
    self.write_scalars(
      'train',
      {
        **outputs,
        **progress.scalars('learning_rate', rates),
        **progress.scalars('loss_scale', scales),
        'skipped_steps': skipped,
        'nonfinite_loss_steps': nonfinite,
        'steps_per_sec': steps_per_sec,
      },
      step,
    )
    return outputs

  def _sync_quietly(self) -> None:
    try:
      self.workdir.sync()
    except Exception as e:  # pylint: disable=broad-except  (an error is already on its way)
      logging.warning('the last checkpoint write failed too (%s)', e)

  def _log_goodput(self, step: int) -> None:
    """The goodput line and its scalars (trainer/run/goodput.py); never raises (it runs while
    a run ends, maybe with an error that must not be masked)."""
    try:
      self.clock.count_skipped(self.trainer.train_step.state.skipped())
      shares = self.clock.shares()
      logging.info(self.clock.line(shares))
      if self.workdir.latest_checkpoint is not None:  # the run folder is open for writing
        self.write_scalars('goodput', shares, step)
    except Exception as e:  # pylint: disable=broad-except
      logging.warning('goodput not reported (%s: %s)', type(e).__name__, e)

  def _first_loss(self) -> float:
    """The mean loss of the first eval batch at the current weights (one forward pass): where
    the divergence monitor's running minimum starts."""
    tr = self.trainer
    per_example, _ = tr.compute_loss(self._first_eval_batch, training=False)
    return float(tf.reduce_mean(tf.cast(per_example, tf.float32)))

  def _log_eval(self, step: int, stop=None) -> dict[str, float] | None:
    """One eval (`evaluate`), its line, its scalars and an 'eval' event; the metrics with
    '_step', kept as `last_eval`. None (and no event) when `stop()` ended it early."""
    self.callbacks.test_begin()
    metrics = self.evaluate(stop, step)
    if metrics is None:
      logging.info('eval at step %d interrupted', step)
      return None
    logging.info('eval at step %d: %s', step, ', '.join(f'{k} {v:.4f}' for k, v in metrics.items()))
    self.write_scalars('eval', metrics, step)
    # Before this step's save: an eval back near the first loss makes it unhealthy.
    self.recovery.health.observe_eval(metrics['loss'], self.recovery.divergence.first)
    self._act('eval', step, metrics)
    self._last_eval = {**metrics, '_step': step}
    return self._last_eval

  def _eval_progress(self, step: int | None):
    """`batch_done(batches)` for the eval loop: a line every EVAL_REPORT_SECONDS, with the
    batches done (of how many, when tf.data knows) and the time so far."""
    started = last = time.monotonic()
    known = int(self.trainer.datasets.eval.cardinality())
    of = f' of {known}' if known > 0 else ''
    where = f'eval at step {step}' if step is not None else 'eval'

    def batch_done(batches: int) -> None:
      nonlocal last
      now = time.monotonic()
      if now - last >= EVAL_REPORT_SECONDS:
        last = now
        logging.info('%s: %d batches%s in %.0f s', where, batches, of, now - started)

    return batch_done
