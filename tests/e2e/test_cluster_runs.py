"""End to end, `launch.py --workers=2` on this machine (issue 38): the docs' one-line command
trains MNIST to the accuracy of one process, in one log; SIGTERM to one worker stops both with
the preempted status, and the same command ends bit-identical to an uninterrupted run; kill -9
of worker 1 or of the chief at a random step ends the survivor by itself (exit code 3, one line
naming the lost worker and the checkpoint), and the same command then ends bit-identical too.
Each run is 2 TensorFlow processes on the 2 shared cores: all slow."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import docblocks

from conftest import ROOT, once_per_session
from trainer.run.preemption import EXIT_PREEMPTED

ENV = {k: v for k, v in os.environ.items() if k != 'TF_CONFIG'}
ENV.update(TF_CPP_MIN_LOG_LEVEL='2', PYTHONPATH=ROOT)
STEPS = 60
# Short: a save every 10 steps, so a kill loses at most one loop.
SHORT = [
  f'--config.train.steps={STEPS}',
  '--config.train.steps_per_loop=10',
  '--config.train.log_every=10',
  '--config.train.checkpoint_every=10',
  '--config.numerics.every=0',
]
pytestmark = pytest.mark.slow


def doc_command() -> list[str]:
  """distribution.md's one-line command, without its run length and workdir (set per test)."""
  words = shlex.split(docblocks.block('runs this block as workers.sh').replace('\\\n', ' '))
  assert words[:2] == ['python', 'launch.py'] and '--workers=2' in words
  return [a for a in words[2:] if not a.startswith(('--config.train.steps=', '--workdir='))]


