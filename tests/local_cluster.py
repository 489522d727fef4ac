"""Two local worker processes of one MultiWorkerMirroredStrategy cluster on free loopback ports,
for the multi-worker tests (tests/step/test_distribute.py, its LossScaleOptimizer twin).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess

from conftest import ROOT

ENV = {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2', 'PYTHONPATH': ROOT}


def free_ports(n: int) -> list[int]:
  sockets = [socket.socket() for _ in range(n)]
  for s in sockets:
    s.bind(('127.0.0.1', 0))
  ports = [s.getsockname()[1] for s in sockets]
  for s in sockets:
    s.close()
  return ports


def run_two_workers(argv: list[str], timeout: float = 300) -> list[str]:
  """Runs `argv` as worker 0 and worker 1 of a cluster on two free loopback ports (each with its
  TF_CONFIG) and waits for both, up to `timeout` seconds each; a worker still running then, or
  left running by an error, is killed. Asserts both exited with code 0; returns their logs
  (stdout and stderr)."""
  cluster = {'worker': [f'127.0.0.1:{p}' for p in free_ports(2)]}
  procs = []
  for index in range(2):
    tf_config = json.dumps({'cluster': cluster, 'task': {'type': 'worker', 'index': index}})
    procs.append(
      subprocess.Popen(
        argv,
        env={**ENV, 'TF_CONFIG': tf_config},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
      )
    )
  try:
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-4000:]
  return logs
