"""launch.py --workers' supervisor (trainer/launch/supervisor.py) names the lost worker even when
every worker ended between two of its polls (a killed chief's survivor exits at once, 'Socket
closed'), where the final line was missing."""

import os
import signal
import sys
import tempfile
import threading
import time

from trainer.launch import supervisor
from trainer.run.preemption import EXIT_PREEMPTED

KILLED = 'import os, signal; os.kill(os.getpid(), signal.SIGKILL)'
SURVIVOR = 'import sys, time; time.sleep(0.05); sys.exit(3)'  # peers.py's EXIT_PEER_LOST


def test_the_lost_worker_is_named_when_all_end_between_two_polls(capsys):
  commands = [[sys.executable, '-c', KILLED], [sys.executable, '-c', SURVIVOR]]
  code = supervisor.run(commands, env={}, timeout=5, newest_checkpoint=lambda: None)
  assert code == 128 + signal.SIGKILL
  assert 'error: worker 0 was lost (killed by SIGKILL); every worker stopped' in (
    capsys.readouterr().err
  )


def test_first_failure_prefers_a_signal_death_then_the_lowest_worker():
  assert supervisor.first_failure([3, -9]) == (1, -9)
  assert supervisor.first_failure([3, 3]) == (0, 3)
  assert supervisor.first_failure([0, 0]) is None


def test_first_failure_and_the_lost_worker_leave_out_a_preempted_one():
  assert supervisor.first_failure([75, 75]) is None and supervisor.first_failure([75, 3]) == (1, 3)


class Lines:
  """Log's output, as (stream, text) with the stream named."""

  def __init__(self):
    self.out: list[tuple[str, str]] = []

  def __call__(self, stream, text):
    self.out.append(('stdout' if stream is sys.stdout else 'stderr', text.rstrip('\n')))


def absl(level, text, pid):
  return f'{level}1128 23:41:0{pid}.123456 {pid}000 runner.py:12] {text}\n'


def test_the_log_shows_worker_0s_progress_and_each_other_line_once_with_its_workers():
  lines = Lines()
  log = supervisor.Log(3, lines)
  for w in range(3):  # every worker logs its progress (absl INFO on stderr) and prints results
    log.add(w, absl('I', 'step 10/60 (17%) | loss 2.3', w), True, 0.0)
    log.add(w, 'accuracy: 0.9000\n', False, 0.0)
  for w in range(3):  # the same warning, with each worker's own absl time and thread
    log.add(w, absl('W', 'skipped step 33 (non-finite gradients)', w), True, 1.0)
  log.add(1, 'error: worker 1: worker 2 was lost\n', True, 2.0)
  log.add(0, 'error: worker 0: worker 2 was lost\n', True, 2.0)
  assert lines.out == [
    ('stderr', '[worker 0] ' + absl('I', 'step 10/60 (17%) | loss 2.3', 0).rstrip()),
    ('stdout', '[worker 0] accuracy: 0.9000'),
    ('stderr', '[workers 0-2] ' + absl('W', 'skipped step 33 (non-finite gradients)', 0).rstrip()),
  ]
  del lines.out[:]
  log.flush(2.0 + supervisor.HOLD_SECONDS - 0.1)
  assert lines.out == []  # held for worker 0's copy, then shown with those seen
  log.end(2, 3.0)  # worker 2 ends without printing it: only worker 0's copy is awaited
  log.flush(2.0 + supervisor.HOLD_SECONDS)
  assert lines.out == [
    ('stderr', '[worker 1] error: worker 1: worker 2 was lost'),
    ('stderr', '[worker 0] error: worker 0: worker 2 was lost'),
  ]
  log.add(2, 'error: worker 1: worker 2 was lost\n', True, 9.0)  # a copy after it was shown
  log.flush(100.0, final=True)
  assert len(lines.out) == 2


