"""The performance benchmark: our Trainer against Keras `model.fit`, policies, loss scaling,
steps_per_loop and XLA, model FLOP utilisation and peak memory, for every model in models/.

  python benchmarks/run.py --out=benchmarks/out            # full: 10 interleaved rounds
  python benchmarks/run.py --out=/tmp/bench --quick        # a few steps, 2 rounds (the test)

Method (all in one process per model set, except memory):
  * every contender (a Trainer or a compiled Keras model, each built under its own precision
    policy) is built and warmed up first, and stays built;
  * then `--rounds` interleaved rounds A B C ... C B A ... (the order reversed in every other
    round: a contender's place can matter, see `in_round_order`); in each a contender runs a
    whole number of compiled calls lasting about `--round_seconds` (the count is fixed after warm-up
    and is the same in every round);
  * each contender's steps/s is reported as the median over rounds, with min and max; ratios
    (ours/fit, overheads, speed-ups) are the median (min, max) of the per-round ratios of the two
    contenders, which were measured seconds apart and so share the machine's load;
  * memory: one subprocess per policy (and train.remat setting, for models with blocks) trains
    `--memory_steps` steps and reports its peak RSS (VmHWM) after the imports, after building
    and after training; "step MiB" = after training - after the imports (benchmarks/memory.py
    measures the same at any size, and the largest batch within a budget).
Outputs in --out: benchmark.md (tables), benchmark.json (everything), benchmark.png (chart); the
tables also go to docs/results/run.md (benchmarks/results.py: --results_dir, --results_name).
"""

from __future__ import annotations

import glob
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from absl import app, flags, logging  # noqa: E402

from benchmarks import results as results_page  # noqa: E402  (--results_dir)

_OUT = flags.DEFINE_string('out', os.path.join(ROOT, 'benchmarks', 'out'), 'Output folder.')
_QUICK = flags.DEFINE_bool(
  'quick', False, 'A few steps and 2 rounds: checks that the benchmark runs, numbers mean little.'
)
_MODELS = flags.DEFINE_list('models', [], 'Models (modules in models/); default: all.')
_ROUNDS = flags.DEFINE_integer('rounds', None, 'Interleaved rounds (default 10, quick 2).')
_ROUND_SECONDS = flags.DEFINE_float(
  'round_seconds', None, 'Target seconds per contender per round (default 1.5, quick 0).'
)
_DATA_ROOT = flags.DEFINE_string(
  'data_root',
  os.path.join(ROOT, '..', 'shared', 'data'),
  'Folder holding one data folder per dataset (mnist, ...).',
)
_DATA_DIR = flags.DEFINE_list('data_dir', [], 'model=path overrides of config.data.dir.')
_POLICIES = flags.DEFINE_list(
  'policies',
  ['float32', 'mixed_bfloat16', 'mixed_float16'],
  "Policies to compare; float32 and the machine's default policy "
  '(the one the steps_per_loop and jit_compile rows use) are always '
  'included.',
)
_MEMORY_STEPS = flags.DEFINE_integer(
  'memory_steps', None, 'Steps per memory subprocess (default 50, quick 2); 0 skips memory.'
)
_MEMORY_CHILD = flags.DEFINE_string('memory_child', None, 'Internal: model:policy to measure.')

POLICIES = ('float32', 'mixed_bfloat16', 'mixed_float16')
MODES = ('none', 'static', 'dynamic')
STATIC_SCALE = '1024'
COMPUTE_DTYPE = {'float32': 'float32', 'mixed_bfloat16': 'bfloat16', 'mixed_float16': 'float16'}
# Host-callback ops that would mean a sync with Python inside a compiled call.
HOST_OPS = {
  'PyFunc',
  'PyFuncStateless',
  'EagerPyFunc',
  'PrintV2',
  'Print',
  'DebugIdentity',
  'DebugIdentityV2',
  'DebugIdentityV3',
  'CheckNumerics',
  'CheckNumericsV2',
}


def default_policy() -> str:
  from trainer.step import precision

  return precision.resolve('auto')[0]


