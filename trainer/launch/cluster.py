"""The cluster of a multi-worker run: TF_CONFIG from `--cluster` and `--task_index`, the checks
made before anything is written, free loopback ports, and the record in the run folder.

  --cluster=host1:2222,host2:2222 --task_index=1
    -> TF_CONFIG {"cluster": {"worker": ["host1:2222", "host2:2222"]},
                  "task": {"type": "worker", "index": 1}}

Worker 0 is the chief (MultiWorkerMirroredStrategy's rule without a 'chief' task). Each check
raises a UserError naming the flag and the culprit, one line and exit code 2 before TensorFlow
starts and before the run folder is touched:
  * an address that is not host:port (port in [1, 65535]), or the same address twice;
  * a task index outside [0, number of workers);
  * this task's port already taken on this host (often the same command and --task_index,
    started twice);
  * a worker count other than the run folder's (cluster.json, written by the chief once the run
    folder is set up; a run folder with checkpoints and no record was trained by one process),
    unless config.train.accept_config_change is set: each worker's shard of every batch, and so
    the run, would change under the resume.
The same index on two *different* hosts cannot be seen from either host before the rendezvous;
there TensorFlow's coordination service fails the run ("... unexpectedly tried to connect with a
different incarnation"), an AbortedError that trainer/launch/peers.py reports in one line.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import os
import socket

from trainer.config import is_address
from trainer.distribute import tf_config
from trainer.errors import UserError

LOOPBACK = '127.0.0.1'


def parse(text: str, flag: str = '--cluster') -> list[str]:
  """'host1:port,host2:port' -> the addresses, in task order; UserError naming the bad one."""
  addresses = [a.strip() for a in text.split(',')]
  for address in addresses:
    if not is_address(address):
      raise UserError(
        f'{flag}={text}: {address!r} is not an address; each is host:port with a port in '
        '[1, 65535], e.g. 10.0.0.2:2222 (comma-separated, worker 0 first)'
      )
  repeated = next((a for i, a in enumerate(addresses) if a in addresses[:i]), None)
  if repeated:
    raise UserError(f'{flag}={text}: {repeated} is listed twice; each worker needs its own port')
  return addresses


def check_index(index: int, addresses: list[str]) -> None:
  if not 0 <= index < len(addresses):
    raise UserError(
      f'--task_index={index} is not in the cluster: --cluster lists {len(addresses)} '
      f'worker(s), so the index is in [0, {len(addresses) - 1}]'
    )


def check_port_free(address: str, who: str) -> None:
  """UserError naming `who` (e.g. '--task_index=1') when this task's port is taken here.
  TensorFlow's server listens on every interface at that port; a loopback address is tried on
  loopback only."""
  host, _, port = address.rpartition(':')
  bind_host = host if _is_loopback(host) else ''
  with socket.socket(socket.AF_INET6 if ':' in bind_host else socket.AF_INET) as s:
    try:
      s.bind((bind_host.strip('[]'), int(port)))
    except OSError as e:
      if e.errno != errno.EADDRINUSE:
        return  # e.g. the host is not one of this machine's: TensorFlow will say so
      raise UserError(
        f'{who}: port {port} of {address} is in use on this host; another '
        'process holds it (the same command with the same task index started twice?). '
        'Stop it, or give this worker a free port in --cluster'
      ) from None


def _is_loopback(host: str) -> bool:
  if host == 'localhost':
    return True
  try:
    return ipaddress.ip_address(host.strip('[]')).is_loopback
  except ValueError:
    return False


def free_ports(n: int) -> list[int]:
  """n distinct ports free on 127.0.0.1 right now (the kernel's choice; held open together so
  that no two are the same, then released for the workers to take)."""
  sockets = [socket.socket() for _ in range(n)]
  try:
    for s in sockets:
      s.bind((LOOPBACK, 0))
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


# ---- the record in the run folder ------------------------------------------------------------
def read_record(workdir: str) -> dict | None:
  path = os.path.join(workdir, tf_config.RECORD)
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as e:
    raise UserError(f'{path}: unreadable ({e}); remove it if the run folder is yours') from None


def trained_by(workdir: str) -> int | None:
  """How many workers trained the run folder: its record (trainer/run/workdir.py writes it),
  else 1 when it holds a checkpoint (one process), else None (nothing to resume)."""
  record = read_record(workdir)
  if record is not None:
    return record.get('workers')
  folder = os.path.join(workdir, 'checkpoints')
  saved = os.path.isdir(folder) and any(n.endswith('.index') for n in os.listdir(folder))
  return 1 if saved else None


def check_record(workdir: str, workers: int, accept_change: bool) -> None:
  """UserError when the run folder was trained by another number of workers (1 -> N included;
  see the module docstring). Other addresses with the same count are fine: a host replaced, new
  free ports."""
  before = trained_by(workdir)
  if before is None or before == workers or accept_change:
    return
  raise UserError(
    f'{workdir}: this run was trained by {before} worker(s), this command starts {workers}: '
    f'the data each worker reads would change under the resume. Start {before}, or pass '
    '--config.train.accept_config_change=true to resume with this cluster'
  )
