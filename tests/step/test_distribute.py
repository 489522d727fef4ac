"""Distribution: mirrored vs one device, the all-replica finite check, eval coverage, jit under
mirrored (one subprocess with the CPU split into 2 logical devices, tests/distribute_runs.py);
multi_worker with two local processes; the TPU rules as far as a CPU allows."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, once_per_session
from local_cluster import ENV, run_two_workers

DATA = os.path.join(ROOT, '..', 'shared', 'data', 'mnist')
# float32, 3 SGD steps: only the order of the two half-batch sums differs (measured ~3e-8).
# A gradient summed twice, averaged instead of summed, or clipped by a per-replica norm moves
# the weights by ~1e-2.
ATOL = 1e-6


def _run_two_replicas(out):
  proc = subprocess.run(
    [sys.executable, os.path.join(ROOT, 'tests', 'distribute_runs.py'), str(out)],
    env=ENV,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.fixture(scope='module')
def two_replicas(tmp_path_factory):
  out = once_per_session(tmp_path_factory, 'distribute_runs', _run_two_replicas)
  with open(out / 'results.json') as f:
    results = json.load(f)
  arrays = dict(np.load(out / 'arrays.npz'))
  return results, arrays


def _weights(arrays, prefix):
  n = len([k for k in arrays if k.startswith(prefix + '/')])
  assert n > 0, prefix
  return [arrays[f'{prefix}/{i}'] for i in range(n)]


def _max_diff(a, b):
  return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize('clip', ['0.0', '0.05'])
def test_mirrored_matches_one_device(two_replicas, clip):
  results, arrays = two_replicas
  assert results['replicas'] == 2
  one = _weights(arrays, f'clip{clip}/one')
  r0 = _weights(arrays, f'clip{clip}/replica0')
  r1 = _weights(arrays, f'clip{clip}/replica1')
  assert _max_diff(r0, r1) == 0.0  # replicas bit-identical
  assert _max_diff(one, r0) < ATOL
  assert results[f'clip{clip}/skipped'] == 0


def test_clipping_is_active_in_the_comparison(two_replicas):
  # Otherwise the clipped comparison would not test the norm of the summed gradient.
  _, arrays = two_replicas
  assert _max_diff(_weights(arrays, 'clip0.0/one'), _weights(arrays, 'clip0.05/one')) > 100 * ATOL


def test_jit_compile_under_mirrored(two_replicas):
  _, arrays = two_replicas
  jit0, jit1 = _weights(arrays, 'jit/replica0'), _weights(arrays, 'jit/replica1')
  assert _max_diff(jit0, jit1) == 0.0
  assert _max_diff(jit0, _weights(arrays, 'clip0.0/replica0')) < ATOL


@pytest.mark.parametrize('bad', [1, 0])
def test_inf_on_one_replica_skips_everywhere(two_replicas, bad):
  results, arrays = two_replicas
  assert results[f'inject{bad}/finite_per_replica'] == [bad != 0, bad != 1]  # only `bad` gets inf
  before = [_weights(arrays, f'inject{bad}/before/replica{r}') for r in range(2)]
  after = [_weights(arrays, f'inject{bad}/after/replica{r}') for r in range(2)]
  for r in range(2):  # weights and every optimizer variable (Adam m, v, iterations) unchanged
    for b, a in zip(before[r], after[r], strict=True):
      np.testing.assert_array_equal(a, b)
  assert _max_diff(after[0], after[1]) == 0.0
  assert results[f'inject{bad}/scale_before'] == [1024.0, 1024.0]
  assert results[f'inject{bad}/scale_after'] == [512.0, 512.0]  # backed off once, everywhere
  assert results[f'inject{bad}/skipped'] == 1
  assert results[f'inject{bad}/global_step'] == 2
  # The next (finite) step applies again.
  assert results[f'inject{bad}/skipped_after_next'] == 1
  assert results[f'inject{bad}/changed_after_next']


def test_eval_covers_test_set_once_under_mirrored(two_replicas):
  results, _ = two_replicas
  # The 2000 test images of tests/distribute_runs.py: 62 batches of 32, then 16 split 8 + 8.
  assert results['eval/mirrored_count'] == 2000.0
  assert results['eval/one_count'] == 2000.0
  one, mirrored = results['eval/one'], results['eval/mirrored']
  assert mirrored['accuracy'] == pytest.approx(one['accuracy'], abs=1e-6)
  assert mirrored['loss'] == pytest.approx(one['loss'], rel=1e-5)


def test_eval_auc_under_mirrored_equals_one_device(two_replicas):
  results, _ = two_replicas
  assert 0.5 < results['auc/one'] < 1.0
  assert results['auc/mirrored'] == pytest.approx(results['auc/one'], abs=1e-6)
  assert 0.5 < results['auc/mirrored_train'] <= 1.0


def test_skip_on_one_replica_leaves_batchnorm_statistics_bit_identical(tmp_path):
  proc = subprocess.run(
    [
      sys.executable,
      os.path.join(ROOT, 'tests', 'distribute_runs.py'),
      '--batchnorm',
      str(tmp_path),
    ],
    env=ENV,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  results = json.loads((tmp_path / 'results.json').read_text())
  assert results['bn/skipped'] == 1
  assert results['bn/identical_on_skip']
  assert results['bn/moved_after']  # the comparison can fail: an applied step moves them


def test_batch_not_divisible_names_both_numbers(two_replicas):
  results, _ = two_replicas
  message = results['error/odd_batch']
  assert message.startswith('ConfigError: config.train.batch_size=33 ')
  assert '2 replicas' in message


def test_unknown_device_is_named(two_replicas):
  message = two_replicas[0]['error/no_device']
  assert message.startswith("ConfigError: config.distribute.devices='CPU:0,GPU:3'")
  assert "'GPU:3'" in message and 'CPU:1' in message


def test_a_cpu_split_after_tensorflow_started_is_one_line(two_replicas):
  message = two_replicas[0]['error/split_late']
  assert message.startswith(
    "ConfigError: config.distribute.devices='CPU:0,CPU:3': splitting the "
    'CPU into 4 logical devices needs TensorFlow not to have started'
  )


def test_launch_splits_the_cpu_into_two_replicas_that_skip_together(tmp_path):
  """docs/guides/distribution.md's command without GPUs: CPU:0,CPU:1 gives two replicas; a
  non-finite gradient injected on replica 1 at step 12 is one skipped step, and training goes on."""
  proc = subprocess.run(
    [
      sys.executable,
      'launch.py',
      '--config=configs/mnist.py',
      f'--config.data.dir={DATA}',
      '--config.distribute.strategy=mirrored',
      '--config.distribute.devices=CPU:0,CPU:1',
      '--config.debug.inject_nonfinite_steps=12',
      '--config.debug.inject_nonfinite_replica=1',
      '--config.train.steps=20',
      '--config.train.steps_per_loop=10',
      '--config.train.log_every=10',
      '--config.numerics.every=0',
      f'--workdir={tmp_path / "run"}',
    ],
    env=ENV,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  out = proc.stdout + proc.stderr
  assert proc.returncode == 0, out[-3000:]
  assert 'the CPU is split into 2 logical devices' in out
  assert '2 replica(s)' in out and 'skipped step 12 ' in out
  assert 'step 20/20 (100%)' in out and '| skipped 1 |' in out


# ---- multi_worker: two processes on loopback ports ------------------------------------------
def run_workers(workdir, out, steps, *extra):
  """Runs tests/multi_worker_run.py as the two workers of one cluster on free loopback ports;
  returns ([worker0's results, worker1's] with their final 'weights' when they finished), [their
  logs]); asserts both exited with code 0."""
  script = os.path.join(ROOT, 'tests', 'multi_worker_run.py')
  logs = run_two_workers([sys.executable, script, str(workdir), str(out), str(steps), *extra])
  results = []
  for name in ('worker0', 'worker1'):
    with open(out / f'{name}.json') as f:
      results.append(json.load(f))
    if (out / f'{name}.npz').exists():  # not written by a worker that was preempted
      results[-1]['weights'] = list(np.load(out / f'{name}.npz').values())
  return results, logs


# 4 TF processes (each starts TensorFlow and its cluster): slow.
@pytest.mark.slow
def test_multi_worker_two_processes_train_checkpoint_and_resume(tmp_path):
  workdir = tmp_path / 'work'
  first, second = tmp_path / 'first', tmp_path / 'second'
  first.mkdir()
  second.mkdir()

  (chief, other), _ = run_workers(workdir, first, steps=2)
  assert chief['replicas'] == other['replicas'] == 2
  assert (chief['chief'], other['chief']) == (True, False)
  assert (chief['start'], chief['end'], other['end']) == (0, 2, 2)
  assert _max_diff(chief['weights'], other['weights']) == 0.0
  assert os.path.exists(workdir / 'checkpoints' / 'ckpt-2.index')
  assert os.path.exists(workdir / 'config.json')
  assert os.listdir(workdir / 'tensorboard')  # the chief's summaries
  assert other['scratch'] and not os.path.exists(other['scratch'])  # removed after saving
  assert sorted(os.listdir(workdir)) == [
    'checkpoints',
    'cluster.json',
    'config.json',
    'tensorboard',
  ]
  assert (
    json.loads((workdir / 'cluster.json').read_text())['workers'] == 2
  )  # for the resume's check
  assert chief['eval'] == other['eval']
  assert chief['eval_count'] == other['eval_count'] == 1000  # each test image once, in total

  # A restart of both workers resumes from the chief's checkpoint.
  (chief, other), _ = run_workers(workdir, second, steps=4)
  assert (chief['start'], other['start']) == (2, 2)
  assert (chief['end'], other['end']) == (4, 4)
  assert _max_diff(chief['weights'], other['weights']) == 0.0
  assert os.path.exists(workdir / 'checkpoints' / 'ckpt-4.index')
