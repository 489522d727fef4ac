"""launch.py's multi-worker flags: what this process does before it trains, if it trains at all.

  --workers=N                 supervise N workers on this host (trainer/launch/supervisor.py) and
                              exit with the worst of their codes; this process does not train
  --cluster=... --task_index  be worker i of that cluster: TF_CONFIG is built here
  TF_CONFIG (already set)     used as it is (with config.distribute.strategy='multi_worker')
  --k8s_manifest=N            print a Kubernetes manifest for N workers (trainer/launch/k8s.py)
  --evaluator                 with --workers: start an evaluator side-car beside them; with
                              --cluster: be that cluster's (TF_CONFIG's task type 'evaluator')

A worker (--cluster, or TF_CONFIG under multi_worker) is checked before TensorFlow starts and
before the run folder is touched (trainer/launch/cluster.py), then watches the other workers
(trainer/launch/peers.py). A mistake is one line and exit code 2, with nothing written.
"""

from __future__ import annotations

import os
import sys

from trainer import config as config_lib
from trainer.distribute import tf_config
from trainer.errors import UserError
from trainer.launch import cluster
from trainer.run import lock as workdir_lock

# launch.py flags the manifest and the workers' commands set themselves.
OWN_FLAGS = (
  'workdir',
  'workers',
  'cluster',
  'task_index',
  'k8s_manifest',
  'k8s_image',
  'k8s_claim',
  'k8s_cpu',
  'k8s_memory',
  'k8s_gpus',
  'k8s_data_claim',
)


def dispatch(flag_values, argv: list[str], config, default_workdir) -> str | None:
  """Returns when this process should go on to train (or run its mode), 'evaluator' when it is
  an evaluator side-car; otherwise exits."""
  try:
    if flag_values.k8s_manifest:
      print(_manifest(flag_values, argv, config), end='')
      sys.exit(0)
    if flag_values.workers:
      sys.exit(_supervise(flag_values, argv, config, default_workdir))
    return _join(flag_values, config)
  except UserError as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)


def _trains(flag_values) -> bool:
  one_process = flag_values.audit or flag_values.advise or flag_values.race
  return flag_values.mode == 'train' and not one_process


def _check_train_only(flag_values, flag: str) -> None:
  if not _trains(flag_values):
    mode = flag_values.mode
    other = f'--mode={mode}' if mode != 'train' else '--audit/--advise/--race'
    raise UserError(f'{flag} trains; {other} runs in one process: leave {flag} out')


def _use_multi_worker(config, flag: str) -> None:
  """Sets config.distribute.strategy to multi_worker ('default' becomes it; others refused)."""
  strategy = config.distribute.strategy
  if strategy == 'default':
    config.distribute.strategy = 'multi_worker'
  elif strategy != 'multi_worker':
    raise UserError(
      f'{flag} runs MultiWorkerMirroredStrategy (each worker uses all its GPUs); '
      f"config.distribute.strategy={strategy!r} is another: set it to 'multi_worker'"
    )


def _supervise(flag_values, argv: list[str], config, default_workdir) -> int:
  from trainer.launch import supervisor

  n = flag_values.workers
  if flag_values.cluster or flag_values.task_index is not None:
    raise UserError(f'--workers={n} makes its own --cluster and --task_index: leave them out')
  if os.environ.get('TF_CONFIG'):
    raise UserError(f'--workers={n} makes a TF_CONFIG per worker; unset the TF_CONFIG set here')
  _check_train_only(flag_values, f'--workers={n}')
  _use_multi_worker(config, f'--workers={n}')
  cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
  if cores and n > cores:
    print(
      f'[launcher] warning: {n} workers on {cores} CPU cores: they share the cores (workers on '
      'one host test a cluster; they do not make training faster than one process)',
      file=sys.stderr,
      flush=True,
    )
  config_lib.check_batch_split(config, n, 'workers')  # before N TensorFlow processes start
  workdir = os.path.abspath(flag_values.workdir or default_workdir())
  workdir_lock.check_free(workdir)  # before any worker reads the run folder
  cluster.check_record(workdir, n, config.train.accept_config_change)
  addresses = [f'{cluster.LOOPBACK}:{p}' for p in cluster.free_ports(n)]
  base = [sys.executable, argv[0], *argv[1:], '--workers=0', f'--workdir={workdir}']
  joined = f'--cluster={",".join(addresses)}'
  commands = [base + [joined, f'--task_index={i}', '--noevaluator'] for i in range(n)]
  if flag_values.evaluator:
    commands.append(base + [joined, '--evaluator'])
  print(f'[launcher] {n} workers on {", ".join(addresses)}; run folder {workdir}', flush=True)
  return supervisor.run(
    commands,
    supervisor.child_env(),
    flag_values.worker_timeout,
    lambda: _newest(workdir),
    sidecar=flag_values.evaluator,
  )