# Models whose step takes most of a second on this CPU: one step per compiled call already
# amortises the call (and 10 would make a round last a minute in float16).
SLOW_MODELS = {'transformer_lm': {'steps_per_loop': 1, 'loop_sweep': (1, 2, 4)}}


def model_settings(name: str, s: dict) -> dict:
  return s if s['quick'] else {**s, **SLOW_MODELS.get(name, {})}


def settings() -> dict:
  quick = _QUICK.value
  return {
    'quick': quick,
    'rounds': _ROUNDS.value or (2 if quick else 10),
    'round_seconds': _ROUND_SECONDS.value
    if _ROUND_SECONDS.value is not None
    else (0.0 if quick else 1.5),
    'steps_per_loop': 2 if quick else 10,  # sections 1-3: ours and fit (= steps_per_execution)
    'loop_sweep': (1, 2, 4) if quick else (1, 10, 100),  # section 4
    'matmul_n': 256 if quick else 2048,
    'memory_steps': _MEMORY_STEPS.value
    if _MEMORY_STEPS.value is not None
    else (2 if quick else 50),
    'policies': [
      p for p in POLICIES if p in _POLICIES.value or p == 'float32' or p == default_policy()
    ],
  }


# ---- the machine -------------------------------------------------------------------------------
def machine() -> dict:
  import keras
  import tensorflow as tf

  cpu, flags_ = platform.processor() or 'unknown', set()
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name') and cpu in ('unknown', platform.processor()):
          cpu = line.split(':', 1)[1].strip()
        elif line.startswith('flags'):
          flags_ = set(line.split(':', 1)[1].split())
  except OSError:
    pass
  return {
    'cpu': cpu,
    'cores': os.cpu_count(),
    'cpu_flags': sorted(
      flags_ & {'avx2', 'avx512f', 'avx512_bf16', 'avx512_fp16', 'amx_bf16', 'amx_tile', 'f16c'}
    ),
    'tensorflow': tf.__version__,
    'keras': keras.__version__,
    'python': platform.python_version(),
    'load_average_at_start': list(os.getloadavg()),
  }


# ---- models and configs ------------------------------------------------------------------------
# The config a model is measured with when it is not the first configs/*.py naming the model
# (configs/nanogpt_cpu.py, a reference recipe at a much smaller shape, sorts first).
MODEL_CONFIGS = {'transformer_lm': 'shakespeare'}


def model_config(name: str):
  """configs/<file>.py whose `config.model == name` (MODEL_CONFIGS first; else the schema
  defaults), with data.dir pointed at the local data."""
  from trainer import config as config_lib

  config, config_file = None, ''
  paths = sorted(glob.glob(os.path.join(ROOT, 'configs', '*.py')))
  if name in MODEL_CONFIGS:  # the model's own config first, before reference recipes
    paths.insert(0, os.path.join(ROOT, 'configs', MODEL_CONFIGS[name] + '.py'))
  for path in paths:
    candidate = config_lib.load_file(path)
    if candidate.get('model') == name:
      config, config_file = candidate, os.path.splitext(os.path.basename(path))[0]
      break
  if config is None:
    config = config_lib.defaults()
    config.model = name
  overrides = dict(item.split('=', 1) for item in _DATA_DIR.value)
  if name in overrides:
    config.data.dir = overrides[name]
  elif not config.data.dir:
    root = _DATA_ROOT.value
    folders = sorted(os.listdir(root)) if os.path.isdir(root) else []
    matches = [
      d for d in folders if d in name or (config_file and (d in config_file or config_file in d))
    ]
    if not matches:
      raise SystemExit(
        f'benchmark: no data folder for model {name!r} under {root}; pass '
        f'--data_dir={name}=<folder>'
      )
    config.data.dir = os.path.join(root, matches[0])
  return config


