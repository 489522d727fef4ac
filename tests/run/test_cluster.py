"""Multi-worker launch without hand-written TF_CONFIG (issue 38): --cluster/--task_index build
TF_CONFIG; each bad cluster input is one line and exit code 2 with nothing written; the Kubernetes
manifest loads into the kubernetes client's models and gives every pod its own TF_CONFIG."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from trainer.distribute import tf_config
from trainer.errors import UserError
from trainer.launch import cluster, k8s, peers

from conftest import ROOT

DATA = os.path.join(ROOT, '..', 'shared', 'data', 'mnist')
ENV = {k: v for k, v in os.environ.items() if k != 'TF_CONFIG'}
ENV.update(TF_CPP_MIN_LOG_LEVEL='2', PYTHONPATH=ROOT)


def launch(*args, env=None, cwd=ROOT):
  """launch.py with configs/mnist.py; run in `cwd` (another folder: the paths made absolute)."""
  where = '' if cwd == ROOT else ROOT + os.sep
  return subprocess.run(
    [
      sys.executable,
      f'{where}launch.py',
      f'--config={where}configs/mnist.py',
      f'--config.data.dir={DATA}',
      *args,
    ],
    env=env or ENV,
    cwd=cwd,
    capture_output=True,
    text=True,
    timeout=300,
  )


def one_error_line(proc) -> str:
  lines = [l for l in proc.stderr.splitlines() if l.startswith('error: ')]
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert len(lines) == 1, proc.stderr[-3000:]
  assert 'Traceback' not in proc.stderr
  return lines[0]


# ---- TF_CONFIG from --cluster ---------------------------------------------------------------
def worker_tf_config(addresses, index) -> dict:
  return json.loads(tf_config.for_worker(addresses, index))


def test_cluster_and_index_build_tf_config():
  addresses = cluster.parse('host1:2222,host2:2223')
  assert worker_tf_config(addresses, 1) == {
    'cluster': {'worker': ['host1:2222', 'host2:2223']},
    'task': {'type': 'worker', 'index': 1},
  }


def test_tf_config_roles_place_the_chief_first():
  """MultiWorkerMirroredStrategy's collective: the chief, then the workers in order."""
  spec = {'chief': ['a:1'], 'worker': ['b:2', 'c:3']}
  worker = tf_config.read(json.dumps({'cluster': spec, 'task': {'type': 'worker', 'index': 1}}))
  chief = tf_config.read(json.dumps({'cluster': spec, 'task': {'type': 'chief', 'index': 0}}))
  assert (worker.addresses, worker.position, worker.name) == (['a:1', 'b:2', 'c:3'], 2, 'worker:1')
  assert (chief.addresses, chief.position, chief.name) == (['a:1', 'b:2', 'c:3'], 0, 'chief:0')
  assert tf_config.read('') is None and tf_config.read('  ') is None


def test_a_ps_task_is_refused_never_made_a_worker():
  """Issue 56's case: a task beside one worker was read as the worker at hostA."""
  text = json.dumps(
    {
      'cluster': {'worker': ['hostA:2222'], 'ps': ['hostB:2222']},
      'task': {'type': 'ps', 'index': 0},
    }
  )
  with pytest.raises(UserError, match="TF_CONFIG: task type 'ps': parameter servers are not"):
    tf_config.read(text)


def test_an_evaluator_task_is_outside_the_collective():
  """It trained as worker 0 (issue 59): its place is -1, the collective the workers' alone."""
  spec = {'chief': ['a:1'], 'worker': ['b:2'], 'evaluator': ['c:3']}
  task = tf_config.read(json.dumps({'cluster': spec, 'task': {'type': 'evaluator', 'index': 0}}))
  assert (task.type, task.position, task.addresses) == ('evaluator', -1, ['a:1', 'b:2'])
  worker = tf_config.read(json.dumps({'cluster': spec, 'task': {'type': 'worker', 'index': 0}}))
  assert (worker.position, worker.addresses) == (1, ['a:1', 'b:2'])


