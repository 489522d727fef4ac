"""The one reader of TF_CONFIG, for the launcher (before TensorFlow starts) and the strategy.

TF_CONFIG is TensorFlow's description of a cluster and of this process's task in it:

  {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]},
   "task": {"type": "worker", "index": 1}}

The roles, as MultiWorkerMirroredStrategy defines them:
  * `worker`: a member of the collective; worker 0 is the chief when the cluster has no `chief`;
  * `chief`: a member of the collective placed before every worker (it writes the run folder);
  * `evaluator`: no member of the collective; a side-car that evaluates the checkpoints the chief
    writes (`position` -1; trainer/run/lifecycle.py's evaluate_continuously);
  * `ps` is refused in one line: taken for a worker it would train a second, separate run
    (Keras 3 has no ParameterServerStrategy).
Every mistake is a UserError naming TF_CONFIG and the culprit. TensorFlow-free.
"""

from __future__ import annotations

import dataclasses
import json
import os

from trainer.config import is_address
from trainer.errors import UserError

# In the run folder, written by the chief: {"workers": N, "addresses": [...]}; a resume with
# another count is refused (trainer/launch/cluster.py).
RECORD = 'cluster.json'
# A non-chief worker's scratch checkpoint folders in the temporary directory (mpt-worker1-<pid>-
# ...), by pid: a launcher removes those of a worker killed while saving.
SCRATCH_GLOB = 'mpt-*-{pid}-*'
_EXAMPLE = (
  '{"cluster": {"worker": ["host1:port", "host2:port"]}, "task": {"type": "worker", "index": 0}}'
)
_REFUSED = {
  'ps': (
    'parameter servers are not supported (Keras 3 has no ParameterServerStrategy); the '
    "workers train with MultiWorkerMirroredStrategy: give the cluster 'worker' tasks only"
  ),
}


@dataclasses.dataclass(frozen=True)
class Task:
  """This process's place in the collective: `addresses` of the chief (if any) and the workers,
  in the collective's order, and `position`, this task's index in it (0 writes the run folder;
  -1: an evaluator, outside it)."""

  type: str
  index: int
  addresses: list[str]
  position: int

  @property
  def name(self) -> str:
    return f'{self.type}:{self.index}'


def read(text: str | None = None) -> Task | None:
  """The task TF_CONFIG (or `text`) describes; None when it is unset or empty."""
  text = os.environ.get('TF_CONFIG', '') if text is None else text
  if not text.strip():
    return None
  try:
    value = json.loads(text)
    spec, task = dict(value['cluster']), value['task']
    kind, index = task['type'], int(task['index'])
  except (ValueError, KeyError, TypeError, AttributeError) as e:
    raise UserError(
      f'TF_CONFIG is not valid ({type(e).__name__}: {e}); it must be JSON like {_EXAMPLE}'
    ) from None
  if kind in _REFUSED:
    raise UserError(f'TF_CONFIG: task type {kind!r}: {_REFUSED[kind]}')
  if kind not in spec or not isinstance(spec[kind], list):
    raise UserError(
      f'TF_CONFIG: task type {kind!r} is not in the cluster (it has '
      f'{", ".join(map(repr, spec)) or "no task types"}); set task.type to one of them.'
    )
  if kind not in ('chief', 'worker', 'evaluator'):
    raise UserError(
      f"TF_CONFIG: task type {kind!r} is not a role here; use 'worker', 'chief' or 'evaluator'"
    )
  if not 0 <= index < len(spec[kind]):
    raise UserError(
      f'TF_CONFIG: task index {index} is not in the cluster: {kind!r} has '
      f'{len(spec[kind])} address(es), so the index must be in [0, {len(spec[kind])}).'
    )
  for role, addresses in spec.items():
    for address in addresses if isinstance(addresses, list) else [addresses]:
      if not is_address(address):
        raise UserError(
          f'TF_CONFIG: {address!r} in cluster.{role} is not an address; each is a string '
          '"host:port" with a port in [1, 65535], such as "10.0.0.2:2222".'
        )
  chief, workers = list(spec.get('chief', [])), list(spec.get('worker', []))
  position = {'chief': index, 'worker': len(chief) + index}.get(kind, -1)
  return Task(kind, index, chief + workers, position)


def for_worker(addresses: list[str], index: int) -> str:
  """The TF_CONFIG of worker `index` of a cluster of workers only (worker 0 is the chief)."""
  return json.dumps(
    {'cluster': {'worker': list(addresses)}, 'task': {'type': 'worker', 'index': index}}
  )
