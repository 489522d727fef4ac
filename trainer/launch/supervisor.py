"""N worker processes on this host from one command (`launch.py --workers=N`).

`run(commands)` starts one process per command, each in its own session (a terminal's Ctrl-C
reaches this process only), and shows one log (`Log`): every line of worker 0, prefixed
`[worker 0] `, and every other line any worker prints that is not routine (not its stdout nor an
absl INFO line: warnings, errors, tracebacks, where it stopped), each distinct line once with the
workers that printed it (`[workers 0-2] error: ...`). A first SIGINT or SIGTERM here goes to
every worker as SIGTERM: each saves a checkpoint at the same step (trainer/run/preemption.py)
and exits with EXIT_PREEMPTED; a second SIGINT goes on as SIGINT: every worker stops at once,
without saving (exit code 130).

A worker that ends with a code other than 0 and EXIT_PREEMPTED while others run is a lost worker:
the others end on their own within --worker_timeout (trainer/launch/peers.py); any still running
`timeout` + 30 s later are killed. Then one line names the lost worker and the run folder's newest
checkpoint. The exit code is the worst of the workers': a signal's death counts as 128 + the
signal number (the shell's convention), and the highest code wins. The last line is the
launcher's own: how the workers ended and the checkpoint the same command resumes from.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from trainer.distribute.tf_config import SCRATCH_GLOB
from trainer.launch.peers import LAUNCHER_PID
from trainer.run.preemption import EXIT_PREEMPTED

GRACE_SECONDS = 30.0  # past --worker_timeout, before a worker that did not end is killed
# A line some workers printed waits this long for the others' copies before it is shown with
# the workers seen so far (a later copy is then dropped): lines that all print come together.
HOLD_SECONDS = 5.0
# absl's prefix ('W1128 23:41:00.123456 12345 file.py:12] '): its time and thread id differ
# between workers printing the same line.
_ABSL = re.compile(r'^([IWEF])\d{4} [\d:.]+\s+\d+ [^\]]+\] ')
_TRAINING = re.compile(r'training \S+: \d+ steps')  # trainer/run/runner.py's first line
_REPORTED = re.compile(r'^error: worker \d+: worker (\d+) was lost')  # trainer/launch/peers.py


def shell_code(returncode: int) -> int:
  """Popen's code as a shell reports it: death by signal N is 128 + N."""
  return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
  if returncode < 0:
    return f'killed by {signal.Signals(-returncode).name}'
  if returncode == 0:
    return 'finished'
  if returncode == EXIT_PREEMPTED:
    return f'stopped by a signal with a checkpoint saved (exit {EXIT_PREEMPTED}, preempted)'
  return f'exited with code {returncode}'


def span(workers, sidecar: int | None = None) -> str:
  """[0, 1, 2] -> 'workers 0-2'; [1] -> 'worker 1'; [0, 2] -> 'workers 0,2'; the `sidecar`
  process (--evaluator) is 'evaluator'."""
  if sidecar in workers:
    rest = [w for w in workers if w != sidecar]
    return f'{span(rest)}, evaluator' if rest else 'evaluator'
  ws = sorted(workers)
  if len(ws) == 1:
    return f'worker {ws[0]}'
  if ws == list(range(ws[0], ws[-1] + 1)):
    return f'workers {ws[0]}-{ws[-1]}'
  return 'workers ' + ','.join(map(str, ws))


class Log:
  """The one log of N workers (module docstring). `add` takes each line as it comes; `flush`
  shows the held lines that are due; `write` is where lines go (stream, text)."""

  def __init__(self, workers: int, write=None, sidecar: int | None = None):
    self.workers, self.sidecar = workers, sidecar
    self.write = write or _write
    self.lock = threading.Lock()
    self.held: dict[str, list] = {}  # key -> [first line, workers, first seen]; in arrival order
    self.shown: set[str] = set()
    self.ended: set[int] = set()
    self.started = False  # a worker logged its `training ...` line
    self.reported: set[int] = set()  # workers a survivor named lost (trainer/launch/peers.py)

  def add(self, worker: int, line: str, stderr: bool, now: float) -> None:
    prefix = _ABSL.match(line)
    routine = not stderr or (prefix is not None and prefix.group(1) == 'I')
    text = line[prefix.end() :] if prefix else line
    with self.lock:
      self.started = self.started or bool(_TRAINING.match(text))
      self.reported.update(int(w) for w in _REPORTED.findall(text))
      if routine:
        if worker in (0, self.sidecar):
          name = 'evaluator' if worker == self.sidecar else 'worker 0'
          self.write(sys.stderr if stderr else sys.stdout, f'[{name}] {line}')
        return
      if text in self.shown:
        return  # a late copy of a line shown already
      self.held.setdefault(text, [line, set(), now])[1].add(worker)
    self.flush(now)

  def named_lost(self) -> set[int]:
    with self.lock:  # a copy: the relays add to it
      return set(self.reported)

  def end(self, worker: int, now: float) -> None:
    with self.lock:
      self.ended.add(worker)
    self.flush(now)

  def flush(self, now: float, final: bool = False) -> None:
    """Shows, in the order first seen, each held line every worker printed or has ended without
    printing, or held HOLD_SECONDS; stops at the first that is not due, to keep the order."""
    with self.lock:
      for key, (line, workers, since) in list(self.held.items()):
        due = final or now - since >= HOLD_SECONDS or len(workers | self.ended) == self.workers
        if not due:
          break
        del self.held[key]
        self.shown.add(key)
        self.write(sys.stderr, f'[{span(workers, self.sidecar)}] {line}')