@pytest.mark.parametrize(
  'text, words',
  [
    ('{"cluster": {"worker": ["a:1"]}}', 'TF_CONFIG is not valid (KeyError'),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "chief", "index": 0}}', "'chief' is not"),
    ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 1}}', 'index 1 is not'),
    ('{"cluster": {"worker": ["a"]}, "task": {"type": "worker", "index": 0}}', "'a' in cluster."),
  ],
)
def test_a_bad_tf_config_is_named(text, words):
  with pytest.raises(UserError, match=words.replace('(', r'\(')):
    tf_config.read(text)


def test_evaluator_alone_is_refused_in_one_line(tmp_path):
  proc = launch('--evaluator', f'--workdir={tmp_path / "run"}')
  assert '--evaluator evaluates beside workers: add --workers=N' in one_error_line(proc)
  assert not os.path.exists(tmp_path / 'run')


def test_an_evaluator_needs_the_run_folder_and_writes_nothing_without_it(tmp_path):
  spec = {'worker': ['127.0.0.1:2001'], 'evaluator': ['127.0.0.1:2002']}
  env = {
    **ENV,
    'TF_CONFIG': json.dumps({'cluster': spec, 'task': {'type': 'evaluator', 'index': 0}}),
  }
  proc = launch('--config.distribute.strategy=multi_worker', env=env, cwd=tmp_path)
  assert 'TF_CONFIG task evaluator evaluates the checkpoints' in one_error_line(proc)
  assert os.listdir(tmp_path) == []  # it did not train as worker 0


@pytest.mark.parametrize(
  'bad', ['host1', 'host1:0', 'host1:70000', ':2222', 'host 1:2222', 'host1:22a']
)
def test_a_malformed_address_is_named(bad):
  with pytest.raises(UserError, match=f"'{bad}' is not an address"):
    cluster.parse(f'good:1,{bad}')


def test_the_same_address_twice_is_refused():
  with pytest.raises(UserError, match='127.0.0.1:5 is listed twice'):
    cluster.parse('127.0.0.1:5,127.0.0.1:5')


def test_a_port_held_by_another_process_is_named():
  with socket.socket() as held:
    held.bind(('127.0.0.1', 0))
    held.listen()
    port = held.getsockname()[1]
    with pytest.raises(UserError, match=f'port {port} of 127.0.0.1:{port} is in use'):
      cluster.check_port_free(f'127.0.0.1:{port}', '--task_index=1')
  cluster.check_port_free(f'127.0.0.1:{port}', '--task_index=1')  # released: free again


def write_record(folder, workers: int) -> None:
  (folder / 'cluster.json').write_text(json.dumps({'workers': workers, 'addresses': []}))


def test_the_cluster_record_refuses_another_worker_count(tmp_path):
  write_record(tmp_path, 2)
  cluster.check_record(str(tmp_path), 2, accept_change=False)  # other ports, the same count
  with pytest.raises(UserError, match='trained by 2 worker.*this command starts 3'):
    cluster.check_record(str(tmp_path), 3, accept_change=False)
  cluster.check_record(str(tmp_path), 3, accept_change=True)


def test_a_run_of_one_process_is_one_worker_to_resume(tmp_path):
  """1 -> N changes every worker's part of each batch as N -> M does: refused too (it was let
  through, with an INFO line, since a single process writes no record)."""
  cluster.check_record(str(tmp_path), 2, accept_change=False)  # nothing saved: a new run
  (tmp_path / 'checkpoints').mkdir()
  (tmp_path / 'checkpoints' / 'ckpt-5.index').write_bytes(b'')
  cluster.check_record(str(tmp_path), 1, accept_change=False)
  with pytest.raises(UserError, match=r'trained by 1 worker\(s\), this command starts 2'):
    cluster.check_record(str(tmp_path), 2, accept_change=False)
  cluster.check_record(str(tmp_path), 2, accept_change=True)


