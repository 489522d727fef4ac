"""A Kubernetes manifest for N workers without TFJob: a headless Service and an Indexed Job.

  python launch.py --config=configs/mnist.py --workdir=mnist-4 --k8s_manifest=4 > job.yaml

Kubernetes' pattern for indexed workloads: the Job (completionMode: Indexed) runs N pods, pod i
with hostname `<name>-i`, which the headless Service `<name>` names `<name>-i.<name>`: the
cluster list is known before any pod starts. Each pod runs launch.py with the same arguments plus
`--cluster=<name>-0.<name>:2222,...` and `--task_index=$(JOB_COMPLETION_INDEX)` (set from the
pod's completion-index annotation) and builds its own TF_CONFIG (trainer/launch/cluster.py). The
run folder is /runs/<name> on a volume every pod mounts (a ReadWriteMany PersistentVolumeClaim).

A lost worker ends the others with exit code 3 (trainer/launch/peers.py); restartPolicy OnFailure
restarts every container, and each resumes from the chief's newest checkpoint. SIGTERM (a pod
evicted or deleted) saves at the same step on every worker within the grace period.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

PORT = 2222
MOUNT = '/runs'
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


def manifest(
  workers: int, name: str, args: list[str], image: str, claim: str, note: str | None = None
) -> str:
  """The YAML stream (Service, then Job) for `workers` pods running launch.py `args`; `note`
  (a name that was changed) heads it as a comment."""
  head = f'# {note}\n' if note else ''
  return head + '---\n'.join(to_yaml(d) for d in documents(workers, name, args, image, claim))


def documents(workers: int, name: str, args: list[str], image: str, claim: str) -> list[dict]:
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
  container = {
    'name': 'worker',
    'image': image,
    'command': command,
    'env': [
      {'name': 'JOB_COMPLETION_INDEX', 'valueFrom': {'fieldRef': {'fieldPath': INDEX_ANNOTATION}}}
    ],
    'ports': [{'name': 'grpc', 'containerPort': PORT}],
    'volumeMounts': [{'name': 'runs', 'mountPath': MOUNT}],
  }
  job = {
    'apiVersion': 'batch/v1',
    'kind': 'Job',
    'metadata': {'name': name, 'labels': labels},
    'spec': {
      'completionMode': 'Indexed',
      'completions': workers,
      'parallelism': workers,
      'backoffLimit': 6 * workers,
      'template': {
        'metadata': {'labels': labels},
        'spec': {
          'subdomain': name,  # with the Service of the same name: <name>-i.<name> resolves
          'restartPolicy': 'OnFailure',
          'terminationGracePeriodSeconds': GRACE_SECONDS,
          'containers': [container],
          'volumes': [{'name': 'runs', 'persistentVolumeClaim': {'claimName': claim}}],
        },
      },
    },
  }
  return [service, job]


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
