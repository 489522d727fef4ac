"""nanoGPT's own `train.py` against ours on its CPU recipe, whole process, as a user runs both.

  python -m benchmarks.peer_nanogpt --nanogpt=/work/nanogpt                    # quiet machine
  python -m benchmarks.peer_nanogpt --nanogpt=/work/nanogpt --load=2 \\
      --results_name=peer_nanogpt_loaded                                       # 2 busy loops
  python -m benchmarks.peer_nanogpt --nanogpt=/work/nanogpt --load=2 --load_nice=19 \\
      --results_name=peer_nanogpt_loaded_nice                           # the same at nice 19
  python -m benchmarks.peer_nanogpt --nanogpt=/work/nanogpt --quick            # checks it runs

Not a test. nanoGPT (karpathy/nanoGPT) is not part of this project: export its tree anywhere
(`git archive HEAD | tar -x -C /work/nanogpt`), run its data/shakespeare_char/prepare.py there
once (it reads data/shakespeare_char/input.txt when present: copy Tiny Shakespeare's input.txt
there first), and give the folder with --nanogpt. PyTorch lives in its own virtual environment
(--torch_python), never in TensorFlow's.

Contenders, each a fresh process, interleaved per precision (nanogpt, nanogpt_compile, ours,
nanogpt, ...), so all see the same machine:
  nanogpt          its README's CPU recipe, verbatim: `train.py config/train_shakespeare_char.py
                   --device=cpu --compile=False --eval_iters=20 --log_interval=1 --block_size=64
                   --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000
                   --lr_decay_iters=2000 --dropout=0.0 --dtype=<precision>` (and --out_dir)
  nanogpt_compile  the same with --compile=True: torch.compile, inductor's CPU C++ backend; its
                   compilation is inside the whole-process figure and inside iteration 0
  ours             `launch.py --config=configs/nanogpt_cpu.py` (float32, or
                   --config.precision.policy=mixed_bfloat16)
  ours+KEY=VALUE   the same with --config.KEY=VALUE (several: ours+K1=V1+K2=V2), to race a
                   setting against the config as written; ours+env:NAME=VALUE sets an
                   environment variable for that run (ours+env:TF_ENABLE_ONEDNN_OPTS=0: Eigen's
                   kernels instead of oneDNN's, trainer/onednn.py)
  C+load:N@P       contender C beside N busy loops at priority P: a nice value (0-19) or `idle`
                   (SCHED_IDLE, which runs only when nothing else wants the core): to race one
                   contender quiet and loaded, interleaved (ours,ours+load:2@19,ours+load:2@idle)
nanoGPT's train.py on a CPU ignores --dtype for the math: its autocast context is
`nullcontext()` when device_type is 'cpu', so --dtype=bfloat16 trains in float32 (the page
says so beside the numbers).

Per run: whole-process wall and CPU-seconds (os.wait4 of the child), cores = CPU-s / wall; the
time from the process's start to the line reporting step 100 (both sides print one: nanoGPT's
`iter 100:`, ours the progress line `step 100/`); nanoGPT's iteration-0 time (its evaluation of
step 0, and the compilation for nanogpt_compile, plus the first step); the steady step (nanoGPT:
the median of its per-iteration times, iterations that ran an evaluation excluded; ours: the
median over the 100-step intervals between progress lines after the first compiled call,
including the numerics probe where it runs); each side's final validation loss (nanoGPT: its
20-batch estimate; ours: the full split); for ours, how many XLA programs the run compiled into
the race's own compile cache (trainer/compile_cache.py), a folder that starts empty: 0 when it
loaded every one, as a second run of the same command does (rounds after the first).

--load=N starts N busy loops (`python -c 'while True: pass'`, nice --load_nice, 0 by default) in
this process's session before each run and stops them after: with the kernel's autogroup
scheduling, processes of one session share one scheduling group, so the loops compete with the
run thread for thread, as other work of the same user would (--load_nice=19: work the user
started at low priority); the CPU-seconds they got are reported. A contender's +load:N@P word
sets its own load instead (P: a nice value, or idle for SCHED_IDLE).
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from benchmarks import results as results_page  # noqa: E402

CONTENDERS = ('nanogpt', 'nanogpt_compile', 'ours')
POLICY = {'float32': 'float32', 'bfloat16': 'mixed_bfloat16'}
RECIPE = (
  'config/train_shakespeare_char.py --device=cpu --eval_iters=20 --log_interval=1 '
  '--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --dropout=0.0'
).split()
EVAL_INTERVAL = 250  # config/train_shakespeare_char.py

_NANOGPT = flags.DEFINE_string('nanogpt', '/work/nanogpt', "Folder of nanoGPT's exported tree.")
_TORCH_PYTHON = flags.DEFINE_string(
  'torch_python', '/work/torchvenv/bin/python', 'Python of the virtual environment with PyTorch.'
)
_DATA = flags.DEFINE_string(
  'data', os.path.join(ROOT, '..', 'shared', 'data', 'tinyshakespeare'), 'Folder of input.txt.'
)
_CONTENDERS = flags.DEFINE_list('contenders', list(CONTENDERS), 'Which contenders run.')
_PRECISIONS = flags.DEFINE_list('precisions', list(POLICY), 'float32 and/or bfloat16.')
_EXTRA_PRECISIONS = flags.DEFINE_list(
  'extra_precisions',
  ['float32'],
  'Precisions the contenders other than nanogpt and ours run in (nanoGPT computes in float32 on '
  'a CPU whatever --dtype says, so nanogpt_compile in bfloat16 repeats its float32 run).',
)
_ROUNDS = flags.DEFINE_integer('rounds', 1, 'Interleaved rounds.')
_STEPS = flags.DEFINE_integer('steps', 2000, 'Iterations (--max_iters; ours train.steps).')
_LOAD = flags.DEFINE_integer('load', 0, 'Busy loops running beside each run (0 = none).')
_LOAD_NICE = flags.DEFINE_integer(
  'load_nice', 0, "The busy loops' nice value (19: low-priority work beside the run)."
)
_SET = flags.DEFINE_multi_string('set', [], "key=value overrides of ours' config (--config.KEY).")
_QUICK = flags.DEFINE_bool('quick', False, '20 steps, one round: checks that it runs.')
_OUT = flags.DEFINE_string('out', '', "Folder for peer_nanogpt.json; '' = none.")


def command(
  contender: str, precision: str, steps: int, out_dir: str
) -> tuple[list[str], str, dict[str, str]]:
  """(argv, cwd, environment variables to set) of one run."""
  if contender.startswith('ours'):  # 'ours', or 'ours+KEY=VALUE+env:NAME=VALUE+...'
    words = contender.split('+')[1:]
    env = dict(w.removeprefix('env:').split('=', 1) for w in words if w.startswith('env:'))
    overrides = [*_SET.value, *(w for w in words if not w.startswith('env:'))]
    warmup = min(100, steps // 2)
    argv = [
      sys.executable,
      'launch.py',
      '--config=configs/nanogpt_cpu.py',
      f'--config.data.dir={_DATA.value}',
      f'--config.precision.policy={POLICY[precision]}',
      f'--workdir={out_dir}',
    ]
    if steps != 2000:  # a cut run: its warm-up, log and checkpoint cadence fit in it
      spl = min(100, steps)
      argv += [
        f'--config.train.steps={steps}',
        f'--config.optimizer.warmup_steps={warmup}',
        f'--config.train.steps_per_loop={spl}',
        f'--config.train.log_every={spl}',
        f'--config.train.checkpoint_every={steps}',
      ]
    return argv + [f'--config.{s}' for s in overrides], ROOT, env
  argv = [_TORCH_PYTHON.value, 'train.py', *RECIPE]
  argv += [
    f'--compile={contender == "nanogpt_compile"}',
    f'--max_iters={steps}',
    f'--lr_decay_iters={steps}',
    f'--dtype={precision}',
    f'--out_dir={out_dir}',
  ]
  return argv, _NANOGPT.value, {}


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
  """{thread id: (name, CPU-seconds)} of a live process, from /proc (empty where unreadable)."""
  out, tick = {}, os.sysconf('SC_CLK_TCK')
  try:
    tids = os.listdir(f'/proc/{pid}/task')
  except OSError:
    return out
  for tid in tids:
    try:
      with open(f'/proc/{pid}/task/{tid}/stat') as f:
        stat = f.read()
    except OSError:
      continue
    name = stat[stat.index('(') + 1 : stat.rindex(')')]
    name = 'main thread' if int(tid) == pid else name  # the Python thread that runs the loop
    fields = stat[stat.rindex(')') + 2 :].split()
    out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime, stime
  return out


class ThreadSampler(threading.Thread):
  """Samples a child's per-thread CPU-seconds every `every` s; keeps each thread's latest (a
  thread that ends between samples keeps its last sample)."""

  def __init__(self, pid: int, every: float = 0.5):
    super().__init__(daemon=True)
    self.pid, self.every, self.seen, self.done = pid, every, {}, threading.Event()

  def run(self):
    while not self.done.wait(self.every):
      self.seen.update(thread_cpu(self.pid))

  def by_name(self) -> dict[str, list[float]]:
    """{thread name: CPU-seconds of each thread of that name, largest first}."""
    out: dict[str, list[float]] = {}
    for name, cpu in self.seen.values():
      out.setdefault(name, []).append(round(cpu, 1))
    return {k: sorted(v, reverse=True) for k, v in out.items()}


def run(
  argv: list[str], cwd: str, extra_env: dict[str, str]
) -> tuple[list[tuple[float, str]], float, float, dict]:
  """(time-stamped output lines, wall s, CPU-s of the child and its children, CPU-s per thread
  name)."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2', PYTHONUNBUFFERED='1', **extra_env)
  start = time.perf_counter()
  proc = subprocess.Popen(
    argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )
  sampler = ThreadSampler(proc.pid)
  sampler.start()
  lines = [(time.perf_counter() - start, line.rstrip('\n')) for line in proc.stdout]
  sampler.done.set()
  sampler.join()
  _, status, usage = os.wait4(proc.pid, 0)
  wall = time.perf_counter() - start
  proc.returncode = os.waitstatus_to_exitcode(status)
  if proc.returncode:
    tail = '\n'.join(text for _, text in lines[-15:])
    raise RuntimeError(f'{" ".join(argv[:3])} failed (exit {proc.returncode}):\n{tail}')
  return lines, wall, usage.ru_utime + usage.ru_stime, sampler.by_name()


