"""The performance benchmark: our Trainer against Keras `model.fit`, policies, loss scaling,
steps_per_loop and XLA, model FLOP utilisation and peak memory, for every model in models/.

  python benchmarks/run.py --out=benchmarks/out            # full: 10 interleaved rounds
  python benchmarks/run.py --quick --out=<folder>          # a few steps, 2 rounds (the test)

Method (all in one process per model set, except memory):
  * every contender (a Trainer or a compiled Keras model, each built under its own precision
    policy: benchmarks/contenders.py) is built and warmed up first, and stays built;
  * then `--rounds` interleaved rounds (`in_round_order`), in each the same whole number of
    compiled calls per contender (about `--round_seconds`, fixed after warm-up);
  * each contender's steps/s is reported as the median over rounds, with min and max; ratios
    (ours/fit, overheads, speed-ups) are the median (min, max) of the per-round ratios of the two
    contenders, which were measured seconds apart and so share the machine's load;
  * memory: one subprocess per policy (and train.remat setting, for models with blocks) trains
    `--memory_steps` steps and reports its peak RSS (VmHWM) after the imports, after building
    and after training (benchmarks/memory.py's child, which also measures any size and the
    largest batch within a budget); "step MiB" = after training - after the imports.
Outputs in --out: benchmark.md (tables), benchmark.json (everything), benchmark.png (chart); the
tables also go to docs/results/run.md (benchmarks/results.py: --results_dir, --results_name).
"""

from __future__ import annotations

import glob
import json
import math
import os
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
  "Policies to compare; float32 and the machine's default policy (the one the steps_per_loop "
  'and jit_compile rows use) are always included.',
)
_MEMORY_STEPS = flags.DEFINE_integer(
  'memory_steps', None, 'Steps per memory subprocess (default 50, quick 2); 0 skips memory.'
)

POLICIES = ('float32', 'mixed_bfloat16', 'mixed_float16')
MODES = ('none', 'static', 'dynamic')
STATIC_SCALE = '1024'
COMPUTE_DTYPE = {'float32': 'float32', 'mixed_bfloat16': 'bfloat16', 'mixed_float16': 'float16'}
# Host-callback ops that would mean a sync with Python inside a compiled call.
HOST_OPS = set(
  'PyFunc PyFuncStateless EagerPyFunc PrintV2 Print DebugIdentity DebugIdentityV2 '
  'DebugIdentityV3 CheckNumerics CheckNumericsV2'.split()
)
# Models whose step is long on a CPU: one step per compiled call already amortises the call, and
# 10 would make each round long in emulated float16.
SLOW_MODELS = {'transformer_lm': {'steps_per_loop': 1, 'loop_sweep': (1, 2, 4)}}
# Models with blocks that config.train.remat recomputes (trainer/nn/remat.py): memory is measured
# with it off and on.
REMAT_MODELS = {'transformer_lm'}
# The config a model is measured with when it is not the first configs/*.py naming the model
# (configs/nanogpt_cpu.py, a reference recipe at a much smaller shape, sorts first).
MODEL_CONFIGS = {'transformer_lm': 'shakespeare'}


def default_policy() -> str:
  from trainer.step import precision

  return precision.resolve('auto')[0]


def settings() -> dict:
  quick, seconds, memory_steps = _QUICK.value, _ROUND_SECONDS.value, _MEMORY_STEPS.value
  return {
    'quick': quick,
    'rounds': _ROUNDS.value or (2 if quick else 10),
    'round_seconds': (0.0 if quick else 1.5) if seconds is None else seconds,
    'steps_per_loop': 2 if quick else 10,  # ours and fit (= steps_per_execution)
    'loop_sweep': (1, 2, 4) if quick else (1, 10, 100),
    'matmul_n': 256 if quick else 2048,
    'memory_steps': (2 if quick else 50) if memory_steps is None else memory_steps,
    'policies': [
      p for p in POLICIES if p in _POLICIES.value or p == 'float32' or p == default_policy()
    ],
  }