def _write(out, text: str) -> None:
  out.write(text if text.endswith('\n') else text + '\n')
  out.flush()


class Supervisor:
  """`sidecar`: the last command is the evaluator (--evaluator): its end is no worker's loss."""

  def __init__(self, commands: list[list[str]], env: dict, timeout: float, sidecar: bool = False):
    self.commands, self.env, self.timeout = commands, env, timeout
    self.sidecar = len(commands) - 1 if sidecar else None
    self.procs: list[subprocess.Popen] = []
    self.signals = 0
    self.lost: tuple[int, int] | None = None  # (worker, returncode) of the first failure
    self.stopped: set[int] = set()  # workers this launcher killed
    self.early: int | None = None  # the status of a worker that ended before training began
    self.relays: list[threading.Thread] = []
    self.log = Log(len(commands), sidecar=self.sidecar)

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
      for stream, stderr in ((proc.stdout, False), (proc.stderr, True)):
        relay = threading.Thread(target=self._relay, args=(stream, i, stderr), daemon=True)
        relay.start()
        self.relays.append(relay)

  def _relay(self, stream, worker: int, stderr: bool) -> None:
    for raw in iter(stream.readline, b''):
      self.log.add(worker, raw.decode(errors='replace'), stderr, time.monotonic())
    stream.close()
    if stderr:  # its last line is in: a line it did not print waits no more for it
      self.log.end(worker, time.monotonic())

  def forward(self, signum, frame) -> None:
    """First signal: SIGTERM to every worker (save, then stop); second: SIGINT (stop now)."""
    del frame
    self.signals += 1
    sent = signal.SIGTERM if self.signals == 1 else signal.SIGINT
    _write(
      sys.stderr,
      f'[launcher] received {signal.Signals(signum).name}: sending {sent.name} to every worker',
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
        if i == self.sidecar or self.lost is not None or self.signals:
          continue
        if code not in (None, 0, EXIT_PREEMPTED):
          self.lost = (i, code)
          deadline = time.monotonic() + self.timeout + GRACE_SECONDS
          if not self.log.started:  # the others wait in the rendezvous for it: end them now
            self.early, deadline = shell_code(code), time.monotonic()
          else:
            _write(
              sys.stderr,
              f'[launcher] worker {i} {describe(code)}; the others stop within '
              f'{self.timeout:g} s (--worker_timeout)',
            )
      ended = [p.poll() for i, p in enumerate(self.procs) if i != self.sidecar]
      if self.sidecar is not None and None not in ended and any(ended):
        self._kill(self.sidecar)  # the run's last checkpoint will not come: no need to wait
      for w in self.log.named_lost():  # named lost by a survivor and still here: hung
        self._kill(w)
      if deadline is not None and time.monotonic() >= deadline:
        for w in range(len(self.procs)):
          self._kill(w)
      self.log.flush(time.monotonic())
      time.sleep(0.2)
    codes = [p.wait() for p in self.procs]
    if self.lost is None and self.signals == 0:  # every worker ended between two polls
      self.lost = first_failure(codes[: self.sidecar])
    return codes

  def _kill(self, worker: int) -> None:
    if self.procs[worker].poll() is None:
      self.procs[worker].kill()
      self.stopped.add(worker)

  def lost_workers(self, codes: list[int]) -> list[int]:
    """The workers really lost: those a survivor named (a hung one included) and those killed by
    a signal this launcher did not send; else the first failure."""
    died = {i for i, c in enumerate(codes) if c < 0 and i not in self.stopped | {self.sidecar}}
    lost = sorted(self.log.named_lost() | died)
    return lost or ([self.lost[0]] if self.lost else [])


def first_failure(codes: list[int]) -> tuple[int, int] | None:
  """(worker, code) of the worker that failed first, judged from the codes alone (all ended
  between two polls: a killed chief's survivor exits at once, 'Socket closed'): one
  killed by a signal before one that exited by itself (a survivor's exit 3 reports the loss of
  another); None when every code is 0 or EXIT_PREEMPTED."""
  failed = [(i, c) for i, c in enumerate(codes) if c not in (0, EXIT_PREEMPTED)]
  return min(failed, key=lambda f: (f[1] >= 0, f[0]), default=None)


def closing(
  codes: list[int],
  newest: str | None,
  stopped=(),
  status: int | None = None,
  sidecar: int | None = None,
) -> str:
  """The launcher's last line: how many workers ended and how (`stopped`: killed by this
  launcher), its exit `status` (default the worst code), and where the run stands."""
  how: dict[str, list[int]] = {}
  for i, code in enumerate(codes):
    how.setdefault('stopped by the launcher' if i in stopped else describe(code), []).append(i)
  ended = '; '.join(f'{span(ws, sidecar)} {what}' for what, ws in how.items())
  workers = len(codes) - (sidecar is not None)
  count = f'{workers} workers' + (' and the evaluator' if sidecar is not None else '')
  if not newest:
    where = 'no checkpoint is on disk'
  elif all(c == 0 for c in codes):
    where = f'the final checkpoint is {newest}'
  else:
    where = f'the newest checkpoint is {newest}: the same command resumes from it'
  status = max(shell_code(c) for c in codes) if status is None else status
  return f'[launcher] {count} ended: {ended}; exit status {status}; {where}'


def run(
  commands: list[list[str]], env: dict, timeout: float, newest_checkpoint, sidecar: bool = False
) -> int:
  """Runs the workers to the end; returns the exit code for this process (module docstring).
  `newest_checkpoint()` names the run folder's newest checkpoint (or None) at the end;
  `sidecar`: the last command is the evaluator."""
  sup = Supervisor(commands, env, timeout, sidecar)
  previous = {s: signal.signal(s, sup.forward) for s in (signal.SIGINT, signal.SIGTERM)}
  try:
    sup.start()
    pids = ', '.join(f'{span([i], sup.sidecar)} pid {p.pid}' for i, p in enumerate(sup.procs))
    print(f'[launcher] started {pids}', flush=True)
    codes = sup.wait()
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
  for relay in sup.relays:  # the workers' last lines before ours
    relay.join(timeout=5)
  sup.log.flush(time.monotonic(), final=True)
  for proc, code in zip(sup.procs, codes):
    if code < 0:  # killed: its scratch folder, if it was saving, is left in the temp dir
      pattern = SCRATCH_GLOB.format(pid=proc.pid)
      for path in glob.glob(os.path.join(tempfile.gettempdir(), pattern)):
        shutil.rmtree(path, ignore_errors=True)
  newest = newest_checkpoint()
  counted = [c for i, c in enumerate(codes) if i != sup.sidecar or i not in sup.stopped]
  status = sup.early if sup.early is not None else max(shell_code(c) for c in counted)
  if sup.lost is not None and sup.lost[1] not in (2, 130):  # 2: bad input, said by the workers
    lost = sup.lost_workers(codes)
    how = [('hung' if w in sup.stopped else describe(codes[w])) for w in lost]
    how = how if len(lost) == 1 else [f'worker {w} {h}' for w, h in zip(lost, how)]
    _write(
      sys.stderr,
      f'error: {span(lost)} {"was" if len(lost) == 1 else "were"} lost ({", ".join(how)}); every '
      f'worker stopped. The newest checkpoint is {newest or "none (nothing saved yet)"}; run the '
      'same command to resume',
    )
  _write(sys.stderr, closing(codes, newest, sup.stopped, status, sup.sidecar))
  return status


def child_env() -> dict:
  """This process's environment for a worker: TF_CONFIG comes from --cluster instead."""
  env = {k: v for k, v in os.environ.items() if k != 'TF_CONFIG'}
  # Each line passed on as it is printed; each worker dies with this process (peers.py).
  return {**env, 'PYTHONUNBUFFERED': '1', LAUNCHER_PID: str(os.getpid())}
