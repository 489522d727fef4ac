"""Preemption: SIGTERM or Ctrl-C stops training at the next loop boundary with a checkpoint.

A scheduler's SIGTERM (or a first Ctrl-C) only sets a flag. At each loop boundary (between
compiled `steps_per_loop` calls) the trainer asks `watcher.should_stop(strategy)`; when it says
yes, every process saves a checkpoint at that same step and raises `Preempted`, and the launcher
prints where it stopped and exits with code 0 (a worker with EXIT_PREEMPTED). The same command
resumes from that checkpoint.

Several workers: the signal reaches one host, but all must stop at the same step (saving is a
collective), so `should_stop` all-reduces the flag (one float per replica, SUM) at every loop
boundary, and each worker exits with EXIT_PREEMPTED (a single process with 0). TF's
`tf.distribute.experimental.PreemptionCheckpointHandler` does the same job but owns
the checkpointing (it restores at construction, adds its own run counter to our checkpoint,
replaces our SIGTERM handler, not Ctrl-C's, exits through its `exit_fn`, `sys.exit(42)` off Google
Cloud, and agrees through the coordination service from watcher threads); our saves already
happen at loop boundaries in the same order on every worker, so one all-reduce there suffices.

A second Ctrl-C interrupts at once: Python runs signal handlers only in the main thread between
bytecodes, so a handler would wait for the whole compiled (C++) call. `watcher.call(fn, ...)` runs
the call in a worker thread while the main thread waits in short, interruptible waits; on the
second SIGINT the handler exits the process (code 130) with one line, without a checkpoint (the
newest one on disk is intact: writes are atomic).
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import sys
import threading

from absl import logging

from trainer.run import lock as workdir_lock

SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_INTERRUPTED = 130  # the shell's code for a process ended by SIGINT
# A worker (multi_worker) stopped by a signal before its last step, its checkpoint saved:
# "preempted, restart me", for a scheduler (the manifest's podFailurePolicy restarts it). Not
# 0, which would complete a Kubernetes Job's index before the run ended; sysexits' EX_TEMPFAIL.
EXIT_PREEMPTED = 75
_POLL_SECONDS = 0.2  # how often the waiting main thread runs pending signal handlers


class Preempted(Exception):
  """Training stopped on a signal after saving a checkpoint; run the same command to resume."""

  def __init__(self, signal_name: str | None, step: int, total: int, checkpoint: str | None):
    super().__init__(
      f'stopped by {signal_name} at step {step}/{total}; checkpoint saved to '
      f'{checkpoint}; run the same command again to resume'
    )
    self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint


class Watcher:
  """`with Watcher() as w:` ... `step = w.call(run_steps, ...)` ... `if w.should_stop(strategy):
  save and raise Preempted(w.reason, ...)`. Handlers are restored on exit. Outside the main
  thread (where Python cannot install handlers) it watches nothing and `call` runs inline."""

  def __init__(self, signals=SIGNALS, on_disk=None):
    self.signals = tuple(signals)
    self.on_disk = on_disk  # () -> what is on disk, for the second Ctrl-C's line
    self.received: signal.Signals | None = None
    self.reason: str | None = None  # set by should_stop: e.g. 'SIGTERM on another worker'
    self._previous = {}
    self._executor = None
    self._any_worker = {}  # strategy id -> compiled all-reduce of the flag

  @property
  def requested(self) -> bool:
    """This process received a signal (its own flag, not the cluster's decision)."""
    return self.received is not None

  def should_stop(self, strategy=None) -> bool:
    """True when this process or, under MultiWorkerMirroredStrategy, any worker received a
    signal. Every worker must call it at the same loop boundaries: with several workers it is a
    collective (an all-reduce of the flags)."""
    stop = self.requested
    if workers(strategy) > 1:
      stop = self._all_reduce(strategy, stop)
    if stop and self.reason is None:
      self.reason = self.received.name if self.received else 'a signal on another worker'
    return stop

  def _all_reduce(self, strategy, flag: bool) -> bool:
    import tensorflow as tf  # only needed with several workers

    key = id(strategy)
    if key not in self._any_worker:

      @tf.function
      def any_worker(flag):  # as train_step reduces its finite flags: SUM over every replica
        per_replica = strategy.run(lambda: tf.identity(flag))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

      self._any_worker[key] = any_worker
    return float(self._any_worker[key](tf.constant(1.0 if flag else 0.0)).numpy()) > 0

  def call(self, fn, *args, on_wait=None, **kwargs):
    """fn(*args, **kwargs), run in a worker thread while this (main) thread waits in short
    waits, so that signal handlers run during a long compiled call; re-raises fn's exception.
    `on_wait()`, when given, runs after each short wait (the runner's heartbeat line)."""
    if self._executor is None:
      return fn(*args, **kwargs)
    future = self._executor.submit(fn, *args, **kwargs)
    while True:
      try:
        return future.result(timeout=_POLL_SECONDS)
      except concurrent.futures.TimeoutError:
        if on_wait is not None:
          on_wait()

  def _handle(self, signum, frame):
    del frame
    if signum == signal.SIGINT and self.requested:  # a second Ctrl-C: stop now
      self._exit_now()
    self.received = signal.Signals(signum)
    logging.warning(
      'received %s: saving a checkpoint at the end of the current loop, then '
      'stopping (Ctrl-C again stops at once, without saving)',
      self.received.name,
    )

  def _exit_now(self):
    message = 'interrupted by a second SIGINT: exiting at once without saving; ' + (
      self.on_disk()
      if self.on_disk is not None
      else 'the newest checkpoint on disk is intact and the same command resumes from it'
    )
    logging.warning(message)
    logging.flush()
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    # Not sys.exit: the compiled call is still running in the worker thread, and interpreter
    # shutdown would wait for it (or tear TensorFlow down under it). os._exit skips atexit, so
    # the workdir lock is released here (a lock left behind blocks a restart on another host).
    workdir_lock.release_all()
    os._exit(EXIT_INTERRUPTED)

  def __enter__(self) -> Watcher:
    if threading.current_thread() is threading.main_thread():
      for s in self.signals:
        self._previous[s] = signal.signal(s, self._handle)
      logging.info(
        'SIGTERM or Ctrl-C saves a checkpoint at the end of the current loop; a '
        'second Ctrl-C stops at once'
      )
      # One long-lived thread: every compiled call runs on the same thread.
      self._executor = concurrent.futures.ThreadPoolExecutor(
        max_workers=1, thread_name_prefix='compiled-call'
      )
    return self

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous.clear()
    if self._executor is not None:
      self._executor.shutdown(wait=True)
      self._executor = None
    return False


def workers(strategy) -> int:
  """How many worker processes take part in `strategy` (1 without multi_worker)."""
  resolver = getattr(strategy, 'cluster_resolver', None)
  if resolver is None:
    return 1
  spec = resolver.cluster_spec().as_dict()
  return sum(len(tasks) for kind, tasks in spec.items() if kind in ('chief', 'worker'))