class Run:
  """launch.py in the background; its lines collected as they come."""

  def __init__(self, workdir, *args):
    self.lines: list[str] = []
    self.proc = subprocess.Popen(
      [sys.executable, 'launch.py', *args, *SHORT, f'--workdir={workdir}'],
      env=ENV,
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    self.reader = threading.Thread(target=self._read, daemon=True)
    self.reader.start()

  def _read(self):
    for line in self.proc.stdout:
      self.lines.append(line)

  def wait_for(self, pattern: str, timeout: float = 900) -> re.Match:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
      for line in list(self.lines):
        match = re.search(pattern, line)
        if match:
          return match
      assert self.proc.poll() is None, self.text[-4000:]
      time.sleep(0.2)
    raise AssertionError(f'no line matching {pattern!r}:\n{self.text[-4000:]}')

  def finish(self, timeout: float = 900) -> int:
    code = self.proc.wait(timeout=timeout)
    self.reader.join(timeout=10)
    return code

  @property
  def text(self) -> str:
    return ''.join(self.lines)


def run(workdir, *args) -> Run:
  r = Run(workdir, *args)
  assert r.finish() == 0, r.text[-4000:]
  return r


def accuracy(text: str, prefix: str = '') -> float:
  """The final accuracy a run printed (its workers' lines carry `prefix`)."""
  return float(re.search(rf'^{re.escape(prefix)}accuracy: ([0-9.]+)$', text, re.M).group(1))


def final_state(workdir) -> dict[str, np.ndarray]:
  """Every variable of the run's final checkpoint (the weights, the optimizer's slots, the loss
  scaler, the counters) but save_counter (how often it saved)."""
  import tensorflow as tf

  reader = tf.train.load_checkpoint(os.path.join(workdir, 'checkpoints', f'ckpt-{STEPS}'))
  names = [n for n in reader.get_variable_to_shape_map() if n.endswith('/VARIABLE_VALUE')]
  names = [n for n in names if not n.startswith('save_counter/')]
  assert any(n.startswith('optimizer/_trainable_variables/') for n in names), names
  return {n: reader.get_tensor(n) for n in names}


def assert_bit_identical(a, b):
  sa, sb = final_state(a), final_state(b)
  assert sorted(sa) == sorted(sb)
  different = [n for n in sa if not np.array_equal(sa[n], sb[n])]
  assert different == [], different


def _run_uninterrupted(folder):
  (folder / 'output.txt').write_text(run(folder / 'run', *doc_command()).text)


@pytest.fixture(scope='module')
def uninterrupted(tmp_path_factory):
  """The docs' command with --workers=2, never interrupted: its workdir and its output. Once
  per session (conftest.once_per_session): worksteal spreads this module's tests over several
  xdist workers, and a module fixture would run the two-worker run in each of them."""
  folder = once_per_session(tmp_path_factory, 'cluster_uninterrupted', _run_uninterrupted)
  text = (folder / 'output.txt').read_text()
  assert '[launcher] 2 workers on 127.0.0.1:' in text
  # One log: worker 0's progress, each line once (worker 1 printed the same ones), no line of
  # worker 1 in a clean run, and the launcher's closing line last.
  progress = [int(s) for s in re.findall(rf'step (\d+)/{STEPS} \(\d+%\)', text)]
  assert progress == list(range(10, STEPS + 1, 10)), text[-4000:]
  assert '[worker 1] ' not in text and 'mpt-worker' not in text, text[-4000:]
  assert accuracy(text, '[worker 0] ') > 0.5
  closing = text.splitlines()[-1]
  assert closing == (
    f'[launcher] 2 workers ended: workers 0-1 finished; exit status 0; the final checkpoint is '
    f'{folder / "run"}/checkpoints/ckpt-{STEPS}'
  ), text[-4000:]
  return folder / 'run', text


def test_two_workers_reach_the_accuracy_of_one_process(uninterrupted, tmp_path):
  workdir, two = uninterrupted
  words = [a for a in doc_command() if a != '--workers=2']
  one = run(tmp_path / 'one', *words).text
  assert abs(accuracy(two, '[worker 0] ') - accuracy(one)) <= 0.003, (
    accuracy(two, '[worker 0] '),
    accuracy(one),
  )
  assert sorted(os.listdir(workdir)) == [
    'checkpoints',
    'cluster.json',
    'config.json',
    'tensorboard',
  ]


def test_sigterm_to_one_worker_stops_both_preempted_and_the_rerun_is_bit_identical(
  uninterrupted, tmp_path
):
  """A node drain: SIGTERM to worker 1 alone. Both saved and exited 0, which completes an
  Indexed Job's index before the run ended; now both exit with the preempted status, which the
  manifest's podFailurePolicy restarts (test_cluster.py), and the rerun ends bit-identical."""
  workdir = tmp_path / 'run'
  r = Run(workdir, *doc_command())
  pids = dict(re.findall(r'worker (\d) pid (\d+)', r.wait_for(r'\[launcher\] started .*').group(0)))
  r.wait_for(r'\[worker 0\] .*step 20/')
  os.kill(int(pids['1']), signal.SIGTERM)
  assert r.finish() == EXIT_PREEMPTED, r.text[-4000:]
  stopped = re.findall(r'\[(workers? [\d,-]+)\] stopped by (.+) at step (\d+)/', r.text)
  assert sorted(stopped) == sorted(
    [
      ('worker 0', 'a signal on another worker', stopped[0][2]),
      ('worker 1', 'SIGTERM', stopped[0][2]),
    ]
  ), r.text[-4000:]  # at the same step; worker 1 names the chief's checkpoint, no scratch folder
  checkpoint = f'{workdir}/checkpoints/ckpt-{stopped[0][2]}'
  assert f'checkpoint saved to {checkpoint};' in r.text and 'mpt-worker' not in r.text
  assert r.text.splitlines()[-1] == (
    '[launcher] 2 workers ended: workers 0-1 stopped by a signal with a checkpoint saved (exit '
    f'75, preempted); exit status 75; the newest checkpoint is {checkpoint}: the same command '
    'resumes from it'
  )
  again = run(workdir, *doc_command())
  assert f'resumed from {checkpoint}' in again.text
  assert_bit_identical(uninterrupted[0], workdir)


@pytest.mark.parametrize('victim', [1, 0])
def test_kill_9_of_a_worker_ends_the_other_and_the_rerun_is_bit_identical(
  uninterrupted, tmp_path, victim
):
  workdir = tmp_path / 'run'
  r = Run(workdir, *doc_command())
  pids = {
    int(w): int(p)
    for w, p in re.findall(
      r'worker (\d) pid (\d+)', r.wait_for(r'\[launcher\] started .*').group(0)
    )
  }
  at = random.choice([10, 20, 30, 40])
  r.wait_for(rf'\[worker 0\] .*step {at}/')  # the one log shows worker 0's progress
  os.kill(pids[victim], signal.SIGKILL)
  killed = time.monotonic()
  code = r.finish(timeout=300)
  elapsed = time.monotonic() - killed
  survivor = 1 - victim
  assert code == 128 + signal.SIGKILL, r.text[-4000:]  # the worst code: the victim's
  lines = [l for l in r.text.splitlines() if 'error: ' in l]
  # The survivor ended by itself (code 3, its own line), not killed by the launcher's backstop.
  assert any(
    l.startswith(f'[worker {survivor}] error: worker {survivor}: worker {victim} was lost')
    for l in lines
  ), (elapsed, r.text[-4000:])
  (last,) = [l for l in lines if l.startswith('error: ')]
  assert last.startswith(f'error: worker {victim} was lost (killed by SIGKILL)'), last
  newest = re.search(r'The newest checkpoint is (.+?); run the same command', last).group(1)
  again = run(workdir, *doc_command())
  if newest == 'none (nothing saved yet)':  # killed at step 10 before its save
    assert at == 10 and 'resumed from' not in again.text, last
  else:
    assert re.fullmatch(rf'{re.escape(str(workdir))}/checkpoints/ckpt-\d+', newest), last
    assert f'resumed from {newest}' in again.text
  assert_bit_identical(uninterrupted[0], workdir)


def test_an_evaluator_beside_two_workers_evaluates_their_checkpoints_and_changes_nothing(
  uninterrupted, tmp_path
):
  """TF_CONFIG's evaluator task trained as worker 0 of a run of its own (issue 59). Now it joins
  nothing: the workers' final checkpoint is bit-identical to two workers alone; it evaluates
  checkpoints once each, in order, up to the last step's, as --mode=eval does; it writes only
  its records and events."""
  from local_cluster import free_ports

  workdir = tmp_path / 'run'
  addresses = [f'127.0.0.1:{p}' for p in free_ports(3)]
  spec = {'worker': addresses[:2], 'evaluator': addresses[2:]}
  words = [a for a in doc_command() if a != '--workers=2']
  argv = [sys.executable, 'launch.py', *words, *SHORT, f'--workdir={workdir}']
  argv.append('--config.distribute.strategy=multi_worker')
  procs = []
  for kind, index in (('worker', 0), ('worker', 1), ('evaluator', 0)):
    tf_config = json.dumps({'cluster': spec, 'task': {'type': kind, 'index': index}})
    env = {**ENV, 'TF_CONFIG': tf_config}
    procs.append(
      subprocess.Popen(
        argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
      )
    )
  logs = [p.communicate(timeout=900)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0, 0], logs[2][-4000:]
  assert_bit_identical(uninterrupted[0], workdir)
  evaluator = logs[2]
  assert 'saved checkpoint' not in evaluator and 'training MnistCnnTrainer' not in evaluator
  assert sorted(os.listdir(workdir)) == [
    'checkpoints',
    'cluster.json',
    'config.json',
    'evaluator',
    'tensorboard',
  ]
  records = [json.loads(p.read_text()) for p in (workdir / 'evaluator').iterdir()]
  steps = sorted(r['step'] for r in records)
  assert steps[-1] == STEPS and set(steps) <= set(range(10, STEPS + 1, 10)), steps
  order = [int(s) for s in re.findall(r'evaluator: ckpt-(\d+) ', evaluator)]
  assert order == steps, evaluator[-4000:]  # in order, once each
  assert os.listdir(workdir / 'tensorboard' / 'evaluator')
  # The last record is the single-checkpoint eval of ckpt-60 (the newest).
  one = subprocess.run(
    [sys.executable, 'launch.py', *words, *SHORT, f'--workdir={workdir}', '--mode=eval'],
    env=ENV,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert one.returncode == 0, one.stderr[-3000:]
  last = next(r for r in records if r['step'] == STEPS)['metrics']
  line = re.search(r'^final eval: (.+)$', one.stdout, re.M).group(1)
  assert dict(m.split(' ') for m in line.split(', ')) == {k: f'{v:.4f}' for k, v in last.items()}