def test_the_watchdog_names_a_worker_lost_for_the_timeout():
  """A peer seen up, then unreachable: lost after `timeout` seconds, not before; one never seen
  up (still starting) is not lost."""
  up = socket.socket()
  up.bind(('127.0.0.1', 0))
  up.listen()
  never = cluster.free_ports(1)[0]
  addresses = ['127.0.0.1:1', f'127.0.0.1:{up.getsockname()[1]}', f'127.0.0.1:{never}']
  watch = peers.Watch(addresses, 0, None, timeout=60)
  assert watch.tick(0.0) is None and watch.seen_up == {1}
  up.close()
  assert watch.tick(1.0) is None and watch.lost() == [1]
  assert watch.tick(60.0) is None
  assert watch.tick(61.0) == 1


# ---- bad cluster input through launch.py: one line, exit 2, nothing written -------------------
def _bad_inputs(port_held):
  return {
    'index_out_of_range': (
      ['--cluster=127.0.0.1:2001,127.0.0.1:2002', '--task_index=2'],
      '--task_index=2 is not in the cluster: --cluster lists 2 worker(s)',
    ),
    'malformed_address': (
      ['--cluster=127.0.0.1:2001,127.0.0.1', '--task_index=0'],
      "'127.0.0.1' is not an address",
    ),
    'port_in_use': (
      [f'--cluster=127.0.0.1:2001,127.0.0.1:{port_held}', '--task_index=1'],
      f'--task_index=1: port {port_held} of 127.0.0.1:{port_held} is in use on this host',
    ),
    'index_without_cluster': (['--task_index=0'], '--cluster and --task_index go together'),
  }


@pytest.mark.parametrize(
  'case', ['index_out_of_range', 'malformed_address', 'port_in_use', 'index_without_cluster']
)
def test_bad_cluster_input_is_one_line_and_exit_2(tmp_path, case):
  with socket.socket() as held:
    held.bind(('127.0.0.1', 0))
    held.listen()
    args, expected = _bad_inputs(held.getsockname()[1])[case]
    proc = launch(*args, f'--workdir={tmp_path / "run"}')
  assert expected in one_error_line(proc)
  assert not os.path.exists(tmp_path / 'run')


def test_a_second_process_with_the_same_index_is_refused(tmp_path):
  """The same --task_index started twice on one host: the second finds the first's port taken
  (here held by a socket standing for the first worker's TensorFlow server)."""
  with socket.socket() as first:
    first.bind(('127.0.0.1', 0))
    first.listen()
    port = first.getsockname()[1]
    proc = launch(
      f'--cluster=127.0.0.1:{port},127.0.0.1:2', '--task_index=0', f'--workdir={tmp_path / "run"}'
    )
  assert 'the same command with the same task index started twice?' in one_error_line(proc)
  assert not os.path.exists(tmp_path / 'run')


@pytest.mark.parametrize('args, starts', [(['--workers=4'], 4), ([], 1)])
def test_a_cluster_of_another_size_than_the_run_folders_is_refused(tmp_path, args, starts):
  """--workers=4, and one process (N -> 1), on a run two workers trained."""
  run = tmp_path / 'run'
  run.mkdir()
  write_record(run, 2)
  before = sorted(os.listdir(run))
  proc = launch(*args, f'--workdir={run}')
  assert f'this run was trained by 2 worker(s), this command starts {starts}' in one_error_line(
    proc
  )
  assert sorted(os.listdir(run)) == before  # nothing written


def test_a_batch_that_does_not_divide_among_the_workers_is_found_before_any_starts(tmp_path):
  """It was found by each of N TensorFlow workers, N times the same line. More workers than
  cores is a warning naming both numbers."""
  cores = len(os.sched_getaffinity(0))
  n = cores + 1
  proc = launch(f'--workers={n}', f'--config.train.batch_size={2 * n + 1}', f'--workdir={tmp_path}')
  line = one_error_line(proc)
  assert line == (
    f'error: config.train.batch_size={2 * n + 1} does not divide among {n} workers; use a '
    f'multiple of {n} (e.g. {3 * n}).'
  )
  assert '[launcher] started' not in proc.stdout + proc.stderr  # no worker process
  assert f'[launcher] warning: {n} workers on {cores} CPU cores' in proc.stderr