_ITER = re.compile(r'iter (\d+): loss [\d.]+, time ([\d.]+)ms')
_NANOGPT_VAL = re.compile(r'step (\d+): train loss [\d.]+, val loss ([\d.]+)')
_OURS_STEP = re.compile(r'\] step (\d+)/\d+ ')
_OURS_VAL = re.compile(r'final eval: loss ([\d.]+)')


def step_marks(lines, pattern: re.Pattern) -> list[tuple[int, float]]:
  """(step, seconds from the start) of each output line reporting a step."""
  return [(int(m[1]), t) for t, s in lines if (m := pattern.search(s))]


def parse_nanogpt(lines) -> dict:
  iters = {int(m[1]): (t, float(m[2])) for t, s in lines if (m := _ITER.search(s))}
  vals = [float(m[2]) for _, s in lines if (m := _NANOGPT_VAL.search(s))]
  steady = [ms for i, (_, ms) in iters.items() if i > 0 and i % EVAL_INTERVAL]
  return {
    'to_step_100_s': iters[100][0] if 100 in iters else None,
    'iter0_s': iters[0][1] / 1000 if 0 in iters else None,
    'steady_ms': statistics.median(steady) if steady else None,
    'val_loss': vals[-1] if vals else None,
    'val_kind': '20 batches',
  }