# ---- models and configs ------------------------------------------------------------------------
def model_config(name: str):
  """configs/<file>.py whose `config.model == name` (MODEL_CONFIGS first; else the schema
  defaults), with data.dir pointed at the local data."""
  from trainer import config as config_lib

  paths = sorted(glob.glob(os.path.join(ROOT, 'configs', '*.py')))
  if name in MODEL_CONFIGS:  # the model's own config first, before reference recipes
    paths.insert(0, os.path.join(ROOT, 'configs', MODEL_CONFIGS[name] + '.py'))
  config, config_file = None, ''
  for path in paths:
    if (candidate := config_lib.load_file(path)).get('model') == name:
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


def auto_mode(policy: str) -> str:
  """The loss scaling `loss_scale='auto'` gives `policy`."""
  return 'dynamic' if policy == 'mixed_float16' else 'none'


def contender_specs(default: str, s: dict) -> list[dict]:
  """Name and build arguments of every contender of one model, in round order."""
  spl = s['steps_per_loop']

  def spec(name, kind, policy=default, **kw):
    return dict(name=name, kind=kind, policy=policy, steps_per_loop=spl, **kw)

  specs = []
  for p in s['policies']:
    specs += [spec(f'ours {p}', 'ours', p), spec(f'fit {p}', 'fit', p, fused=False)]  # fit: Adam
    for mode in MODES:  # the 'auto' one is `ours {p}`
      scale = STATIC_SCALE if mode == 'static' else mode
      if mode != auto_mode(p):
        specs.append(spec(f'ours {p} loss_scale={mode}', 'ours', p, loss_scale=scale))
  # Where ours/fit comes from: the loop alone (both with Keras's update) and fit given our fused
  # update (trainer/optim/fused_optimizers.py); fit with our LossScaleOptimizer / with Keras's.
  specs.append(spec(f'ours {default} optimizer.fused=False', 'ours', fused=False))
  specs.append(spec(f'fit {default} optimizer.fused=True', 'fit', fused=True))
  for lso in ('ours', 'keras'):
    specs.append(spec(f'fit {default} lso={lso}', 'fit', fused=False, lso=lso))
  for n in s['loop_sweep']:
    if n != spl:  # `ours/fit {default}` above
      for kind in ('ours', 'fit'):
        name = f'{kind} {default} steps_per_loop={n}'
        specs.append(dict(spec(name, kind, fused=kind == 'ours'), steps_per_loop=n))
  return specs + [spec(f'ours {default} jit_compile', 'ours', jit=True)]


def in_round_order(built: list, r: int) -> list:
  """The contenders in round `r`'s order: as built in even rounds, reversed in odd ones (A B C,
  C B A, ...). A contender's predecessor can slow it (work the previous one left running, such
  as a dropped `fit` iterator's refill); alternating the order gives every contender of a pair
  each place, and keeps the pair next to each other."""
  return built if r % 2 == 0 else built[::-1]


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


def paired(a: list[float], b: list[float], fn=lambda x, y: x / y) -> dict:
  return summary([fn(x, y) for x, y in zip(a, b)])


def build(name: str, spec: dict, s: dict, base):
  """One contender, built, traced and warmed up; `spec` gains its steps per round."""
  import models
  from benchmarks.contenders import KerasFit, Ours

  trainer_class, spl = models.get_trainer_class(name), spec['steps_per_loop']
  options = ('policy', 'loss_scale', 'steps_per_loop', 'jit', 'fused')
  config = variant(base, **{k: spec[k] for k in options if k in spec})
  start = time.perf_counter()
  if spec['kind'] == 'ours':
    contender = Ours(trainer_class, config)
  else:
    contender = KerasFit(trainer_class, config, lso=spec.get('lso'))
  contender.timed(spl)  # traces and compiles
  probe_steps = spl * max(1, math.ceil((2 if s['quick'] else 10) / spl))
  per_step = contender.timed(probe_steps)[0] / probe_steps
  spec['steps_per_round'] = max(1, round(s['round_seconds'] / (per_step * spl))) * spl
  contender.timed(spec['steps_per_round'])  # one untimed round at the measured length
  spec['build_and_warmup_seconds'] = round(time.perf_counter() - start, 2)
  said = (spec['name'], spec['steps_per_round'], spec['build_and_warmup_seconds'])
  logging.warning('  %-45s %5d steps/round, %.1f s to build and warm up', *said)
  return contender