def test_cluster_and_tf_config_together_are_refused(tmp_path):
  env = {**ENV, 'TF_CONFIG': tf_config.for_worker(['127.0.0.1:1'], 0)}
  proc = launch(
    '--cluster=127.0.0.1:2001', '--task_index=0', f'--workdir={tmp_path / "run"}', env=env
  )
  assert 'TF_CONFIG is set here: pass one of them' in one_error_line(proc)
  assert not os.path.exists(tmp_path / 'run')


# ---- Kubernetes ------------------------------------------------------------------------------
def test_the_k8s_manifest_loads_and_gives_each_pod_its_tf_config(tmp_path):
  kubernetes = pytest.importorskip('kubernetes')
  yaml = pytest.importorskip('yaml')
  proc = launch(
    '--config.train.steps=500',
    '--workdir=runs/MNIST_4',
    '--k8s_manifest=4',
    '--k8s_image=registry/mpt:1',
    '--k8s_cpu=4',
    '--k8s_memory=16Gi',
    '--k8s_gpus=1',
    '--k8s_data_claim=mnist-data',
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert not os.path.exists(os.path.join(ROOT, 'runs', 'MNIST_4'))  # nothing written
  name, note = k8s.name_for('runs/MNIST_4')
  assert proc.stdout.startswith(f'# {note}\n') and f'[launcher] {note}' in proc.stderr
  service_doc, job_doc = list(yaml.safe_load_all(proc.stdout))
  api = kubernetes.client.ApiClient()
  service = api._ApiClient__deserialize(service_doc, 'V1Service')
  job = api._ApiClient__deserialize(job_doc, 'V1Job')
  assert isinstance(service, kubernetes.client.V1Service) and isinstance(
    job, kubernetes.client.V1Job
  )
  assert service.spec.cluster_ip == 'None' and service.spec.publish_not_ready_addresses
  assert job.spec.completion_mode == 'Indexed' and job.spec.completions == job.spec.parallelism == 4
  pod = job.spec.template
  assert pod.spec.subdomain == service.metadata.name == job.metadata.name == name
  assert service.spec.selector == pod.metadata.labels  # the Service finds the Job's pods
  assert pod.spec.volumes[0].persistent_volume_claim.claim_name == 'mpt-runs'
  container = pod.spec.containers[0]
  assert container.image == 'registry/mpt:1'
  assert container.volume_mounts[0].mount_path == '/runs'
  assert container.resources.requests == {'cpu': '4', 'memory': '16Gi', 'nvidia.com/gpu': '1'}
  assert container.resources.limits == {'nvidia.com/gpu': '1'}
  (data,) = [m for m in container.volume_mounts if m.name == 'data']
  assert data.mount_path == '/data' and data.read_only
  (volume,) = [v for v in pod.spec.volumes if v.name == 'data']
  assert volume.persistent_volume_claim.claim_name == 'mnist-data'
  # Exit statuses as the Job controller treats them (the first matching rule applies; none:
  # Count, against backoffLimit). A podFailurePolicy needs restartPolicy Never.
  assert pod.spec.restart_policy == 'Never'
  assert job.spec.backoff_limit == 24
  assert [pod_failure(job, code) for code in (2, 75, 3, 1, 137)] == [
    'FailJob',  # bad input: a retry meets it again
    'Ignore',  # preempted after saving: replaced, not counted
    'Count',  # a lost worker (or a run that failed numerically): retried up to backoffLimit
    'Count',
    'Count',
  ]
  assert pod_failure(job, 137, conditions=['DisruptionTarget']) == 'Ignore'  # evicted, drained
  (env,) = [e for e in container.env if e.name == 'JOB_COMPLETION_INDEX']
  assert env.value_from.field_ref.field_path == k8s.INDEX_ANNOTATION
  for index in range(4):  # what Kubernetes runs in pod `index` ($(VAR) expanded from its env)
    command = [a.replace('$(JOB_COMPLETION_INDEX)', str(index)) for a in container.command]
    assert command[:3] == ['python', 'launch.py', '--config=configs/mnist.py']
    assert '--config.train.steps=500' in command and f'--workdir=/runs/{name}' in command
    assert not any(a.startswith(('--k8s', '--workdir=runs')) for a in command)
    flags = dict(a[2:].split('=', 1) for a in command[2:])
    built = worker_tf_config(cluster.parse(flags['cluster']), int(flags['task_index']))
    assert built == {
      'cluster': {'worker': [f'{name}-{i}.{name}:2222' for i in range(4)]},
      'task': {'type': 'worker', 'index': index},
    }


def pod_failure(job, exit_code: int, conditions=()) -> str:
  """The action the Job controller takes for a failed pod of `job` whose worker container exited
  with `exit_code` and which has `conditions` (status True): the first rule that matches, else
  Count (Kubernetes' documented semantics of spec.podFailurePolicy)."""
  for rule in job.spec.pod_failure_policy.rules:
    codes = rule.on_exit_codes
    if codes is not None and codes.container_name in (None, 'worker'):
      if (exit_code in codes.values) == (codes.operator == 'In'):
        return rule.action
    for pattern in rule.on_pod_conditions or ():
      if pattern.type in conditions and pattern.status == 'True':
        return rule.action
  return 'Count'


def test_a_bad_resource_quantity_is_one_line(tmp_path):
  proc = launch('--k8s_manifest=2', '--k8s_memory=16 GB', f'--workdir={tmp_path}')
  assert '--k8s_memory=16 GB: not a Kubernetes quantity' in one_error_line(proc)
  assert proc.stdout == ''


def test_manifest_names_are_dns_1035_labels_distinct_per_workdir():
  """runs/2026-11-28 was a Service '2026-11-28' (a digit first); exp/Run_A and other/run.a were
  both 'run-a', one Job and one run folder; each change was silent."""
  label = re.compile(r'[a-z]([-a-z0-9]*[a-z0-9])?')
  workdirs = ['runs/2026-11-28', 'exp/Run_A', 'other/run.a', 'run-a', 'x' * 80, '/abs/run_a/']
  names = {}
  for workdir in workdirs:
    name, note = k8s.name_for(workdir)
    assert label.fullmatch(name) and len(f'{name}-999') <= 63, name
    assert (note is None) == (name == workdir), (workdir, note)
    if note:
      assert f'{workdir!r} is no DNS-1035 label' in note and f'/runs/{name} are named' in note
    names[workdir] = name
  assert len(set(names.values())) == len(workdirs), names
  assert names['exp/Run_A'].startswith('run-a-') and names['runs/2026-11-28'].startswith('run-2026')


def test_a_tf_config_already_set_is_used_as_it_is(tmp_path):
  """Not rebuilt from flags: its task's address is the one checked (here, held)."""
  with socket.socket() as held:
    held.bind(('127.0.0.1', 0))
    held.listen()
    port = held.getsockname()[1]
    env = {**ENV, 'TF_CONFIG': tf_config.for_worker(['127.0.0.1:2001', f'127.0.0.1:{port}'], 1)}
    proc = launch(
      '--config.distribute.strategy=multi_worker', f'--workdir={tmp_path / "run"}', env=env
    )
  assert f'TF_CONFIG (task worker:1): port {port} of 127.0.0.1:{port} is in use' in one_error_line(
    proc
  )
  assert not os.path.exists(tmp_path / 'run')


# ---- faults -----------------------------------------------------------------------------------
def test_a_second_launcher_on_a_busy_workdir_exits_2_with_nothing_read_or_written(tmp_path):
  """It exited 3, and its worker 1 first resumed from the other run's checkpoint without the
  lock. Here this test process holds the lock, as a running chief does."""
  from trainer.run import lock as workdir_lock

  run = tmp_path / 'run'
  run.mkdir()
  write_record(run, 2)
  path = workdir_lock.acquire(str(run))
  try:
    before = {p: p.stat().st_mtime_ns for p in run.iterdir()}
    proc = launch('--workers=2', f'--workdir={run}')
    line = one_error_line(proc)
    assert f'workdir {run} is in use by another training process (pid {os.getpid()}' in line
    assert {p: p.stat().st_mtime_ns for p in run.iterdir()} == before
    assert '[launcher] started' not in proc.stdout
  finally:
    workdir_lock.release(path)


@pytest.mark.slow  # 3 processes importing TensorFlow
def test_the_workers_end_when_their_launcher_is_killed(tmp_path):
  """They sat in their own sessions and trained on, unseen, to the end of the run."""
  proc = subprocess.Popen(
    [
      sys.executable,
      'launch.py',
      '--config=configs/mnist.py',
      f'--config.data.dir={DATA}',
      '--workers=2',
      f'--workdir={tmp_path / "run"}',
    ],
    env=ENV,
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  for line in proc.stdout:
    if line.startswith('[launcher] started'):
      pids = [int(p) for p in re.findall(r'pid (\d+)', line)]
      break
  proc.kill()
  proc.wait()
  deadline = time.monotonic() + 60  # a worker still importing TensorFlow sets the signal after
  while time.monotonic() < deadline and any(os.path.exists(f'/proc/{p}') for p in pids):
    time.sleep(0.2)
  alive = [p for p in pids if os.path.exists(f'/proc/{p}')]
  for p in alive:
    os.kill(p, 9)
  assert alive == []


def test_tensorflows_grpc_bind_failure_is_one_line_naming_the_port():
  """A port taken after the worker's own check was a 25-line traceback
  (UnknownError: Could not start gRPC server), exit 1."""
  with socket.socket() as held:
    held.bind(('', 0))
    held.listen()
    port = held.getsockname()[1]
    code = (
      'from trainer.distribute import strategy\n'
      'from trainer.errors import UserError\n'
      'try:\n'
      '  strategy._multi_worker()\n'
      'except UserError as e:\n'
      '  print(e)\n'
    )
    env = {**ENV, 'TF_CONFIG': tf_config.for_worker([f'127.0.0.1:{port}'], 0)}
    proc = subprocess.run(
      [sys.executable, '-c', code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
  assert proc.stdout.strip() == (
    f'TF_CONFIG task worker:0: TensorFlow could not listen on 127.0.0.1:{port} (port {port} '
    'taken by another process since the launcher checked it?); free the port, or give this task '
    'another one'
  ), proc.stderr[-3000:]


@pytest.mark.slow  # two processes starting TensorFlow's cluster
def test_no_worker_reads_a_run_folder_whose_lock_another_process_holds(tmp_path):
  """Worker 1 of a second cluster resumed from the other run's checkpoint without the lock. Now
  the workers meet once the chief holds it; refused, the chief says why and the others stop."""
  from local_cluster import free_ports

  from trainer.run import lock as workdir_lock

  run = tmp_path / 'run'
  run.mkdir()
  path = workdir_lock.acquire(str(run))
  try:
    spec = {'worker': [f'127.0.0.1:{p}' for p in free_ports(2)]}
    procs = [
      subprocess.Popen(
        [
          sys.executable,
          'launch.py',
          '--config=configs/mnist.py',
          f'--config.data.dir={DATA}',
          '--config.distribute.strategy=multi_worker',
          f'--workdir={run}',
        ],
        env={
          **ENV,
          'TF_CONFIG': json.dumps({'cluster': spec, 'task': {'type': 'worker', 'index': i}}),
        },
        cwd=ROOT,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
      )
      for i in range(2)
    ]
    errors = [p.communicate(timeout=300)[1] for p in procs]
  finally:
    workdir_lock.release(path)
  assert [p.returncode for p in procs] == [2, 2], errors[1][-3000:]
  assert 'is in use by another training process' in errors[0]
  assert f'worker 0 could not open the run folder {run}' in errors[1]
  assert 'resumed from' not in errors[0] + errors[1]