def test_a_line_all_workers_print_as_they_end_is_one_line():
  lines = Lines()
  log = supervisor.Log(3, lines)
  log.add(0, 'error: config.data.dir=/x: no such folder\n', True, 0.0)
  log.add(2, 'error: config.data.dir=/x: no such folder\n', True, 0.1)
  assert lines.out == []
  log.end(1, 0.2)  # worker 1 died without it
  assert lines.out == [('stderr', '[workers 0,2] error: config.data.dir=/x: no such folder')]


def test_the_closing_line_says_how_the_workers_ended_and_where_the_run_stands():
  assert supervisor.closing([0, 0], 'w/checkpoints/ckpt-60') == (
    '[launcher] 2 workers ended: workers 0-1 finished; exit status 0; the final checkpoint is '
    'w/checkpoints/ckpt-60'
  )
  assert supervisor.closing([75, 75, 75], 'w/checkpoints/ckpt-30') == (
    '[launcher] 3 workers ended: workers 0-2 stopped by a signal with a checkpoint saved (exit '
    '75, preempted); exit status 75; the newest checkpoint is w/checkpoints/ckpt-30: the same '
    'command resumes from it'
  )
  assert supervisor.closing([3, -9], None) == (
    '[launcher] 2 workers ended: worker 0 exited with code 3; worker 1 killed by SIGKILL; exit '
    'status 137; no checkpoint is on disk'
  )


def test_ctrl_c_to_the_launcher_is_sigterm_to_every_worker(tmp_path, capsys):
  """Each stand-in worker exits with the preempted status on SIGTERM, as a worker that saved."""
  worker = (
    'import os, signal, sys, time; '
    'signal.signal(signal.SIGTERM, lambda *a: sys.exit(75)); '
    'open(sys.argv[1], "w").close(); time.sleep(60)'
  )
  ready = [tmp_path / f'ready{i}' for i in range(2)]

  def interrupt():
    while not all(r.exists() for r in ready):
      time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGINT)

  threading.Thread(target=interrupt, daemon=True).start()
  commands = [[sys.executable, '-c', worker, str(r)] for r in ready]
  code = supervisor.run(commands, env={}, timeout=5, newest_checkpoint=lambda: 'w/ckpt-20')
  err = capsys.readouterr().err
  assert code == EXIT_PREEMPTED, err
  assert '[launcher] received SIGINT: sending SIGTERM to every worker' in err
  assert 'was lost' not in err  # a preempted worker is not a lost one
  assert err.splitlines()[-1].startswith('[launcher] 2 workers ended: workers 0-1 stopped by')


TRAINING = 'print("I1128 23:41:00.123456 1 runner.py:300] training T: 60 steps", file=sys.stderr)'


def worker(*statements: str) -> list[str]:
  return [sys.executable, '-c', '; '.join(['import os, signal, sys, time', *statements])]


def test_a_worker_ending_before_training_ends_the_others_at_once_with_its_status(capsys):
  """A taken port or a bad input on worker 1: worker 0 waited in the rendezvous until the
  launcher killed it 50 s later, and the launcher exited 137 with no line."""
  commands = [
    worker('time.sleep(60)'),  # waits for worker 1, as in the rendezvous
    worker(
      'print("error: --task_index=1: port 5 of 127.0.0.1:5 is in use", file=sys.stderr)',
      'sys.exit(2)',
    ),
  ]
  start = time.monotonic()
  code = supervisor.run(commands, env={}, timeout=60, newest_checkpoint=lambda: None)
  assert time.monotonic() - start < 10
  err = capsys.readouterr().err
  assert code == 2, err
  assert [l for l in err.splitlines() if 'error: ' in l] == [
    '[worker 1] error: --task_index=1: port 5 of 127.0.0.1:5 is in use'
  ]
  assert err.splitlines()[-1] == (
    '[launcher] 2 workers ended: worker 0 stopped by the launcher; worker 1 exited with code 2; '
    'exit status 2; no checkpoint is on disk'
  )