def variant(base, *, policy, loss_scale='auto', steps_per_loop, jit=False, fused=True):
  """The model's config for one contender: effectively endless, constant learning rate,
  logging every 100 steps (or every call when a call is longer), no checkpoints.
  `fused`: config.optimizer.fused (KerasFit builds Keras's own optimizer unless told)."""
  config = base.copy_and_resolve_references()
  config.optimizer.fused = fused
  config.train.steps = 10**9
  config.train.steps_per_loop = steps_per_loop
  config.train.log_every = steps_per_loop * max(1, math.ceil(100 / steps_per_loop))
  config.train.eval_every = 0
  config.train.checkpoint_every = steps_per_loop * 10**6
  config.train.jit_compile = 'true' if jit else 'false'
  config.optimizer.schedule = 'constant'
  config.optimizer.warmup_steps = 0
  config.precision.policy = policy
  config.precision.loss_scale = loss_scale
  return config


def contender_specs(default_policy: str, s: dict) -> list[dict]:
  """Name and build arguments of every contender of one model, in round order."""
  spl = s['steps_per_loop']
  specs = []
  for policy in s['policies']:
    specs.append(dict(name=f'ours {policy}', kind='ours', policy=policy, steps_per_loop=spl))
    # What a Keras user runs: fit with keras.optimizers.Adam (AdamW, SGD).
    specs.append(
      dict(name=f'fit {policy}', kind='fit', policy=policy, steps_per_loop=spl, fused=False)
    )
    for mode in MODES:
      auto = 'dynamic' if policy == 'mixed_float16' else 'none'
      if mode != auto:  # the 'auto' one is `ours {policy}`
        specs.append(
          dict(
            name=f'ours {policy} loss_scale={mode}',
            kind='ours',
            policy=policy,
            steps_per_loop=spl,
            loss_scale=STATIC_SCALE if mode == 'static' else mode,
          )
        )
  # Where ours/fit comes from: the loop alone (both with Keras's update) and fit given our
  # fused update (trainer/optim/fused_optimizers.py).
  specs.append(
    dict(
      name=f'ours {default_policy} optimizer.fused=False',
      kind='ours',
      policy=default_policy,
      steps_per_loop=spl,
      fused=False,
    )
  )
  specs.append(
    dict(
      name=f'fit {default_policy} optimizer.fused=True',
      kind='fit',
      policy=default_policy,
      steps_per_loop=spl,
      fused=True,
    )
  )
  for lso in ('ours', 'keras'):  # fit with our LossScaleOptimizer / with Keras's
    specs.append(
      dict(
        name=f'fit {default_policy} lso={lso}',
        kind='fit',
        policy=default_policy,
        steps_per_loop=spl,
        fused=False,
        lso=lso,
      )
    )
  for n in s['loop_sweep']:
    if n == spl:
      continue  # `ours/fit {default_policy}` above
    for kind in ('ours', 'fit'):
      specs.append(
        dict(
          name=f'{kind} {default_policy} steps_per_loop={n}',
          kind=kind,
          policy=default_policy,
          steps_per_loop=n,
          fused=kind == 'ours',
        )
      )
  specs.append(
    dict(
      name=f'ours {default_policy} jit_compile',
      kind='ours',
      policy=default_policy,
      steps_per_loop=spl,
      jit=True,
    )
  )
  return specs


def in_round_order(built: list, r: int) -> list:
  """The contenders in round `r`'s order: as built in even rounds, reversed in odd ones (A B C,
  C B A, ...). A contender's predecessor can slow it (work the previous one left running, such
  as a dropped `fit` iterator's refill); alternating the order gives every contender of a pair
  each place, and keeps the pair next to each other."""
  return built if r % 2 == 0 else built[::-1]


def mode_name(policy: str, loss_scale: str) -> str:
  if loss_scale == 'auto':
    return 'dynamic' if policy == 'mixed_float16' else 'none'
  return 'static' if loss_scale not in MODES else loss_scale


