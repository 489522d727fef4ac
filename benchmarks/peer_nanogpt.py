"""nanoGPT's own `train.py` against ours on its CPU recipe, whole process, as a user runs both.

  python -m benchmarks.peer_nanogpt                                  # both precisions, alone
  python -m benchmarks.peer_nanogpt --contenders=nanogpt,ours,nanogpt+load:2@19,ours+load:2@19 \\
      --precisions=float32 --rounds=2 --results_name=peer_nanogpt_full   # alone and loaded
  python -m benchmarks.peer_nanogpt --quick                          # checks that it runs
  python -m benchmarks.peer_nanogpt --shape=shakespeare_large --steps=50 --rounds=3 \
      --contenders=nanogpt_autocast,ours --precisions=float32,bfloat16 \
      --results_name=peer_nanogpt_16bit_speed                        # the 16-bit speed

Not a test. nanoGPT (karpathy/nanoGPT) is not part of this project: export its tree beside this
repository (--nanogpt, default ../nanogpt), copy Tiny Shakespeare's input.txt into its
data/shakespeare_char/ and run prepare.py there once. PyTorch lives in its own virtual
environment (--torch_python, default ../torchvenv/bin/python), never in TensorFlow's.

Contenders, each a fresh process, interleaved per precision and round (all see the same machine):
  nanogpt          its README's CPU recipe verbatim (RECIPE below), --dtype=<precision>
  nanogpt_autocast the same with its autocast context on the CPU too (AUTOCAST below): bfloat16
                   arithmetic as torch.autocast gives it; bfloat16 runs only
  nanogpt_compile  the same with --compile=True: torch.compile, inductor's CPU C++ backend; its
                   compilation is inside the whole-process figure and inside iteration 0
  ours             `launch.py --config=configs/nanogpt_cpu.py` (float32, or
                   --config.precision.policy=mixed_bfloat16)
  ours+KEY=VALUE   the same with --config.KEY=VALUE (several: ours+K1=V1+K2=V2); a word
                   env:NAME=VALUE sets an environment variable for that run instead
                   (ours+env:TF_ENABLE_ONEDNN_OPTS=0: Eigen's kernels, trainer/onednn.py)
  C+load:N@P       contender C beside N busy loops (`python -c 'while True: pass'`) at nice P
                   (0-19) or under SCHED_IDLE (P = idle), started in this process's session:
                   with the kernel's autogroup scheduling they compete with the run thread for
                   thread, as other work of the same user would
nanoGPT's train.py ignores --dtype for the math on a CPU (its autocast context is `nullcontext()`
there), so its bfloat16 runs compute in float32; the page says so beside the numbers.

Per run: whole-process wall and CPU-seconds (os.wait4), cores = CPU-s / wall; the time to the
line reporting step 100; nanoGPT's iteration 0 (its evaluation at step 0 and its first step);
the steady step (nanoGPT: the median of its iteration times, evaluations excluded; ours: the
median over the progress lines after the first compiled call); the validation loss each side
reports (nanoGPT: 20 batches; ours: the full split); and, for ours, the XLA programs compiled into
the race's own compile cache, which starts empty (0: all loaded, as a second run of a command).

The page: the section --results_name (default peer_nanogpt) of docs/results/peer_nanogpt.md,
written after every run, so a race cut short keeps the runs it finished.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from benchmarks import results as results_page  # noqa: E402

POLICY = {'float32': 'float32', 'bfloat16': 'mixed_bfloat16'}
RECIPE = (
  'config/train_shakespeare_char.py --device=cpu --eval_iters=20 --log_interval=1 '
  '--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --dropout=0.0'
).split()
EVAL_INTERVAL = 250  # config/train_shakespeare_char.py
# --shape=shakespeare_large: configs/shakespeare_large.py's model at the batch of 16 (its
# memory's matmul-bound shape) against nanoGPT's at the same shape.
LARGE = (
  'config/train_shakespeare_char.py --device=cpu --eval_iters=1 --log_interval=1 '
  '--block_size=256 --batch_size=16 --n_layer=4 --n_head=8 --n_embd=512 --dropout=0.0'
).split()
# nanogpt_autocast: nanoGPT's train.py with its autocast context on a CPU too. Its line
# `ctx = nullcontext() if device_type == 'cpu' else torch.amp.autocast(...)` loses its CPU case
# when the script is read; nothing of nanoGPT is kept here.
AUTOCAST = (
  'import sys; src = open("train.py").read(); '
  'old = "ctx = nullcontext() if device_type == \'cpu\' else "; '
  'assert old in src, "nanoGPT changed: its autocast line was not found"; '
  'sys.argv = ["train.py", *sys.argv[1:]]; '
  'exec(compile(src.replace(old, "ctx = "), "train.py", "exec"), {"__name__": "__main__"})'
)

_NANOGPT = flags.DEFINE_string(
  'nanogpt', os.path.join(ROOT, '..', 'nanogpt'), "Folder of nanoGPT's exported tree."
)
_TORCH_PYTHON = flags.DEFINE_string(
  'torch_python',
  os.path.join(ROOT, '..', 'torchvenv', 'bin', 'python'),
  'Python of the virtual environment with PyTorch.',
)
_DATA = flags.DEFINE_string(
  'data', os.path.join(ROOT, '..', 'shared', 'data', 'tinyshakespeare'), 'Folder of input.txt.'
)
_CONTENDERS = flags.DEFINE_list('contenders', ['nanogpt', 'ours'], 'Contenders, in round order.')
_PRECISIONS = flags.DEFINE_list('precisions', list(POLICY), 'float32 and/or bfloat16.')
_ROUNDS = flags.DEFINE_integer('rounds', 1, 'Interleaved rounds.')
_STEPS = flags.DEFINE_integer('steps', 2000, 'Iterations (--max_iters; ours train.steps).')
_QUICK = flags.DEFINE_bool('quick', False, '20 steps, one round: checks that it runs.')
_SHAPE = flags.DEFINE_enum(
  'shape',
  'nanogpt_cpu',
  ['nanogpt_cpu', 'shakespeare_large'],
  "nanoGPT's CPU recipe (configs/nanogpt_cpu.py), or configs/shakespeare_large.py's model at "
  'batch 16 and nanoGPT at the same shape (steady step only: a cut run).',
)
_OUT = flags.DEFINE_string(
  'out', '', "Folder for the table, peer_nanogpt.json and each run's output; '' = none."
)


def split_load(contender: str) -> tuple[str, int, str]:
  """(the contender without its 'load:N@P' word, N, P); (contender, 0, '0') without one."""
  words = contender.split('+')
  load = [w for w in words if w.startswith('load:')]
  if not load:
    return contender, 0, '0'
  n, _, priority = load[0].removeprefix('load:').partition('@')
  if not n.isdigit() or not (priority in ('', 'idle') or priority.lstrip('-').isdigit()):
    raise app.UsageError(f'--contenders: {load[0]} is not load:N@P (P: a nice value, or idle)')
  return '+'.join(w for w in words if w != load[0]), int(n), priority or '0'


def command(contender: str, precision: str, steps: int, out_dir: str):
  """(argv, cwd, environment variables to set) of one run of `contender` (no load word)."""
  large = _SHAPE.value == 'shakespeare_large'
  if not contender.startswith('ours'):
    script = ['-c', AUTOCAST] if contender == 'nanogpt_autocast' else ['train.py']
    argv = [_TORCH_PYTHON.value, *script, *(LARGE if large else RECIPE)]
    argv += [f'--compile={contender.endswith("compile")}']
    argv += [f'--max_iters={steps}', f'--lr_decay_iters={steps}', f'--dtype={precision}']
    return [*argv, f'--out_dir={out_dir}'], _NANOGPT.value, {}
  words = contender.split('+')[1:]  # 'ours', or 'ours+KEY=VALUE+env:NAME=VALUE+...'
  env = dict(w.removeprefix('env:').split('=', 1) for w in words if w.startswith('env:'))
  config = 'configs/shakespeare_large.py' if large else 'configs/nanogpt_cpu.py'
  argv = [sys.executable, 'launch.py', f'--config={config}', f'--workdir={out_dir}']
  if large:
    argv += ['--config.train.batch_size=16', '--config.train.eval_every=0']
  argv += [f'--config.data.dir={_DATA.value}', f'--config.precision.policy={POLICY[precision]}']
  if steps != 2000 or large:  # a cut run: its warm-up, log and checkpoint cadence fit in it
    spl = min(10 if large else 100, steps)
    argv += [f'--config.train.steps={steps}', f'--config.train.checkpoint_every={steps}']
    argv += [f'--config.optimizer.warmup_steps={min(100, steps // 2)}']
    argv += [f'--config.train.steps_per_loop={spl}', f'--config.train.log_every={spl}']
  return argv + [f'--config.{w}' for w in words if not w.startswith('env:')], ROOT, env


def busy_loops(n: int, priority: str) -> list[subprocess.Popen]:
  """n busy loops at a nice value or, for 'idle', under SCHED_IDLE."""

  def setup() -> None:  # in the child, before it runs Python
    if priority == 'idle':
      os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
      os.nice(int(priority))

  argv = [sys.executable, '-c', 'while True: pass']
  return [subprocess.Popen(argv, preexec_fn=setup) for _ in range(n)]


def stop(loops: list[subprocess.Popen]) -> float:
  """Stops the loops; returns the CPU-seconds they used."""
  cpu = 0.0
  for p in loops:
    p.kill()
    usage = os.wait4(p.pid, 0)[2]
    p.returncode, cpu = -9, cpu + usage.ru_utime + usage.ru_stime
  return cpu


def run(argv: list[str], cwd: str, env: dict[str, str], loops: tuple[int, str]):
  """(time-stamped output lines, wall s, CPU-s of the child, CPU-s the busy loops got)."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', PYTHONUNBUFFERED='1', **env)
  busy = busy_loops(*loops)
  try:
    start = time.perf_counter()
    proc = subprocess.Popen(
      argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = [(time.perf_counter() - start, line.rstrip('\n')) for line in proc.stdout]
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
  finally:
    load_cpu = stop(busy)
  proc.returncode = os.waitstatus_to_exitcode(status)
  if proc.returncode:
    tail = '\n'.join(text for _, text in lines[-15:])
    raise RuntimeError(f'{" ".join(argv[:3])} failed (exit {proc.returncode}):\n{tail}')
  return lines, wall, usage.ru_utime + usage.ru_stime, load_cpu


_ITER = re.compile(r'iter (\d+): loss [\d.]+, time ([\d.]+)ms')
_NANOGPT_VAL = re.compile(r'step (\d+): train loss [\d.]+, val loss ([\d.]+)')
_OURS_STEP = re.compile(r'\] step (\d+)/\d+ ')
_OURS_VAL = re.compile(r'final eval: loss ([\d.]+)')


def parse(lines, ours: bool) -> dict:
  """The figures of one run's output (see the module's docstring)."""
  if ours:
    marks = [(int(m[1]), t) for t, s in lines if (m := _OURS_STEP.search(s))]
    pairs = zip(marks[1:], marks[2:])  # after the first compiled call
    steady = [1000 * (t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in pairs if s1 > s0]
    to_100, iter0 = next((t for s, t in marks if s == 100), None), None
    vals = [float(m[1]) for _, s in lines if (m := _OURS_VAL.search(s))]
  else:
    iters = {int(m[1]): (t, float(m[2])) for t, s in lines if (m := _ITER.search(s))}
    steady = [ms for i, (_, ms) in iters.items() if i > 0 and i % EVAL_INTERVAL]
    to_100 = iters[100][0] if 100 in iters else None
    iter0 = iters[0][1] / 1000 if 0 in iters else None
    vals = [float(m[2]) for _, s in lines if (m := _NANOGPT_VAL.search(s))]
  return {
    'to_step_100_s': to_100,
    'iter0_s': iter0,
    'steady_ms': statistics.median(steady) if steady else None,
    'val_loss': vals[-1] if vals else None,
    'val_kind': 'full split' if ours else '20 batches',
  }


def measure(contender: str, precision: str, steps: int, cache: str) -> dict:
  """One run; ours with XLA's compile cache in `cache` (the race's, empty at its start)."""
  base, n_loops, priority = split_load(contender)
  ours = base.startswith('ours')
  before = set(os.listdir(cache))
  with tempfile.TemporaryDirectory(prefix='peer_nanogpt_') as out_dir:
    argv, cwd, env = command(base, precision, steps, os.path.join(out_dir, 'run'))
    if ours:
      env.setdefault(
        'TF_XLA_FLAGS',
        f'--tf_xla_persistent_cache_directory={cache} --tf_xla_persistent_cache_device_types=CPU',
      )
    lines, wall, cpu, load_cpu = run(argv, cwd, env, (n_loops, priority))
  if _OUT.value:  # the child's output, time-stamped from its start
    os.makedirs(_OUT.value, exist_ok=True)
    name = f'{contender.replace("+", "_")}_{precision}_{time.strftime("%H%M%S")}.log'
    with open(os.path.join(_OUT.value, name), 'w') as f:
      f.writelines(f'{t:9.3f} {text}\n' for t, text in lines)
  compiled = len(set(os.listdir(cache)) - before) if ours else None
  result = dict(contender=contender, precision=precision, steps=steps, wall_s=wall, cpu_s=cpu)
  result.update(cores=cpu / wall, busy_loops_cores=load_cpu / wall, xla_compiled=compiled)
  return {**result, **parse(lines, ours)}


def _fmt(value, spec):
  return '-' if value is None else format(value, spec)


def table(results: list[dict]) -> str:
  """One row per (precision, contender): each run's wall and cores, the medians of the rest."""
  lines = [
    '| precision | contender | runs | wall s | CPU-s | cores | busy loops got (cores) '
    '| to step 100 s | iteration 0 s | steady ms/step | val loss | XLA programs compiled '
    '| ours / this wall |',
    '|' + '---|' * 13,
  ]
  cells: dict = {}
  for r in results:
    cells.setdefault((r['precision'], r['contender']), []).append(r)
  for (precision, contender), rs in cells.items():
    med = lambda k: statistics.median(r[k] for r in rs) if rs[0][k] is not None else None  # noqa: E731
    load_word = [w for w in contender.split('+') if w.startswith('load:')]
    ours = cells.get((precision, '+'.join(['ours', *load_word])))  # ours beside the same load
    ratio = '-'
    if ours and not contender.startswith('ours'):
      ratio = ', '.join(f'{o["wall_s"] / r["wall_s"]:.2f}' for o, r in zip(ours, rs))
    each = lambda k, spec: ', '.join(_fmt(r[k], spec) for r in rs)  # noqa: E731
    lines.append(
      f'| {precision} | {contender} | {len(rs)} | {each("wall_s", ".1f")} '
      f'| {_fmt(med("cpu_s"), ".0f")} | {each("cores", ".2f")} '
      f'| {_fmt(med("busy_loops_cores"), ".2f")} | {_fmt(med("to_step_100_s"), ".1f")} '
      f'| {_fmt(med("iter0_s"), ".1f")} | {_fmt(med("steady_ms"), ".1f")} '
      f'| {_fmt(med("val_loss"), ".4f")} ({rs[0]["val_kind"]}) | {each("xla_compiled", "d")} '
      f'| {ratio} |'
    )
  return '\n'.join(lines)


NOTES = (
  'Wall and cores per run, in round order; the other columns are medians. A row named '
  'C+load:N@P ran beside N busy loops of this session at nice P, or under SCHED_IDLE for P = '
  'idle. Ours keeps its XLA programs in a compile cache that starts empty: a run that compiled '
  'none loaded them all, as the same command run again does. nanoGPT on a CPU computes in '
  "float32 whatever --dtype says (its autocast context is `nullcontext()` for device_type 'cpu'), "
  'so its bfloat16 rows are float32 runs, except nanogpt_autocast, whose autocast context is on '
  'there too; ours under mixed_bfloat16 computes in bfloat16, which '
  "a CPU without AVX512-BF16 or AMX emulates (the header's flags)."
)
NO_BF16 = (
  ' This CPU has neither AVX512-BF16 nor AMX: its bfloat16 rows time emulated arithmetic, so the '
  '16-bit speed (mixed_bfloat16 against float32, ours against autocast) cannot be measured here.'
)


def main(argv):
  del argv
  for contender in _CONTENDERS.value:  # a bad load word stops the race before its first run
    split_load(contender)
  started = results_page.start()
  steps, rounds = (20, 1) if _QUICK.value else (_STEPS.value, _ROUNDS.value)
  plan = [
    (precision, contender)
    for precision in _PRECISIONS.value
    for _ in range(rounds)
    for contender in _CONTENDERS.value
    if precision != 'float32' or contender != 'nanogpt_autocast'  # the same run as nanogpt
  ]
  section = 'peer_nanogpt' + ('' if _SHAPE.value == 'nanogpt_cpu' else f'_{_SHAPE.value}')
  bf16 = {'avx512_bf16', 'amx_bf16'} & set(results_page.machine()['cpu_flags'])
  no_bf16 = '' if bf16 or 'bfloat16' not in _PRECISIONS.value else NO_BF16
  results = []
  with tempfile.TemporaryDirectory(prefix='peer_nanogpt_xla_') as cache:  # ours' first compiles
    for precision, contender in plan:
      results.append(measure(contender, precision, steps, cache))
      done = '' if len(results) == len(plan) else f' Partial: {len(results)} of {len(plan)} runs.'
      results_page.report(
        _OUT.value,
        'peer_nanogpt',
        f'{NOTES}{no_bf16}{done}\n\n{table(results)}',
        results,
        page='peer_nanogpt',
        section=section,
        started=started,
        quick=_QUICK.value,
      )


if __name__ == '__main__':
  app.run(main)