def test_a_hung_worker_is_named_and_ended_not_the_one_that_noticed(capsys):
  """Worker 1 stopped (SIGSTOP): worker 0 notices and exits 3 naming it; the launcher named
  worker 0, and killed worker 1 only --worker_timeout + 30 s later."""
  commands = [
    worker(
      TRAINING,
      'time.sleep(0.5)',
      'print("error: worker 0: worker 1 was lost: the collective was aborted", file=sys.stderr)',
      'sys.exit(3)',
    ),
    worker(TRAINING, 'os.kill(os.getpid(), signal.SIGSTOP)'),
  ]
  start = time.monotonic()
  code = supervisor.run(commands, env={}, timeout=60, newest_checkpoint=lambda: 'w/ckpt-20')
  assert time.monotonic() - start < 10
  err = capsys.readouterr().err
  assert code == 128 + signal.SIGKILL, err
  assert (
    'error: worker 1 was lost (hung); every worker stopped. The newest checkpoint is w/ckpt-20'
    in err
  )
  assert err.splitlines()[-1].startswith(
    '[launcher] 2 workers ended: worker 0 exited with code 3; worker 1 stopped by the launcher;'
  )


def test_every_lost_worker_is_named(capsys):
  commands = [worker(TRAINING, 'time.sleep(0.5)', KILLED) for _ in range(2)] + [
    worker(TRAINING, 'time.sleep(1)', 'sys.exit(3)')
  ]
  supervisor.run(commands, env={}, timeout=60, newest_checkpoint=lambda: None)
  assert (
    'error: workers 0-1 were lost (worker 0 killed by SIGKILL, worker 1 killed by SIGKILL)'
    in (capsys.readouterr().err)
  )


def test_an_evaluator_side_car_is_shown_by_name_and_never_a_lost_worker(capsys):
  progress = (
    'print("I1128 23:41:00.123456 1 lifecycle.py:1] evaluator: ckpt-10 (step 10)", file=sys.stderr)'
  )
  commands = [worker(TRAINING, 'time.sleep(0.5)') for _ in range(2)]
  commands.append(worker(progress, 'sys.exit(1)'))  # a failed side-car does not end the run
  code = supervisor.run(commands, {}, 60, lambda: 'w/ckpt-60', sidecar=True)
  captured = capsys.readouterr()
  assert code == 1 and 'was lost' not in captured.err, captured.err
  assert '[evaluator] I1128' in captured.err and 'evaluator: ckpt-10' in captured.err
  assert captured.err.splitlines()[-1] == (
    '[launcher] 2 workers and the evaluator ended: workers 0-1 finished; evaluator exited with '
    'code 1; exit status 1; the newest checkpoint is w/ckpt-60: the same command resumes from it'
  )


def test_a_side_car_waiting_for_a_checkpoint_that_will_not_come_is_ended(capsys):
  commands = [worker(TRAINING, 'time.sleep(0.5)', 'sys.exit(75)') for _ in range(2)]
  commands.append(worker('time.sleep(60)'))  # waits for the last step's checkpoint
  start = time.monotonic()
  code = supervisor.run(commands, {}, 60, lambda: 'w/ckpt-30', sidecar=True)
  assert time.monotonic() - start < 10 and code == EXIT_PREEMPTED
  assert 'evaluator stopped by the launcher' in capsys.readouterr().err.splitlines()[-1]


def test_a_killed_workers_scratch_folder_is_removed(tmp_path, monkeypatch):
  """Killed while saving, a non-chief worker leaves its mpt-worker<i>-<pid>-* folder behind."""
  monkeypatch.setenv('TMPDIR', str(tmp_path))
  tempfile.tempdir = None  # read TMPDIR again
  try:
    saving = (
      'import os, tempfile; os.makedirs(os.path.join(tempfile.gettempdir(), '
      'f"mpt-worker1-{os.getpid()}-x", "ckpt-10_temp"))'
    )
    other = str(tmp_path / 'mpt-worker1-1-y')  # another process's: kept
    os.makedirs(other)
    commands = [worker(TRAINING, 'time.sleep(0.5)'), worker(saving, KILLED)]
    supervisor.run(commands, {'TMPDIR': str(tmp_path)}, 60, lambda: None)
  finally:
    tempfile.tempdir = None
  assert os.listdir(tmp_path) == ['mpt-worker1-1-y']