# ---- measuring ---------------------------------------------------------------------------------
def host_ops(ours) -> tuple[list[str], list[str]]:
  """Host-callback ops in the compiled train loop (graph and its function library): those a
  finite step can run, and those only on the skip branch (the skipped step's report line)."""
  import tensorflow as tf
  from trainer.step.train_step import SKIP_SCOPE

  t = ours.trainer
  iterator = iter(t.strategy.experimental_distribute_dataset(t.datasets.train))  # same spec
  concrete = t.runner.train_loop.compiled.get_concrete_function(
    iterator, tf.constant(ours.steps_per_loop, tf.int64)
  )
  graph_def = concrete.graph.as_graph_def()
  nodes = list(graph_def.node)
  for function in graph_def.library.function:
    nodes.extend(function.node_def)
  found = [n for n in nodes if n.op in HOST_OPS]
  skip_only = sorted({n.op for n in found if SKIP_SCOPE in n.name})
  return sorted({n.op for n in found if SKIP_SCOPE not in n.name}), skip_only


def summary(values) -> dict:
  return {'median': statistics.median(values), 'min': min(values), 'max': max(values)}


def paired(a: list[float], b: list[float], fn) -> dict:
  return summary([fn(x, y) for x, y in zip(a, b)])


def bench_model(name: str, s: dict) -> dict:
  s = model_settings(name, s)
  import keras
  import models
  from benchmarks import flops
  from benchmarks.contenders import KerasFit, Ours

  trainer_class = models.get_trainer_class(name)
  base = model_config(name)
  default = default_policy()
  specs = contender_specs(default, s)
  logging.warning('%s: building and warming up %d contenders', name, len(specs))

  built = []
  for spec in specs:
    config = variant(
      base,
      policy=spec['policy'],
      loss_scale=spec.get('loss_scale', 'auto'),
      steps_per_loop=spec['steps_per_loop'],
      jit=spec.get('jit', False),
      fused=spec.get('fused', True),
    )
    start = time.perf_counter()
    if spec['kind'] == 'ours':
      contender = Ours(trainer_class, config)
    else:
      contender = KerasFit(trainer_class, config, lso=spec.get('lso'))
    spl = spec['steps_per_loop']
    contender.timed(spl)  # traces and compiles
    probe_steps = spl * max(1, math.ceil((2 if s['quick'] else 10) / spl))
    per_step = contender.timed(probe_steps)[0] / probe_steps
    calls = max(1, round(s['round_seconds'] / (per_step * spl)))
    spec = dict(spec, steps_per_round=calls * spl, build_and_warmup_seconds=0.0)
    contender.timed(spec['steps_per_round'])  # one untimed round at the measured length
    spec['build_and_warmup_seconds'] = round(time.perf_counter() - start, 2)
    logging.warning(
      '  %-45s %5d steps/round, %.1f s to build and warm up',
      spec['name'],
      spec['steps_per_round'],
      spec['build_and_warmup_seconds'],
    )
    built.append((spec, contender))

  ours_default = next(c for sp, c in built if sp['name'] == f'ours {default}')
  flops_per_step = flops.step_flops(ours_default.trainer)
  found_host_ops, skip_only_host_ops = host_ops(ours_default)
  keras.mixed_precision.set_global_policy('float32')

  rates = {spec['name']: [] for spec, _ in built}  # steps per wall-clock second
  cpu_rates = {spec['name']: [] for spec, _ in built}  # steps per CPU second
  for r in range(s['rounds']):
    start = time.perf_counter()
    for spec, contender in in_round_order(built, r):
      wall, cpu = contender.timed(spec['steps_per_round'])
      rates[spec['name']].append(spec['steps_per_round'] / wall)
      cpu_rates[spec['name']].append(spec['steps_per_round'] / cpu)
    logging.warning(
      '%s: round %d/%d took %.1f s', name, r + 1, s['rounds'], time.perf_counter() - start
    )
  for _, contender in built:
    contender.close()

  result = {
    'batch_size': base.train.batch_size,
    'default_policy': default,
    'steps_per_loop': s['steps_per_loop'],
    'flops_per_step': flops_per_step,
    'host_ops_in_train_loop': found_host_ops,
    'host_ops_on_skipped_steps_only': skip_only_host_ops,
    'contenders': {},
  }
  for spec, _ in built:
    name_ = spec['name']
    result['contenders'][name_] = {
      **{k: v for k, v in spec.items() if k != 'name'},
      'steps_per_sec': summary(rates[name_]),
      'rounds': rates[name_],
      'steps_per_cpu_sec': summary(cpu_rates[name_]),
      'cpu_rounds': cpu_rates[name_],
    }
  result.update(comparisons(rates, s, default))  # wall clock: the headline numbers
  result['cpu_time'] = comparisons(cpu_rates, s, default)  # the same, per CPU second
  return result