def _newest(workdir: str) -> str | None:
  from trainer.run import checkpoint_files

  return next(iter(checkpoint_files.find(os.path.join(workdir, 'checkpoints'))), None)


def _join(flag_values, config) -> str | None:
  """A worker: TF_CONFIG from --cluster (or the one set), the checks, the peers' watchdog.
  'evaluator' for TF_CONFIG's evaluator task, which joins nothing."""
  text = os.environ.get('TF_CONFIG', '')
  if flag_values.evaluator and flag_values.cluster is None:
    raise UserError('--evaluator evaluates beside workers: add --workers=N (or --cluster=...)')
  if flag_values.cluster is None and flag_values.task_index is None:
    multi = config is not None and config.distribute.strategy == 'multi_worker'
    task = tf_config.read(text) if multi else None
    if task is None:  # not a worker; or TF_CONFIG missing or blank, which the strategy names
      if not multi and config is not None and flag_values.workdir and _trains(flag_values):
        workdir = os.path.abspath(flag_values.workdir)
        cluster.check_record(workdir, 1, config.train.accept_config_change)
      return None
    if task.type == 'evaluator':
      return _evaluator(flag_values, config)
    addresses, index, who = task.addresses, task.position, f'TF_CONFIG (task {task.name})'
  elif flag_values.evaluator:  # the side-car of --cluster's workers (--workers --evaluator)
    if flag_values.task_index is not None or text:
      raise UserError('--evaluator is no task of the collective: leave out --task_index/TF_CONFIG')
    return _evaluator(flag_values, config, '--evaluator')
  else:
    if flag_values.cluster is None or flag_values.task_index is None:
      raise UserError('--cluster and --task_index go together: pass both (or a TF_CONFIG)')
    if text:
      raise UserError('--cluster builds TF_CONFIG, and TF_CONFIG is set here: pass one of them')
    _check_train_only(flag_values, '--cluster')
    addresses, index = cluster.parse(flag_values.cluster), flag_values.task_index
    who = f'--task_index={index}'
    cluster.check_index(index, addresses)
    _use_multi_worker(config, '--cluster')
  config_lib.check_batch_split(config, len(addresses), 'workers')
  cluster.check_port_free(addresses[index], who)
  workdir = os.path.abspath(flag_values.workdir) if flag_values.workdir else None
  if workdir:
    cluster.check_record(workdir, len(addresses), config.train.accept_config_change)
  if not text:
    os.environ['TF_CONFIG'] = tf_config.for_worker(addresses, index)
  from trainer.launch import peers

  peers.follow_launcher()
  peers.install(addresses, index, workdir, flag_values.worker_timeout)
  return None


def _evaluator(flag_values, config, who: str = 'TF_CONFIG task evaluator') -> str:
  """The side-car: one process, out of the collective (TF_CONFIG is dropped here, so that no
  TensorFlow code joins the cluster), reading the run folder only."""
  _check_train_only(flag_values, who)
  if not flag_values.workdir:
    raise UserError(
      f'{who} evaluates the checkpoints the chief writes into the run folder: pass '
      '--workdir=<the run folder the workers share>'
    )
  config.distribute.strategy = 'default'
  os.environ.pop('TF_CONFIG', None)
  from trainer.launch import peers

  peers.follow_launcher()  # under --workers --evaluator: it dies with its launcher too
  return 'evaluator'


def _manifest(flag_values, argv: list[str], config) -> str:
  from trainer.launch import k8s

  n = flag_values.k8s_manifest
  if flag_values.workers or flag_values.cluster or flag_values.task_index is not None:
    raise UserError(f'--k8s_manifest={n} writes its own --cluster: leave out --workers/--cluster')
  _check_train_only(flag_values, f'--k8s_manifest={n}')
  if flag_values.evaluator:
    raise UserError(f'--k8s_manifest={n} writes no evaluator pod: leave --evaluator out')
  _use_multi_worker(config, f'--k8s_manifest={n}')  # checked here; the pods set it themselves
  config_lib.check_batch_split(config, n, 'workers')
  config_file = flag_values['config'].config_filename
  source = flag_values.workdir or os.path.splitext(os.path.basename(config_file))[0]
  name, note = k8s.name_for(source)
  if note:
    print(f'[launcher] {note}', file=sys.stderr)
  args = k8s.pod_args(argv[1:], OWN_FLAGS)
  pod = {
    'image': flag_values.k8s_image,
    'claim': flag_values.k8s_claim,
    'resources': k8s.resources(flag_values.k8s_cpu, flag_values.k8s_memory, flag_values.k8s_gpus),
    'data_claim': flag_values.k8s_data_claim,
  }
  return k8s.manifest(n, name, args, pod, note)
