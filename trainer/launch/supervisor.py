"""N worker processes on this host from one command (`launch.py --workers=N`).

`run(commands)` starts one process per command, each in its own session (a terminal's Ctrl-C
reaches this process only), and passes on every line each prints, to the same stream, prefixed
with `[worker i] `. A first SIGINT or SIGTERM here goes to every worker as SIGTERM: each saves a
checkpoint at the same step (trainer/run/preemption.py) and exits with code 0; a second SIGINT
goes on as SIGINT: every worker stops at once, without saving (exit code 130).

A worker that ends with a non-zero code while others run is a lost worker: the others end on
their own within --worker_timeout (trainer/launch/peers.py); any still running `timeout` + 30 s
later are killed. Then one line names the lost worker and the run folder's newest checkpoint.
The exit code is the worst of the workers': a signal's death counts as 128 + the signal number
(the shell's convention), and the highest code wins.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

GRACE_SECONDS = 30.0  # past --worker_timeout, before a worker that did not end is killed


def shell_code(returncode: int) -> int:
  """Popen's code as a shell reports it: death by signal N is 128 + N."""
  return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
  if returncode < 0:
    return f'killed by {signal.Signals(-returncode).name}'
  return f'exited with code {returncode}'


class Supervisor:
  def __init__(self, commands: list[list[str]], env: dict, timeout: float):
    self.commands, self.env, self.timeout = commands, env, timeout
    self.procs: list[subprocess.Popen] = []
    self.signals = 0
    self.lost: tuple[int, int] | None = None  # (worker, returncode) of the first failure
    self.relays: list[threading.Thread] = []

  def start(self) -> None:
    for i, command in enumerate(self.commands):
      proc = subprocess.Popen(
        command,
        env=self.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # the terminal's Ctrl-C goes to us; we forward it once
      )
      self.procs.append(proc)
      for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
        relay = threading.Thread(target=_relay, args=(stream, out, f'[worker {i}] '), daemon=True)
        relay.start()
        self.relays.append(relay)

  def forward(self, signum, frame) -> None:
    """First signal: SIGTERM to every worker (save, then stop); second: SIGINT (stop now)."""
    del frame
    self.signals += 1
    sent = signal.SIGTERM if self.signals == 1 else signal.SIGINT
    print(
      f'[launcher] received {signal.Signals(signum).name}: sending {sent.name} to every worker',
      file=sys.stderr,
      flush=True,
    )
    for proc in self.procs:
      if proc.poll() is None:
        proc.send_signal(sent)

  def wait(self) -> list[int]:
    """Waits for every worker; kills the rest `timeout` + GRACE_SECONDS after a lost one."""
    deadline = None
    while any(p.poll() is None for p in self.procs):
      for i, proc in enumerate(self.procs):
        code = proc.poll()
        if code not in (None, 0) and self.lost is None and self.signals == 0:
          self.lost = (i, code)
          deadline = time.monotonic() + self.timeout + GRACE_SECONDS
          print(
            f'[launcher] worker {i} {describe(code)}; the others stop within '
            f'{self.timeout:g} s (--worker_timeout)',
            file=sys.stderr,
            flush=True,
          )
      if deadline is not None and time.monotonic() > deadline:
        for proc in self.procs:
          if proc.poll() is None:
            proc.kill()
      time.sleep(0.2)
    codes = [p.wait() for p in self.procs]
    if self.lost is None and self.signals == 0:  # every worker ended between two polls
      self.lost = first_failure(codes)
    return codes


def first_failure(codes: list[int]) -> tuple[int, int] | None:
  """(worker, code) of the worker that failed first, judged from the codes alone (all ended
  between two polls: a killed chief's survivor exits at once, 'Socket closed'): one
  killed by a signal before one that exited by itself (a survivor's exit 3 reports the loss of
  another); None when every code is 0."""
  failed = [(i, c) for i, c in enumerate(codes) if c != 0]
  return min(failed, key=lambda f: (f[1] >= 0, f[0]), default=None)


def _relay(stream, out, prefix: str) -> None:
  for raw in iter(stream.readline, b''):
    line = raw.decode(errors='replace')
    out.write(prefix + line if line.endswith('\n') else prefix + line + '\n')
    out.flush()
  stream.close()


def run(commands: list[list[str]], env: dict, timeout: float, newest_checkpoint) -> int:
  """Runs the workers to the end; returns the exit code for this process (module docstring).
  `newest_checkpoint()` names the run folder's newest checkpoint (or None) at the end."""
  sup = Supervisor(commands, env, timeout)
  previous = {s: signal.signal(s, sup.forward) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    sup.start()
    pids = ', '.join(f'worker {i} pid {p.pid}' for i, p in enumerate(sup.procs))
    print(f'[launcher] started {pids}', flush=True)
    codes = sup.wait()
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  for relay in sup.relays:  # the workers' last lines before ours
    relay.join(timeout=5)
  if sup.lost is not None and sup.lost[1] not in (2, 130):  # 2: bad input, said by each worker
    worker, code = sup.lost
    print(
      f'error: worker {worker} was lost ({describe(code)}); every worker stopped. The newest '
      f'checkpoint is {newest_checkpoint() or "none (nothing saved yet)"}; run the same '
      'command to resume',
      file=sys.stderr,
      flush=True,
    )
  return max(shell_code(c) for c in codes)


def child_env() -> dict:
  """This process's environment for a worker: TF_CONFIG comes from --cluster instead."""
  env = {k: v for k, v in os.environ.items() if k != 'TF_CONFIG'}
  return {**env, 'PYTHONUNBUFFERED': '1'}  # each line passed on as it is printed
