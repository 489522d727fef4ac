"""A Kubernetes manifest for N workers without TFJob: a headless Service and an Indexed Job.

  python launch.py --config=configs/mnist.py --workdir=mnist-4 --k8s_manifest=4 > job.yaml

Kubernetes' pattern for indexed workloads: the Job (completionMode: Indexed) runs N pods, pod i
with hostname `<name>-i`, which the headless Service `<name>` names `<name>-i.<name>`: the
cluster list is known before any pod starts. Each pod runs launch.py with the same arguments plus
`--cluster=<name>-0.<name>:2222,...` and `--task_index=$(JOB_COMPLETION_INDEX)` (set from the
pod's completion-index annotation) and builds its own TF_CONFIG (trainer/launch/cluster.py). The
run folder is /runs/<name> on a volume every pod mounts (a ReadWriteMany PersistentVolumeClaim).

Exit statuses, and what the Job controller does with each pod that fails (restartPolicy Never,
which a podFailurePolicy needs: the controller replaces a failed pod, same index and hostname):
  * 2 (bad input: the command, config or data) fails the Job at once (FailJob): a retry meets it;
  * 75 (EXIT_PREEMPTED: SIGTERM saved a checkpoint before the last step, on every worker at the
    same step) and a pod with the DisruptionTarget condition (evicted, preempted, its node
    drained) are replaced without counting against backoffLimit (Ignore);
  * any other (3: a lost worker, or a run that failed numerically; 1: a bug; a signal's death)
    is counted (Count), backoffLimit 6 per worker.
Every replaced pod resumes from the chief's newest checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

from trainer.errors import UserError
from trainer.run.preemption import EXIT_PREEMPTED

PORT = 2222
MOUNT = '/runs'
DATA_MOUNT = '/data'  # --k8s_data_claim, read-only
EXIT_BAD_INPUT = 2  # trainer.errors.UserError.exit_status
_QUANTITY = re.compile(r'\d+(\.\d+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?')  # Kubernetes' common suffixes
INDEX_ANNOTATION = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
GRACE_SECONDS = 300  # SIGTERM to exit: the current loop, one checkpoint and the exit


def name_for(workdir: str) -> tuple[str, str | None]:
  """(name, note): a DNS-1035 label (a-z, 0-9 and '-', a letter first) short enough for
  `<name>-<index>`, for the Service, the Job and the pods' run folder. A workdir that is such a
  label already is the name; any other gets the label of its last folder plus a hash of the
  whole workdir, so two workdirs never share a Job or a run folder (exp/Run_A and other/run.a
  are run-a-<hash1> and run-a-<hash2>), and `note` says what it became."""
  source = os.path.normpath(workdir)
  if re.fullmatch(r'[a-z]([-a-z0-9]{0,48}[a-z0-9])?', source):
    return source, None
  base = re.sub(r'[^a-z0-9-]+', '-', os.path.basename(source).lower())
  base = re.sub(r'-+', '-', base).strip('-')[:40].strip('-')
  base = base if base[:1].isalpha() else f'run-{base}'.strip('-')
  name = f'{base}-{hashlib.sha256(source.encode()).hexdigest()[:8]}'
  return name, (
    f'{workdir!r} is no DNS-1035 label (a-z, 0-9 and -, a letter first): the Service, the Job '
    f'and the run folder {MOUNT}/{name} are named {name}'
  )


def resources(cpu: str, memory: str, gpus: int) -> dict:
  """The container's requests (and the GPUs' limits, which extended resources need equal to
  the requests); UserError naming the flag of a quantity Kubernetes would refuse."""
  requests: dict = {}
  for flag, value, key in (('--k8s_cpu', cpu, 'cpu'), ('--k8s_memory', memory, 'memory')):
    if value and not _QUANTITY.fullmatch(value):
      raise UserError(
        f'{flag}={value}: not a Kubernetes quantity; write e.g. --k8s_cpu=4 or 500m, '
        '--k8s_memory=16Gi'
      )
    if value:
      requests[key] = value
  out: dict = {'requests': requests} if requests else {}
  if gpus:
    gpu = {'nvidia.com/gpu': str(gpus)}  # a quantity is a string, as cpu and memory
    out = {'requests': {**requests, **gpu}, 'limits': gpu}
  return out


def manifest(workers: int, name: str, args: list[str], pod: dict, note: str | None = None) -> str:
  """The YAML stream (Service, then Job) for `workers` pods running launch.py `args`; `pod`:
  image, claim, resources (`resources()`), data_claim. `note` (a name that was changed) heads it
  as a comment."""
  head = f'# {note}\n' if note else ''
  return head + '---\n'.join(to_yaml(d) for d in documents(workers, name, args, **pod))


def failure_policy() -> dict:
  """The Job's podFailurePolicy (the module docstring); the first rule that matches applies."""
  return {
    'rules': [
      {
        'action': 'FailJob',
        'onExitCodes': {'containerName': 'worker', 'operator': 'In', 'values': [EXIT_BAD_INPUT]},
      },
      {
        'action': 'Ignore',
        'onExitCodes': {'containerName': 'worker', 'operator': 'In', 'values': [EXIT_PREEMPTED]},
      },
      {'action': 'Ignore', 'onPodConditions': [{'type': 'DisruptionTarget', 'status': 'True'}]},
    ]
  }