def comparisons(rates: dict, s: dict, default: str) -> dict:
  """Paired per-round ratios between contenders: ours/fit, loss-scale overheads, speed-ups."""
  ratio = lambda a, b: a / b
  out = {
    'ours_over_fit': {
      p: paired(rates[f'ours {p}'], rates[f'fit {p}'], ratio) for p in s['policies']
    }
  }
  for n in s['loop_sweep']:
    if n != s['steps_per_loop']:
      out['ours_over_fit'][f'{default} steps_per_loop={n}'] = paired(
        rates[f'ours {default} steps_per_loop={n}'],
        rates[f'fit {default} steps_per_loop={n}'],
        ratio,
      )

  def by_mode(policy, mode):
    auto = 'dynamic' if policy == 'mixed_float16' else 'none'
    return rates[f'ours {policy}' if mode == auto else f'ours {policy} loss_scale={mode}']

  out['loss_scale_overhead_pct'] = {
    p: {
      m: paired(by_mode(p, 'none'), by_mode(p, m), lambda a, b: 100.0 * (a / b - 1.0))
      for m in ('static', 'dynamic')
    }
    for p in s['policies']
  }
  out['fused_optimizer'] = {
    'ours_unfused_over_fit': paired(
      rates[f'ours {default} optimizer.fused=False'], rates[f'fit {default}'], ratio
    ),
    'ours_over_fit_fused': paired(
      rates[f'ours {default}'], rates[f'fit {default} optimizer.fused=True'], ratio
    ),
    'fit_fused_over_fit': paired(
      rates[f'fit {default} optimizer.fused=True'], rates[f'fit {default}'], ratio
    ),
  }
  out['speedup_over_float32'] = {
    p: paired(rates[f'ours {p}'], rates['ours float32'], ratio) for p in s['policies']
  }
  out['fit_lso_ours_over_keras'] = paired(
    rates[f'fit {default} lso=ours'], rates[f'fit {default} lso=keras'], ratio
  )
  out['jit_speedup'] = paired(rates[f'ours {default} jit_compile'], rates[f'ours {default}'], ratio)
  return out


def mfu(result: dict, peaks: dict, policies) -> dict:
  """Achieved FLOP/s of `ours <policy>` over the matmul peak of the policy's compute dtype."""
  out = {}
  for p in policies:
    achieved = (
      result['flops_per_step'] * result['contenders'][f'ours {p}']['steps_per_sec']['median']
    )
    out[p] = {
      'flops_per_sec': achieved,
      'of_peak_dtype': COMPUTE_DTYPE[p],
      'fraction': achieved / peaks[COMPUTE_DTYPE[p]],
    }
  return out


# Models with blocks that config.train.remat recomputes (trainer/nn/remat.py): memory is measured
# with it off and on.
REMAT_MODELS = {'transformer_lm'}


def memory(name: str, s: dict) -> dict:
  """Peak RSS per policy (and train.remat setting), each in its own subprocess (peak RSS never
  falls within a process). Keys: the policy, and '<policy> remat' for remat on."""
  out = {}
  for policy, remat in [
    (p, r) for p in s['policies'] for r in ((False, True) if name in REMAT_MODELS else (False,))
  ]:
    argv = [
      sys.executable,
      os.path.abspath(__file__),
      f'--memory_child={name}:{policy}:{int(remat)}',
      f'--memory_steps={s["memory_steps"]}',
      f'--data_root={_DATA_ROOT.value}',
    ]
    argv += [f'--data_dir={d}' for d in _DATA_DIR.value]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
    done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode:
      raise SystemExit(f'memory subprocess for {name} {policy} failed:\n{done.stderr[-2000:]}')
    out[f'{policy} remat' if remat else policy] = json.loads(done.stdout.strip().splitlines()[-1])
  return out


