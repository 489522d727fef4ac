"""Preemption across hosts: SIGTERM to one worker of a two-process MultiWorkerMirroredStrategy run
(127.0.0.1) makes both workers save at the same step and exit cleanly (code 0); the restart of
both resumes from that checkpoint and finishes with identical weights on both."""

import os

import numpy as np
import pytest

from test_distribute import run_workers


@pytest.mark.slow  # 4 TF processes on the 2 shared cores
def test_sigterm_to_one_worker_stops_all_at_the_same_step_and_resumes(tmp_path):
  workdir, first, second = tmp_path / 'work', tmp_path / 'first', tmp_path / 'second'
  first.mkdir()
  second.mkdir()
  # Worker 1 (not the chief) gets SIGTERM after step 4; checkpoints are due only at step 8.
  (chief, other), logs = run_workers(workdir, first, 8, '4')
  assert chief['preempted_at'] == other['preempted_at'] == 4
  assert other['reason'] == 'SIGTERM'
  assert chief['reason'] == 'a signal on another worker'
  assert 'received SIGTERM' in logs[1] and 'received SIGTERM' not in logs[0]
  assert chief['checkpoint'] == str(workdir / 'checkpoints' / 'ckpt-4')
  assert os.path.exists(workdir / 'checkpoints' / 'ckpt-4.index')  # the chief wrote it
  assert 'stopped by a signal on another worker at step 4/8' in chief['message']

  (chief, other), _ = run_workers(workdir, second, 8)
  assert (chief['start'], other['start']) == (4, 4)
  assert (chief['end'], other['end']) == (8, 8)
  for a, b in zip(chief['weights'], other['weights'], strict=True):
    np.testing.assert_array_equal(a, b)
  assert os.path.exists(workdir / 'checkpoints' / 'ckpt-8.index')
