"""Full training runs through launch.py, as a user runs them: the final evaluation, the wall time
and the CPU-seconds of each, the headline of docs/results.md (written as
docs/results/training_runs.md).

  python -m benchmarks.training_runs                            # every run below, one at a time
  python -m benchmarks.training_runs --runs=mnist_mlp --set=train.steps=20 --results_dir=/tmp/r

Each run is `python launch.py --config=... --config.data.dir=...` in its own process and a fresh
temporary workdir, with the config's defaults (seed 0) and only the overrides its row names
(`--set key=value` adds `--config.key=value` to every run). Wall and CPU-seconds are the whole
process: imports, data, tracing, training, the evaluations.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from benchmarks import results as results_page  # noqa: E402  (--results_dir, --results_name)

# name -> (config file, data folder under --data_root, extra launch.py flags)
RUNS = {
  'mnist': ('configs/mnist.py', 'mnist', []),
  'mnist_float16': ('configs/mnist.py', 'mnist', ['--config.precision.policy=mixed_float16']),
  'mnist_mlp': ('configs/mnist_mlp.py', 'mnist', []),
  'shakespeare': ('configs/shakespeare.py', 'tinyshakespeare', []),
}

_RUNS = flags.DEFINE_list('runs', list(RUNS), 'Runs to make, in order.')
_DATA_ROOT = flags.DEFINE_string(
  'data_root', os.path.join(ROOT, '..', 'shared', 'data'), 'Folder of the data folders.'
)
_SET = flags.DEFINE_multi_string('set', [], 'key=value: --config.key=value for every run.')


def command(name: str) -> list[str]:
  config, data, extra = RUNS[name]
  argv = ['launch.py', f'--config={config}', f'--config.data.dir={_DATA_ROOT.value}/{data}']
  return argv + extra + [f'--config.{item}' for item in _SET.value]


def run(name: str) -> dict:
  """One run in a fresh process and workdir: its final eval line, wall and CPU-seconds."""
  argv, env = command(name), dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  start = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix=f'training_runs_{name}_') as workdir:
    full = [sys.executable, *argv, f'--workdir={workdir}']
    done = subprocess.run(full, cwd=ROOT, capture_output=True, text=True, env=env)
  wall = time.perf_counter() - start
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
  finals = [line for line in done.stdout.splitlines() if line.startswith('final eval: ')]
  final = finals[-1][len('final eval: ') :] if finals else 'none'
  if done.returncode:
    final = f'failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}'
  shown = ' '.join(a for a in argv if not a.startswith('--config.data.dir='))
  return {'name': name, 'command': f'python {shown}', 'final': final, 'wall': wall, 'cpu': cpu}


def table(rows: list[dict]) -> str:
  lines = [
    '| run | command (and `--config.data.dir=<data>`) | final eval | wall s | CPU-s |',
    '|---|---|---|---|---|',
  ]
  lines += [
    f'| {r["name"]} | `{r["command"]}` | {r["final"]} | {r["wall"]:.0f} | {r["cpu"]:.0f} |'
    for r in rows
  ]
  return '\n'.join(lines)


def main(argv):
  del argv
  unknown = sorted(set(_RUNS.value) - set(RUNS))
  if unknown:
    raise app.UsageError(f'--runs: unknown {unknown[0]!r}; known: {", ".join(RUNS)}')
  started, rows = results_page.start(), []
  for name in _RUNS.value:
    rows.append(run(name))
    print(table(rows[-1:]).splitlines()[-1], flush=True)
  text = table(rows)
  print(text)
  results_page.write('training_runs', text, started=started)


if __name__ == '__main__':
  app.run(main)
