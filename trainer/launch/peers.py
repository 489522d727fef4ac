"""A lost worker ends every other worker within a bound, with one line and exit code 3.

On its own, TensorFlow 2.21 aborts the survivor's collective with an UnavailableError only when
the coordination service's heartbeat times out (a worker died) or the connection resets (the
chief died), each a ~70-line traceback with exit code 1 (the delays: docs/guides/distribution.md,
"A lost worker"). Here:

  * `install(...)` registers an absl exception handler: an UnavailableError, AbortedError or
    DeadlineExceededError escaping training under multi_worker is printed as one line naming the
    lost worker and the newest checkpoint, and the process exits with code 3 (EXIT_PEER_LOST).
  * a watchdog thread connects to every other worker's port once a second; a worker seen up and
    then unreachable for `timeout` seconds (--worker_timeout, default 60) ends this process the
    same way, whatever TensorFlow is waiting for (a collective with no timeout, a rendezvous).

Ending the process writes nothing half (checkpoints and records are renamed into place), so the
same command resumes from the newest checkpoint named.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import socket
import sys
import threading
import time

from absl import app, logging


EXIT_PEER_LOST = 3
POLL_SECONDS = 1.0
_TASK = re.compile(r'/job:(?:worker|chief)/replica:\d+/task:(\d+)')


class Watch:
  """The other workers' reachability, seen from worker `index` of `addresses`."""

  def __init__(self, addresses: list[str], index: int, workdir: str | None, timeout: float):
    self.addresses, self.index, self.workdir, self.timeout = addresses, index, workdir, timeout
    self.seen_up: set[int] = set()
    self.down_since: dict[int, float] = {}
    self.done = False  # set at exit: a worker that finished first is not lost

  def lost(self) -> list[int]:
    """Workers seen up once and unreachable now."""
    return sorted(self.down_since)

  def tick(self, now: float) -> int | None:
    """One round of connections; the worker lost for `timeout` seconds, if any."""
    for i, address in enumerate(self.addresses):
      if i == self.index:
        continue
      if reachable(address):
        self.seen_up.add(i)
        self.down_since.pop(i, None)
      elif i in self.seen_up:
        self.down_since.setdefault(i, now)
    late = [i for i, t in self.down_since.items() if now - t >= self.timeout]
    return min(late) if late else None


def reachable(address: str, timeout: float = 2.0) -> bool:
  host, _, port = address.rpartition(':')
  try:
    with socket.create_connection((host.strip('[]'), int(port)), timeout=timeout):
      return True
  except OSError:
    return False


LAUNCHER_PID = 'MPT_LAUNCHER_PID'  # set by `--workers` (trainer/launch/supervisor.py)


def follow_launcher() -> None:
  """A worker of `--workers` dies with its launcher, however that dies (kill -9 included):
  Linux's parent-death signal, SIGKILL (nothing half-written: writes are atomic; the lock is
  taken over as stale). It sits in its own session, which a terminal's hang-up does not reach."""
  pid = os.environ.get(LAUNCHER_PID)
  if not pid or not sys.platform.startswith('linux'):
    return
  import ctypes

  ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
  if os.getppid() != int(pid):  # the launcher died before the signal was set
    os._exit(128 + signal.SIGKILL)


def install(addresses: list[str], index: int, workdir: str | None, timeout: float) -> Watch:
  """Starts the watchdog thread and the exception handler for worker `index`."""
  watch = Watch(addresses, index, workdir, timeout)
  app.install_exception_handler(_Handler(watch))
  # Registered after TensorFlow's exit handlers, so run before them: the workers' runtimes may
  # be slow to shut down after a run that ended well, and no peer is lost then.
  atexit.register(setattr, watch, 'done', True)
  threading.Thread(target=_run, args=(watch,), name='peer-watchdog', daemon=True).start()
  return watch


def _run(watch: Watch) -> None:
  while not watch.done:
    lost = watch.tick(time.monotonic())
    if lost is not None and not watch.done:
      stop(
        watch,
        lost,
        f'worker {lost} ({watch.addresses[lost]}) has been unreachable for '
        f'{watch.timeout:g} s (--worker_timeout)',
      )
    time.sleep(POLL_SECONDS)


class _Handler(app.ExceptionHandler):
  """absl calls it with the exception that ended main()."""

  def __init__(self, watch: Watch):
    self.watch = watch

  def wants(self, exc) -> bool:
    import tensorflow as tf

    return isinstance(
      exc, (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.DeadlineExceededError)
    )

  def handle(self, exc) -> None:
    named = [int(i) for i in _TASK.findall(str(exc)) if int(i) != self.watch.index]
    lost = next(iter(self.watch.lost() or named), None)
    first = next((l.strip() for l in str(exc).splitlines() if 'aborted by' in l), '')
    stop(self.watch, lost, f'the collective was aborted ({first or type(exc).__name__})')


def stop(watch: Watch, lost: int | None, why: str) -> None:
  """Prints the one line and ends this process with EXIT_PEER_LOST."""
  from trainer.distribute import strategy as distribute
  from trainer.run import checkpoint_files
  from trainer.run import lock as workdir_lock

  newest = None
  if watch.workdir:
    newest = next(iter(checkpoint_files.find(os.path.join(watch.workdir, 'checkpoints'))), None)
  who = f'worker {lost}' if lost is not None else 'another worker'
  print(
    f'error: worker {watch.index}: {who} was lost: {why}; stopping. The newest checkpoint is '
    f'{newest or "none (nothing saved yet)"}; run the same command on every worker to resume',
    file=sys.stderr,
    flush=True,
  )
  logging.flush()
  sys.stdout.flush()
  workdir_lock.release_all()  # os._exit skips atexit; a lock left behind would block the resume
  distribute.remove_all_scratch()  # and a non-chief's scratch folder would stay in the temp dir
  os._exit(EXIT_PEER_LOST)
