"""launch.py --workers' supervisor (trainer/launch/supervisor.py) names the lost worker even when
every worker ended between two of its polls (a killed chief's survivor exits at once, 'Socket
closed'), where the final line was missing."""

import signal
import sys

from trainer.launch import supervisor

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
