"""Preemption: SIGTERM or SIGINT stops training at the next loop boundary with a checkpoint.

A scheduler's SIGTERM (or a Ctrl-C) only sets a flag; the trainer looks at it after each compiled
`steps_per_loop` call, saves a checkpoint and raises `Preempted`; the launcher prints where it
stopped and exits with code 0. Running the same command again resumes from that checkpoint. A
second SIGINT while the first is pending interrupts at once (Python's KeyboardInterrupt).

Single-process only: with several workers each one would need to agree on the step first (the
flag is not all-reduced here).
"""
from __future__ import annotations

import signal
import threading

from absl import logging

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preempted(Exception):
  """Training stopped on a signal after saving a checkpoint; run the same command to resume."""

  def __init__(self, signal_name: str, step: int, total: int, checkpoint: str):
    super().__init__(f'stopped by {signal_name} at step {step}/{total}; checkpoint saved to '
                     f'{checkpoint}; run the same command again to resume')
    self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint


class Watcher:
  """`with Watcher() as w:` ... `if w.requested: save and stop`. Handlers are restored on exit.
  Outside the main thread (where Python cannot install handlers) it watches nothing."""

  def __init__(self, signals=SIGNALS):
    self.signals = tuple(signals)
    self.received: signal.Signals | None = None
    self._previous = {}

  @property
  def requested(self) -> bool:
    return self.received is not None

  def _handle(self, signum, frame):
    del frame
    self.received = signal.Signals(signum)
    logging.warning('received %s: saving a checkpoint at the end of the current loop, then '
                    'stopping', self.received.name)
    if signum == signal.SIGINT:  # a second Ctrl-C interrupts at once
      signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT, signal.default_int_handler))

  def __enter__(self) -> 'Watcher':
    if threading.current_thread() is threading.main_thread():
      for s in self.signals:
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)
    self._previous.clear()
    return False
