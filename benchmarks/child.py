"""What the benchmarks that run cells in fresh processes share (references.py, peer_torch.py,
peer_lockstep.py): a cell in a fresh Python (its JSON result line, with its whole-life wall and
CPU-seconds, tried twice: an intermittent failure of our final eval,
`tf___log_eval() missing 1 required positional argument`, ended some long runs; a retry is a
fresh run, reported as such), and the table and raw results they print and save.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time

from benchmarks import results as results_page

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(command: list[str], env: dict | None = None) -> tuple[dict, float, float]:
  """(the child's last JSON line, wall seconds, CPU-seconds of the child); a retried run's dict
  has 'retried': the first failure."""
  try:
    return _run(command, env)
  except RuntimeError as e:
    print(f'{e}; trying once more', file=sys.stderr, flush=True)
    result, wall, cpu = _run(command, env)
    return {**result, 'retried': str(e)}, wall, cpu


def _run(command, env):
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  start = time.perf_counter()
  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False, env=env)
  wall = time.perf_counter() - start
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  if done.returncode:
    raise RuntimeError(
      f'{" ".join(command[1:4])[:80]} failed (exit {done.returncode}): '
      f'{done.stderr.strip().splitlines()[-3:]}'
    )
  result = json.loads([ln for ln in done.stdout.splitlines() if ln.startswith('{')][-1])
  return result, wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def report(
  out: str,
  stem: str,
  text: str,
  results: list,
  *,
  page: str,
  started: results_page.Start,
  quick: bool = False,
) -> None:
  """Prints the markdown `text` and writes it as the results page docs/results/<page>.md
  (benchmarks/results.py); with `out`, also writes it to <out>/<stem>.md and `results` to
  <out>/<stem>.json."""
  print(text, flush=True)
  results_page.write(page, text, started=started, quick=quick)
  if out:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f'{stem}.md'), 'w') as f:
      f.write(text + '\n')
    with open(os.path.join(out, f'{stem}.json'), 'w') as f:
      json.dump(results, f, indent=1)
