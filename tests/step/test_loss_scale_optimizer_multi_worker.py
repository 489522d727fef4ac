"""trainer.mixed_precision.LossScaleOptimizer under MultiWorkerMirroredStrategy (issue 36):
two local worker processes on loopback ports (tests/lso_multi_worker_run.py), every gradient of
worker 1 only inf. On both workers, `fit` and a strategy.run loop skip every step: the weights
stay finite, identical to the initial ones and to the other worker's."""

import json
import os
import sys

import pytest
from conftest import ROOT, once_per_session
from local_cluster import run_two_workers

# Slow: two TF processes and a cluster set-up; the loop case alone needs the same two process
# starts, so there is no quick subset.
pytestmark = pytest.mark.slow


def _run_workers(out):
  run_two_workers(
    [sys.executable, os.path.join(ROOT, 'tests', 'lso_multi_worker_run.py'), str(out)]
  )


@pytest.fixture(scope='module')
def workers(tmp_path_factory):
  """The two workers' results, once per session (conftest.once_per_session): worksteal may hand
  this module's tests to several xdist workers, each of which would start its own cluster."""
  out = once_per_session(tmp_path_factory, 'lso_multi_worker', _run_workers)
  found = [json.loads((out / f'worker{i}.json').read_text()) for i in range(2)]
  assert [w['replicas'] for w in found] == [2, 2]
  return found


@pytest.mark.parametrize('case', ['fit', 'loop'])
def test_inf_on_worker_1_only_skips_every_step_on_both_workers(workers, case):
  first, second = (w[case] for w in workers)
  for run in (first, second):
    assert run['finite'] and run['unchanged']
    assert run['iterations'] == 0 and run['skipped'] == 3
    assert run['scale'] == 2.0**15 / 2**3  # three steps, three back-offs
  assert first['weights'] == second['weights']


def test_fit_history_counts_the_skips_on_both_workers(workers):
  for worker in workers:
    history = worker['fit']['history']
    assert history['skipped_steps'] == [3.0]  # LossScaleMonitor -> History
    assert history['loss_scale'] == [2.0**12]