def documents(
  workers: int,
  name: str,
  args: list[str],
  image: str,
  claim: str,
  resources: dict | None = None,
  data_claim: str = '',
) -> list[dict]:
  labels = {'app.kubernetes.io/name': 'mpt-trainer', 'mpt-trainer/run': name}
  service = {
    'apiVersion': 'v1',
    'kind': 'Service',
    'metadata': {'name': name, 'labels': labels},
    'spec': {
      'clusterIP': 'None',  # headless: one DNS record per pod, no load balancing
      'publishNotReadyAddresses': True,  # the rendezvous happens before any pod is ready
      'selector': labels,
      'ports': [{'name': 'grpc', 'port': PORT, 'targetPort': PORT}],
    },
  }
  addresses = ','.join(f'{name}-{i}.{name}:{PORT}' for i in range(workers))
  command = ['python', 'launch.py', *args, f'--workdir={MOUNT}/{name}']
  command += [f'--cluster={addresses}', '--task_index=$(JOB_COMPLETION_INDEX)']
  container: dict = {
    'name': 'worker',
    'image': image,
    'command': command,
    'env': [
      {'name': 'JOB_COMPLETION_INDEX', 'valueFrom': {'fieldRef': {'fieldPath': INDEX_ANNOTATION}}}
    ],
    'ports': [{'name': 'grpc', 'containerPort': PORT}],
  }
  container['volumeMounts'], volumes = _volumes(claim, data_claim)
  if resources:
    container['resources'] = resources
  job = {
    'apiVersion': 'batch/v1',
    'kind': 'Job',
    'metadata': {'name': name, 'labels': labels},
    'spec': {
      'completionMode': 'Indexed',
      'completions': workers,
      'parallelism': workers,
      'backoffLimit': 6 * workers,
      'podFailurePolicy': failure_policy(),
      'template': {
        'metadata': {'labels': labels},
        'spec': {
          'subdomain': name,  # with the Service of the same name: <name>-i.<name> resolves
          'restartPolicy': 'Never',  # a podFailurePolicy needs it: failed pods are replaced
          'terminationGracePeriodSeconds': GRACE_SECONDS,
          'containers': [container],
          'volumes': volumes,
        },
      },
    },
  }
  return [service, job]


def _volumes(claim: str, data_claim: str) -> tuple[list[dict], list[dict]]:
  """(the container's mounts, the pod's volumes): the run folders, and the data if given."""
  mounts: list[dict] = [{'name': 'runs', 'mountPath': MOUNT}]
  volumes: list[dict] = [{'name': 'runs', 'persistentVolumeClaim': {'claimName': claim}}]
  if data_claim:
    mounts.append({'name': 'data', 'mountPath': DATA_MOUNT, 'readOnly': True})
    volumes.append(
      {'name': 'data', 'persistentVolumeClaim': {'claimName': data_claim, 'readOnly': True}}
    )
  return mounts, volumes


def to_yaml(value, indent: int = 0) -> str:
  """Block-style YAML of dicts, lists, strings, numbers and booleans (strings JSON-quoted,
  which YAML reads as double-quoted scalars)."""
  pad = ' ' * indent
  if isinstance(value, dict):
    lines = []
    for key, item in value.items():
      if isinstance(item, (dict, list)) and item:
        lines.append(f'{pad}{key}:\n{to_yaml(item, indent + 2)}')
      else:
        lines.append(f'{pad}{key}: {_scalar(item)}\n')
    return ''.join(lines)
  lines = []
  for item in value:
    if isinstance(item, (dict, list)) and item:
      body = to_yaml(item, indent + 2)
      lines.append(f'{pad}- {body[indent + 2 :]}')
    else:
      lines.append(f'{pad}- {_scalar(item)}\n')
  return ''.join(lines)


def _scalar(value) -> str:
  if isinstance(value, (dict, list)):
    return '{}' if isinstance(value, dict) else '[]'
  return json.dumps(value)


def pod_args(argv: list[str], dropped: tuple[str, ...]) -> list[str]:
  """launch.py's arguments without the flags the manifest sets or that only apply here."""
  out, skip = [], False
  for arg in argv:
    if skip:
      skip = False
      continue
    flag = arg.split('=', 1)[0].lstrip('-')
    if arg.startswith('-') and flag in dropped:  # each takes a value: --flag=v or --flag v
      skip = '=' not in arg
      continue
    out.append(arg)
  return out