def bench_model(name: str, s: dict) -> dict:
  if not s['quick']:
    s = {**s, **SLOW_MODELS.get(name, {})}
  import keras
  from benchmarks import flops

  base, default = model_config(name), default_policy()
  specs = contender_specs(default, s)
  logging.warning('%s: building and warming up %d contenders', name, len(specs))
  built = [(spec, build(name, spec, s, base)) for spec in specs]
  ours_default = next(c for sp, c in built if sp['name'] == f'ours {default}')
  flops_per_step = flops.step_flops(ours_default.trainer)
  ops = zip(('host_ops_in_train_loop', 'host_ops_on_skipped_steps_only'), host_ops(ours_default))
  keras.mixed_precision.set_global_policy('float32')

  rates = {spec['name']: [] for spec, _ in built}  # steps per wall-clock second
  cpu_rates = {spec['name']: [] for spec, _ in built}  # steps per CPU second
  for r in range(s['rounds']):
    start = time.perf_counter()
    for spec, contender in in_round_order(built, r):
      wall, cpu = contender.timed(spec['steps_per_round'])
      rates[spec['name']].append(spec['steps_per_round'] / wall)
      cpu_rates[spec['name']].append(spec['steps_per_round'] / cpu)
    took = time.perf_counter() - start
    logging.warning('%s: round %d/%d took %.1f s', name, r + 1, s['rounds'], took)
  for _, contender in built:
    contender.close()

  result = dict(ops, batch_size=base.train.batch_size, default_policy=default, contenders={})
  result.update(steps_per_loop=s['steps_per_loop'], flops_per_step=flops_per_step)
  for spec, _ in built:
    label = spec['name']
    result['contenders'][label] = {
      **{k: v for k, v in spec.items() if k != 'name'},
      'steps_per_sec': summary(rates[label]),
      'rounds': rates[label],
      'steps_per_cpu_sec': summary(cpu_rates[label]),
      'cpu_rounds': cpu_rates[label],
    }
  result.update(comparisons(rates, s, default))  # wall clock: the headline numbers
  result['cpu_time'] = comparisons(cpu_rates, s, default)  # the same, per CPU second
  return result


def comparisons(rates: dict, s: dict, default: str) -> dict:
  """Paired per-round ratios between contenders: ours/fit, loss-scale overheads, speed-ups."""
  out = {'ours_over_fit': {p: paired(rates[f'ours {p}'], rates[f'fit {p}']) for p in s['policies']}}
  for n in s['loop_sweep']:
    if n != s['steps_per_loop']:
      suffix = f'{default} steps_per_loop={n}'
      out['ours_over_fit'][suffix] = paired(rates[f'ours {suffix}'], rates[f'fit {suffix}'])

  def by_mode(p, mode):
    return rates[f'ours {p}' + ('' if mode == auto_mode(p) else f' loss_scale={mode}')]

  overhead = lambda a, b: 100.0 * (a / b - 1.0)  # noqa: E731
  out['loss_scale_overhead_pct'] = {
    p: {m: paired(by_mode(p, 'none'), by_mode(p, m), overhead) for m in ('static', 'dynamic')}
    for p in s['policies']
  }
  fit, fit_fused = rates[f'fit {default}'], rates[f'fit {default} optimizer.fused=True']
  out['fused_optimizer'] = {
    'ours_unfused_over_fit': paired(rates[f'ours {default} optimizer.fused=False'], fit),
    'ours_over_fit_fused': paired(rates[f'ours {default}'], fit_fused),
    'fit_fused_over_fit': paired(fit_fused, fit),
  }
  out['speedup_over_float32'] = {
    p: paired(rates[f'ours {p}'], rates['ours float32']) for p in s['policies']
  }
  out['fit_lso_ours_over_keras'] = paired(
    rates[f'fit {default} lso=ours'], rates[f'fit {default} lso=keras']
  )
  out['jit_speedup'] = paired(rates[f'ours {default} jit_compile'], rates[f'ours {default}'])
  return out