def parse_ours(lines) -> dict:
  marks = step_marks(lines, _OURS_STEP)
  vals = [float(m[1]) for _, s in lines if (m := _OURS_VAL.search(s))]
  steady = [
    1000 * (t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(marks[1:], marks[2:]) if s1 > s0
  ]
  return {
    'to_step_100_s': next((t for s, t in marks if s == 100), None),
    'iter0_s': None,
    'steady_ms': statistics.median(steady) if steady else None,
    'val_loss': vals[-1] if vals else None,
    'val_kind': 'full split',
  }


def split_load(contender: str) -> tuple[str, int, str]:
  """(the contender without its '+load:N@P' word, N, P) of 'C+load:N@P'; else the flags' load."""
  words = contender.split('+')
  load = [w for w in words if w.startswith('load:')]
  if not load:
    return contender, _LOAD.value, str(_LOAD_NICE.value)
  n, _, priority = load[0].removeprefix('load:').partition('@')
  if not n.isdigit() or not (priority in ('', 'idle') or priority.lstrip('-').isdigit()):
    raise app.UsageError(f'--contenders: {load[0]} is not load:N@P (P: a nice value, or idle)')
  return '+'.join(w for w in words if w != load[0]), int(n), priority or '0'


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
    _, _, usage = os.wait4(p.pid, 0)
    p.returncode = -9
    cpu += usage.ru_utime + usage.ru_stime
  return cpu


def programs(folder: str) -> set[str]:
  return set(os.listdir(folder)) if os.path.isdir(folder) else set()


def measure(contender: str, precision: str, steps: int, cache: str) -> dict:
  """One run; ours with XLA's compile cache in `cache` (the race's, emptied at its start)."""
  base, n_loops, priority = split_load(contender)
  with tempfile.TemporaryDirectory(prefix='peer_nanogpt_') as out_dir:
    argv, cwd, env = command(base, precision, steps, os.path.join(out_dir, 'run'))
    if contender.startswith('ours'):
      env.setdefault(
        'TF_XLA_FLAGS',
        f'--tf_xla_persistent_cache_directory={cache} --tf_xla_persistent_cache_device_types=CPU',
      )
    before = programs(cache)
    loops = busy_loops(n_loops, priority)
    try:
      lines, wall, cpu, threads = run(argv, cwd, env)
    finally:
      load_cpu = stop(loops)
  parsed = (parse_ours if contender.startswith('ours') else parse_nanogpt)(lines)
  if _OUT.value:  # the child's output, time-stamped from its start
    os.makedirs(_OUT.value, exist_ok=True)
    name = f'{contender.replace("+", "_")}_{precision}_{time.strftime("%H%M%S")}.log'
    with open(os.path.join(_OUT.value, name), 'w') as f:
      f.writelines(f'{t:9.3f} {text}\n' for t, text in lines)
  return {
    'contender': contender,
    'precision': precision,
    'steps': steps,
    'wall_s': wall,
    'cpu_s': cpu,
    'cores': cpu / wall,
    'busy_loops': n_loops,
    'busy_loops_priority': priority,
    'busy_loops_cores': load_cpu / wall,
    'xla_compiled': len(programs(cache) - before) if contender.startswith('ours') else None,
    **parsed,
    'thread_cpu_s': threads,
  }


def _fmt(value, spec):
  return '-' if value is None else format(value, spec)


def table(results: list[dict]) -> str:
  head = (
    '| precision | contender | runs | wall s | CPU-s | cores | busy loops got (cores) '
    '| to step 100 s | iteration 0 s | steady ms/step | val loss | XLA programs compiled '
    '| ours / this wall |'
  )
  lines = [head, '|' + '---|' * 13]
  cells: dict = {}
  for r in results:
    cells.setdefault((r['precision'], r['contender']), []).append(r)
  for (precision, contender), rs in cells.items():
    med = lambda k: statistics.median(r[k] for r in rs) if rs[0][k] is not None else None
    load_word = [w for w in contender.split('+') if w.startswith('load:')]
    ours = cells.get((precision, '+'.join(['ours', *load_word])))  # ours beside the same load
    ratio = '-'
    if ours and not contender.startswith('ours'):
      ratio = ', '.join(f'{o["wall_s"] / r["wall_s"]:.2f}' for o, r in zip(ours, rs))
    lines.append(
      f'| {precision} | {contender} | {len(rs)} | '
      + ', '.join(f'{r["wall_s"]:.1f}' for r in rs)
      + f' | {_fmt(med("cpu_s"), ".0f")} | '
      + ', '.join(f'{r["cores"]:.2f}' for r in rs)
      + f' | {_fmt(med("busy_loops_cores"), ".2f")} | {_fmt(med("to_step_100_s"), ".1f")} | '
      f'{_fmt(med("iter0_s"), ".1f")} | {_fmt(med("steady_ms"), ".1f")} | '
      f'{_fmt(med("val_loss"), ".4f")} ({rs[0]["val_kind"]}) | '
      + ', '.join(_fmt(r.get('xla_compiled'), 'd') for r in rs)
      + f' | {ratio} |'
    )
  return '\n'.join(lines)


def threads_table(results: list[dict]) -> str:
  """Where each first run's CPU went: CPU-seconds per thread name (each thread of the name),
  the busiest names first, sampled from /proc every half second."""
  lines = ['| precision | contender | CPU-s per thread (name: each thread) |', '|---|---|---|']
  for r in results:
    if r['round'] or not r.get('thread_cpu_s'):
      continue
    names = sorted(r['thread_cpu_s'].items(), key=lambda kv: -sum(kv[1]))
    shown = [
      f'{name} x{len(v)}: {", ".join(f"{c:g}" for c in v[:4])}{", ..." if len(v) > 4 else ""}'
      for name, v in names[:6]
      if sum(v) >= 0.5
    ]
    lines.append(f'| {r["precision"]} | {r["contender"]} | {"; ".join(shown)} |')
  return '\n'.join(lines)


def notes() -> str:
  load = (
    f'{_LOAD.value} busy loop(s) (`python -c "while True: pass"`, nice {_LOAD_NICE.value}, '
    'this session) ran '
    'beside every run'
    if _LOAD.value
    else 'no load of its own (see the header for what else ran)'
  )
  if any('+load:' in c for c in _CONTENDERS.value):
    load += (
      '; a row named C+load:N@P ran beside N busy loops of this session at nice P, or under '
      'SCHED_IDLE for P = idle'
    )
  return (
    f'Background: {load}. Wall and cores per run, in round order; the other columns are '
    'medians. Ours keeps its XLA programs in a compile cache that starts empty: a run that '
    'compiled none loaded them all, as the same command run again does. nanoGPT on a CPU '
    'computes in float32 whatever --dtype says (its autocast context '
    "is `nullcontext()` for device_type 'cpu'), so its bfloat16 rows are float32 runs; ours "
    'under mixed_bfloat16 computes in bfloat16, which a CPU without AVX512-BF16 or AMX '
    "emulates (the header's flags)."
  )


def main(argv):
  del argv
  for contender in _CONTENDERS.value:  # a bad load word stops the race before its first run
    split_load(contender)
  started = results_page.start()
  steps, rounds = (20, 1) if _QUICK.value else (_STEPS.value, _ROUNDS.value)
  plan = [
    (precision, round_, contender)
    for precision in _PRECISIONS.value
    for round_ in range(rounds)
    for contender in _CONTENDERS.value
    if contender in ('nanogpt', 'ours') or precision in _EXTRA_PRECISIONS.value
  ]
  results = []
  cache_dir = tempfile.TemporaryDirectory(prefix='peer_nanogpt_xla_')  # ours' first run compiles
  for precision, round_, contender in plan:
    result = measure(contender, precision, steps, cache_dir.name)
    result['round'] = round_
    print(json.dumps(result), flush=True)
    results.append(result)
    # The page after every run: a run cut short leaves the runs it finished.
    done = '' if len(results) == len(plan) else f' Partial: {len(results)} of {len(plan)} runs.'
    body = f'{notes()}{done}\n\n{table(results)}\n\n{threads_table(results)}'
    results_page.write('peer_nanogpt', body, started=started, quick=_QUICK.value)
    if _OUT.value:
      os.makedirs(_OUT.value, exist_ok=True)
      with open(os.path.join(_OUT.value, 'peer_nanogpt.json'), 'w') as f:
        json.dump(results, f, indent=1)
  cache_dir.cleanup()
  print(body)


if __name__ == '__main__':
  app.run(main)