def peak_rss_mib() -> float:
  """This process's peak resident set: VmHWM from /proc/self/status (reset by exec, unlike
  ru_maxrss, which Linux carries over from the forking parent), else ru_maxrss."""
  try:
    with open('/proc/self/status') as f:
      for line in f:
        if line.startswith('VmHWM:'):
          return int(line.split()[1]) / 1024.0  # kB
  except OSError:
    pass
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def memory_child(target: str, steps: int) -> None:
  """Builds model:policy:remat `target` at its config's batch, trains `steps` steps in one
  compiled call, prints the peak RSS (MiB) after the imports, after building and after training
  as one JSON line."""
  import tempfile

  import models

  imported = peak_rss_mib()
  name, policy, remat = target.split(':')
  config = variant(model_config(name), policy=policy, steps_per_loop=1)
  config.train.remat = bool(int(remat))
  trainer_class = models.get_trainer_class(name)
  with tempfile.TemporaryDirectory() as workdir:
    trainer = trainer_class(config, workdir)
    built = peak_rss_mib()
    iterator = iter(trainer.strategy.experimental_distribute_dataset(trainer.datasets.train))
    trainer.runner.train_loop.run(iterator, steps)
    int(trainer.global_step.numpy())
  peak = peak_rss_mib()
  print(
    json.dumps(
      {
        'batch_size': config.train.batch_size,
        'steps': steps,
        'imported_mib': imported,
        'built_mib': built,
        'peak_mib': peak,
        'step_mib': peak - imported,
      }
    )
  )


def main(argv):
  del argv
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  if _MEMORY_CHILD.value:
    logging.set_verbosity(logging.ERROR)
    memory_child(_MEMORY_CHILD.value, _MEMORY_STEPS.value)
    results_page.exit_now()  # its line is printed
  logging.set_verbosity(logging.WARNING)
  from benchmarks import flops, report
  import models

  started = results_page.start()  # the load and CPU counters for the results page, and the clock
  s = settings()
  results = {'machine': machine(), 'settings': s, 'peak_flops': {}, 'models': {}}
  memory_mib = {}
  names = _MODELS.value or models.available()
  import tensorflow as tf

  def measure_peaks():  # at the start and the end; the best counts (the machine is shared)
    for dtype, n in (
      ('float32', s['matmul_n']),
      ('bfloat16', s['matmul_n']),
      ('float16', s['matmul_n'] // 2),
    ):
      value = max(results['peak_flops'].get(dtype, 0.0), flops.matmul_peak(tf.as_dtype(dtype), n))
      results['peak_flops'][dtype] = value
      logging.warning('matmul peak %s: %.1f GFLOP/s', dtype, value / 1e9)

  for name in names:  # first, while this process is small; --memory_steps=0 skips memory
    memory_mib[name] = memory(name, s) if s['memory_steps'] else {}
  measure_peaks()
  for name in names:
    results['models'][name] = bench_model(name, s)
  measure_peaks()
  for name in names:
    r = results['models'][name]
    r['memory'] = memory_mib[name]
    r['mfu'] = mfu(r, results['peak_flops'], s['policies'])
  results['wall_seconds'] = round(time.time() - started.wall, 1)
  os.makedirs(_OUT.value, exist_ok=True)
  paths = report.write(results, _OUT.value)
  page = results_page.write('run', report.markdown(results), started=started, quick=s['quick'])
  paths += [page] if page else []
  print('\n'.join(['wrote:'] + paths))
  print(f'wall time: {results["wall_seconds"]:.0f} s')
  results_page.exit_now()  # everything is written


if __name__ == '__main__':
  app.run(main)