def mfu(result: dict, peaks: dict, policies) -> dict:
  """Achieved FLOP/s of `ours <policy>` over the matmul peak of the policy's compute dtype."""
  out = {}
  for p in policies:
    steps = result['contenders'][f'ours {p}']['steps_per_sec']['median']
    achieved, dtype = result['flops_per_step'] * steps, COMPUTE_DTYPE[p]
    out[p] = {
      'flops_per_sec': achieved,
      'of_peak_dtype': dtype,
      'fraction': achieved / peaks[dtype],
    }
  return out


def memory(name: str, s: dict) -> dict:
  """Peak RSS per policy (and train.remat setting), each in its own subprocess (peak RSS never
  falls within a process): benchmarks/memory.py's child. Keys: the policy, and '<policy> remat'
  for remat on."""
  out = {}
  for policy in s['policies']:
    for remat in (False, True) if name in REMAT_MODELS else (False,):
      spec = dict(model=name, config='', set=[], policy=policy, remat=remat, batch_size=None)
      spec['steps'] = s['memory_steps']
      data = [f'--data_root={_DATA_ROOT.value}', f'--data_dir={",".join(_DATA_DIR.value)}']
      script = os.path.join(ROOT, 'benchmarks', 'memory.py')
      argv = [sys.executable, script, *data, f'--child={json.dumps(spec)}']
      env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
      done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT)
      if done.returncode:
        raise SystemExit(f'memory subprocess for {name} {policy} failed:\n{done.stderr[-2000:]}')
      result = json.loads(done.stdout.strip().splitlines()[-1])
      out[f'{policy} remat' if remat else policy] = result
  return out


def main(argv):
  del argv
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  logging.set_verbosity(logging.WARNING)
  from benchmarks import flops, report
  import models
  import tensorflow as tf

  started = results_page.start()  # the load and CPU counters for the results page, and the clock
  s = settings()
  machine = {**results_page.machine(), 'load_average_at_start': list(os.getloadavg())}
  results = {'machine': machine, 'settings': s, 'peak_flops': {}, 'models': {}}
  names = _MODELS.value or models.available()

  def measure_peaks():  # at the start and the end; the best counts (the machine is shared)
    for dtype, n in (('float32', 1), ('bfloat16', 1), ('float16', 2)):
      peak = flops.matmul_peak(tf.as_dtype(dtype), s['matmul_n'] // n)
      results['peak_flops'][dtype] = max(results['peak_flops'].get(dtype, 0.0), peak)
      logging.warning('matmul peak %s: %.1f GFLOP/s', dtype, results['peak_flops'][dtype] / 1e9)

  # Memory first, while this process is small; --memory_steps=0 skips it.
  memory_mib = {name: memory(name, s) if s['memory_steps'] else {} for name in names}
  measure_peaks()
  for name in names:
    results['models'][name] = bench_model(name, s)
  measure_peaks()
  for name, r in results['models'].items():
    r['memory'] = memory_mib[name]
    r['mfu'] = mfu(r, results['peak_flops'], s['policies'])
  results['wall_seconds'] = round(time.time() - started.wall, 1)
  os.makedirs(_OUT.value, exist_ok=True)
  paths = report.write(results, _OUT.value)
  page = results_page.write('run', report.markdown(results), started=started, quick=s['quick'])
  print('\n'.join(['wrote:', *paths, *([page] if page else [])]))
  print(f'wall time: {results["wall_seconds"]:.0f} s')
  results_page.exit_now()  # everything is written


if __name__ == '__main__':
  app.run(main)
