"""Training memory per precision policy and gradient-checkpointing setting, and the largest batch
that fits a budget; with --account, what the backward pass keeps, tensor by tensor.

  # peak memory of a training step, per policy and train.remat (a subprocess each)
  python benchmarks/memory.py --model=transformer_lm \
      --set=model_config.context=512 --set=model_config.d_model=256 --batch_size=32
  # the largest batch that trains within 4 GiB, per policy and setting (bisection)
  python benchmarks/memory.py --model=transformer_lm --set=... --budget_mib=4096
  # what the tape keeps for the backward pass, summed by dtype and by layer
  python benchmarks/memory.py --model=transformer_lm --set=... --account
  # steps/s per policy and setting, interleaved rounds in one process, with MFU
  python benchmarks/memory.py --model=transformer_lm --set=... --time_rounds=5
  # the step's memory by component, per setting (label:policy,dotted=value,...)
  python benchmarks/memory.py --set=... --breakdown \
      --setting='f32:float32' \
      --setting='bf16 sr:mixed_bfloat16,precision.master_weights=bfloat16_sr'

Method (docs/guides/memory.md says what each figure means). Memory: each (policy, remat) runs in
a fresh subprocess (peak RSS never falls within a process) that imports TensorFlow, Keras and
the project, reads its peak resident set (VmHWM), builds the trainer, trains one step (traced
there) and --steps more in one compiled call, and reads VmHWM again: "step MiB" is the peak after
training minus the peak after the imports; "step - build MiB" also subtracts what building alone
needed; "working MiB", the step working memory, is the peak of TensorFlow's CPU allocator during
the --steps steps over what it held before them (trainer/run/race.py's working_mib, as --race
measures it): the tensors a step needs beyond the weights and the optimizer state, without the
traced program, the input pipeline and the runtime, which a 16-bit policy does not shrink. The
budget search doubles the batch until a run exceeds the budget (the parent polls the child's
VmRSS and kills it past the budget, so a search never swaps), then bisects to
--budget_resolution.
Account: every tensor the forward pass of one traced gradient computation makes and a gradient
op reads (what the tape keeps alive), summed by dtype and by layer: exact for the graph, silent
about the allocator. Breakdown: a subprocess per --setting on TF's BFC allocator (unless
--noallocator): the variables' bytes, what is kept for backward, the allocator's peak during the
steps and what lies beyond it, and the median seconds per step. Time: every setting built and
warmed up in this one process, then --time_rounds interleaved rounds; ratios are medians of
per-round pairs, which share the machine's load.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from absl import app, flags, logging  # noqa: E402

from benchmarks import overrides as config_overrides  # noqa: E402
from benchmarks import results as results_page  # noqa: E402  (--results_dir, --results_name)
from benchmarks import run  # noqa: E402  (its flags --data_root, --data_dir apply here too)

_MODEL = flags.DEFINE_string('model', 'transformer_lm', 'Model (module in models/).')
_CONFIG = flags.DEFINE_string('config', '', "Config file (default: benchmarks/run.py's).")
_POLICY_LIST = flags.DEFINE_list('policy', ['float32', 'mixed_bfloat16'], 'Policies.')
_REMAT = flags.DEFINE_list('remat', ['false', 'true'], 'train.remat settings.')
_SET = flags.DEFINE_multi_string('set', [], 'dotted=value overrides: model_config.context=512.')
_BATCH = flags.DEFINE_integer('batch_size', None, "Global batch (default: the config's).")
_STEPS = flags.DEFINE_integer('steps', 2, 'Steps trained per memory subprocess.')
_BUDGET = flags.DEFINE_integer('budget_mib', 0, 'The largest batch within this step MiB; 0 = off.')
_RESOLUTION = flags.DEFINE_integer('budget_resolution', 4, 'Bisection ends at this batch interval.')
_ACCOUNT = flags.DEFINE_bool('account', False, 'What the backward pass keeps, tensor by tensor.')
_TIME_ROUNDS = flags.DEFINE_integer('time_rounds', 0, 'Interleaved timing rounds; 0 = off.')
_ROUND_STEPS = flags.DEFINE_integer('round_steps', 3, 'Steps per contender per timing round.')
_BREAKDOWN = flags.DEFINE_bool('breakdown', False, "The step's memory by component, per --setting.")
_SETTINGS = flags.DEFINE_multi_string(
  'setting', [], 'A row: label:policy[,dotted=value...], e.g. "f32 remat:float32,train.remat=true".'
)
_ALLOCATOR = flags.DEFINE_bool(
  'allocator', True, "--breakdown on TF's BFC allocator (its peak is then known; RSS differs)."
)
_JSON = flags.DEFINE_string('json_out', '', 'Also write the results here as JSON.')
_CHILD = flags.DEFINE_string('child', '', 'Internal: JSON spec of one memory measurement.')


def status_mib(field: str, pid='self') -> float:
  """A memory line of /proc/<pid>/status, MiB (0 where unreadable): VmHWM, the peak resident set
  (reset by exec); VmRSS, the resident set now."""
  try:
    with open(f'/proc/{pid}/status') as f:
      return next(int(line.split()[1]) / 1024.0 for line in f if line.startswith(field + ':'))
  except (OSError, StopIteration):
    return 0.0


def flag_spec(policy: str, remat: bool, extra=()) -> dict:
  """One measurement as the flags ask for it: under `policy` and `remat`, `extra` overrides."""
  spec = dict(model=_MODEL.value, config=_CONFIG.value, set=_SET.value + list(extra))
  return dict(spec, policy=policy, remat=remat, batch_size=_BATCH.value, steps=_STEPS.value)


def build_config(spec: dict):
  """The benchmark's contender config (endless, constant rate, no checkpoints) of a measurement:
  the model's config (or spec['config']), its policy, remat, overrides and batch."""
  from trainer import config as config_lib

  if spec['config']:
    base = config_lib.load_file(os.path.join(ROOT, spec['config']))
    if not base.data.dir:
      data = 'mnist' if 'mnist' in base.model else 'tinyshakespeare'
      base.data.dir = os.path.join(run._DATA_ROOT.value, data)
  else:
    base = run.model_config(spec['model'])
  config = run.variant(base, policy=spec['policy'], steps_per_loop=1)
  config.train.remat = spec['remat']
  # After `variant`, so that e.g. train.jit_compile=true applies.
  config_overrides.apply(config, spec['set'])
  if spec['batch_size']:
    config.train.batch_size = spec['batch_size']
  return config


def weight_bytes(variables) -> int:
  """Bytes of `variables` as stored (a bfloat16 master weight counts 2 per element)."""
  import numpy as np
  import tensorflow as tf

  return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in variables)


def gradient_graph(trainer):
  """The graph of one gradient computation of the trainer's loss at one batch of its data."""
  import tensorflow as tf

  variables = trainer.model.trainable_variables

  @tf.function
  def grads(batch):
    with tf.GradientTape() as tape:
      loss, _ = trainer.compute_loss(batch, training=True)
      loss = tf.reduce_mean(loss)
    return loss, tape.gradient(loss, variables)

  return grads.get_concrete_function(next(iter(trainer.datasets.train))).graph


def kept_bytes(trainer) -> int:
  """Bytes of the forward tensors one gradient computation keeps for the backward pass."""
  import numpy as np

  kept = kept_for_backward(gradient_graph(trainer))
  return sum(
    int(np.prod(t.shape.as_list())) * t.dtype.size for t in kept if t.shape.is_fully_defined()
  )


def child(spec: dict) -> None:
  """One memory measurement (runs in its own process): prints one JSON line."""
  import models  # noqa: F401  (the imports whose memory is the baseline)
  import keras  # noqa: F401
  import tensorflow as tf
  from trainer.run import race

  imported = status_mib('VmHWM')
  config = build_config(spec)
  trainer_class = models.get_trainer_class(config.model)
  extra = {}
  with tempfile.TemporaryDirectory() as workdir:
    trainer = trainer_class(config, workdir)
    built = status_mib('VmHWM')
    if os.environ.get('TF_CPU_ALLOCATOR_USE_BFC'):  # the allocator's peak: the steps' only
      tf.config.experimental.reset_memory_stats('CPU:0')
    iterator = iter(trainer.strategy.experimental_distribute_dataset(trainer.datasets.train))
    trainer.runner.train_loop.run(iterator, 1)  # traced here
    int(trainer.global_step.numpy())
    if spec.get('breakdown'):
      from trainer.optim import low_precision

      times = []
      for _ in range(spec['steps']):
        start = time.perf_counter()
        trainer.runner.train_loop.run(iterator, 1)
        int(trainer.global_step.numpy())
        times.append(time.perf_counter() - start)
      extra.update(
        step_seconds=statistics.median(times),
        weights_mib=weight_bytes(trainer.model.weights) / 2**20,
        state_mib=low_precision.state_bytes(trainer.optimizer) / 2**20,
        kept_mib=kept_bytes(trainer) / 2**20,
        params=trainer.model.count_params(),
      )
    else:

      def steps():
        trainer.runner.train_loop.run(iterator, spec['steps'])
        int(trainer.global_step.numpy())  # the steps have run

      extra['working_mib'] = race.working_mib(steps)
  peak = status_mib('VmHWM')
  if os.environ.get('TF_CPU_ALLOCATOR_USE_BFC'):  # TF's own account of live tensor bytes
    extra['allocator_peak_mib'] = tf.config.experimental.get_memory_info('CPU:0')['peak'] / 2**20
  mib = dict(imported_mib=imported, built_mib=built, peak_mib=peak, step_mib=peak - imported)
  print(json.dumps({**extra, **mib, 'step_minus_build_mib': peak - built}))


def measure(policy: str, remat: bool, batch_size, kill_mib=0.0, extra=(), breakdown=False) -> dict:
  """Runs `child` in a subprocess; {'fits': False} when its resident set passed `kill_mib`
  (killed then). `extra`: more dotted=value overrides; `breakdown`: the components too."""
  spec = dict(flag_spec(policy, remat, extra), batch_size=batch_size, breakdown=breakdown)
  data = [f'--data_root={run._DATA_ROOT.value}', f'--data_dir={",".join(run._DATA_DIR.value)}']
  argv = [sys.executable, os.path.abspath(__file__), *data, f'--child={json.dumps(spec)}']
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  if breakdown and _ALLOCATOR.value:
    env['TF_CPU_ALLOCATOR_USE_BFC'] = 'true'
  with tempfile.TemporaryFile('w+') as out, tempfile.TemporaryFile('w+') as err:
    proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True, env=env, cwd=ROOT)
    while proc.poll() is None:
      time.sleep(0.2)
      if kill_mib and status_mib('VmRSS', proc.pid) > kill_mib:
        proc.kill()
        proc.wait()
        return {'fits': False, 'batch_size': batch_size}
    out.seek(0)
    err.seek(0)
    if proc.returncode:
      raise SystemExit(
        f'memory: {policy} remat={remat} batch={batch_size} failed:\n{err.read()[-2000:]}'
      )
    result = json.loads(out.read().strip().splitlines()[-1])
  return {'fits': True, 'batch_size': batch_size, **result}


def largest_batch(policy: str, remat: bool, budget: float, start: int) -> dict:
  """Largest batch whose step MiB is within `budget`: doubling, then bisection. The kill limit is
  the budget plus a generous import baseline (the child reports its own baseline at the end)."""
  kill_limit = budget + 1024  # imports are < 1 GiB; the exact check uses the child's numbers
  tried = {}

  def fits(batch):
    r = measure(policy, remat, batch, kill_limit)
    ok = r['fits'] and r.get('step_mib', 1e18) <= budget
    tried[batch] = r.get('step_mib')
    said = f'{r["step_mib"]:.0f} MiB' if 'step_mib' in r else 'over the limit, killed'
    logging.warning('  %s remat=%s batch %d: %s', policy, remat, batch, said)
    return ok

  low, high = 0, start
  while fits(high):
    low, high = high, high * 2
  while high - low > _RESOLUTION.value:
    mid = (low + high) // 2
    if fits(mid):
      low = mid
    else:
      high = mid
  tried_mib = {str(k): v for k, v in sorted(tried.items())}
  return {'largest_batch': low, 'first_too_large': high, 'tried_step_mib': tried_mib}


def kept_for_backward(graph) -> list:
  """The tensors a gradient computation keeps from its forward pass, each buffer once.

  `graph`: a traced function whose first output is the loss and whose other outputs are
  gradients. The forward pass is every op the loss depends on; the backward pass is every other
  op the gradients depend on; kept are the forward tensors a backward op reads (Identity,
  IdentityN and Reshape outputs share their input's buffer and count as it).
  """

  def ancestors(tensors):
    seen, todo = set(), [t.op for t in tensors]
    while todo:
      op = todo.pop()
      if op.name not in seen:
        seen.add(op.name)
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    return seen

  forward = ancestors(graph.outputs[:1])
  needed = ancestors(graph.outputs[1:])

  def buffer(t):
    while t.op.type in ('Identity', 'IdentityN', 'Reshape', 'Squeeze', 'ExpandDims'):
      t = t.op.inputs[t.value_index if t.op.type == 'IdentityN' else 0]
    return t

  kept = {}
  for op in graph.get_operations():
    if op.name in forward or op.name not in needed:
      continue
    for t in op.inputs:
      t = buffer(t)
      if t.op.name in forward and t.op.type not in (
        'Const',
        'ReadVariableOp',
        'Placeholder',
        'Shape',
        'VarHandleOp',
      ):
        kept[t.name] = t
  return list(kept.values())


def account(policy: str, remat: bool) -> dict:
  """What the tape keeps for the backward pass: forward tensors read by gradient ops."""
  import collections

  import models
  import numpy as np

  config = build_config(flag_spec(policy, remat))
  with tempfile.TemporaryDirectory() as workdir:
    trainer = models.get_trainer_class(config.model)(config, workdir)
    kept = [t for t in kept_for_backward(gradient_graph(trainer)) if t.shape.is_fully_defined()]
  by_dtype, by_layer, rows = collections.Counter(), collections.Counter(), []
  for t in kept:
    size, parts = int(np.prod(t.shape.as_list())) * t.dtype.size, t.name.split('/')
    by_dtype[t.dtype.name] += size
    # model/layer/...: the model's top-level layer; else (the loss) the op type
    by_layer[parts[1] if len(parts) > 2 else f'(outside the model) {t.op.type}'] += size
    rows.append((size, t.name, t.dtype.name, t.shape.as_list(), t.op.type))
  rows.sort(reverse=True)
  mib = lambda b: round(b / 2**20, 1)
  return {
    'total_mib': mib(sum(by_dtype.values())),
    'by_dtype_mib': {k: mib(v) for k, v in by_dtype.most_common()},
    'by_layer_mib': {k: mib(v) for k, v in by_layer.most_common(12)},
    'largest': [
      {'mib': mib(s), 'tensor': n, 'dtype': d, 'shape': sh, 'op': o} for s, n, d, sh, o in rows[:12]
    ],
    # one block, every tensor: what a block keeps (models with blocks named block0...)
    'block0': [
      f'{mib(s)} MiB {d} {sh} {n.split("block0_1/", 1)[-1]} ({o})'
      for s, n, d, sh, o in rows
      if 'block0_1/' in n
    ],
  }


def timing(settings: list[tuple]) -> dict:
  """steps/s per (policy, remat), or per (label, policy, remat, overrides) from --setting,
  interleaved rounds in this process, and MFU."""
  import keras
  import models
  import tensorflow as tf
  from benchmarks import flops
  from benchmarks.contenders import Ours

  built, policies = [], {}
  for setting in settings:
    key, policy, remat, extra = (setting, *setting, ()) if len(setting) == 2 else setting
    config = build_config(flag_spec(policy, remat, extra))
    contender = Ours(models.get_trainer_class(config.model), config)
    for _ in range(2):  # traced, then warm
      contender.timed(1)
    built.append((key, contender))
    policies[key] = policy
    logging.warning('built %s', key)
  step_flops = flops.step_flops(built[0][1].trainer)
  keras.mixed_precision.set_global_policy('float32')
  rates = {k: [] for k, _ in built}
  for r in range(_TIME_ROUNDS.value):
    for key, contender in built:
      wall, _ = contender.timed(_ROUND_STEPS.value)
      rates[key].append(_ROUND_STEPS.value / wall)
    logging.warning('round %d/%d', r + 1, _TIME_ROUNDS.value)
  for _, contender in built:
    contender.close()
  peaks = {d: flops.matmul_peak(tf.as_dtype(d), 1024) for d in ('float32', 'bfloat16')}
  base = rates[built[0][0]]
  out = {'flops_per_step': step_flops, 'matmul_peak_flops': peaks, 'settings': {}}
  for key, values in rates.items():
    dtype = 'bfloat16' if policies[key] == 'mixed_bfloat16' else 'float32'
    median = statistics.median(values)
    off = rates.get((policies[key], False)) if isinstance(key, tuple) else None  # remat off
    out['settings'][f'{key[0]} remat={key[1]}' if isinstance(key, tuple) else key] = {
      'steps_per_sec': median,
      'rounds': values,
      'x_first': statistics.median(a / b for a, b in zip(values, base)),
      'step_time_x_remat_off': statistics.median(b / a for a, b in zip(values, off))
      if off
      else None,
      'mfu': step_flops * median / peaks[dtype],
      'mfu_of': dtype,
    }
  return out


def _parse_setting(setting: str) -> tuple[str, str, bool, list[str]]:
  """'label:policy,dotted=value,...' -> (label, policy, remat, overrides)."""
  label, _, rest = setting.partition(':')
  policy, *items = [p for p in rest.split(',') if p]
  remat = any(i.lower() in ('train.remat=true', 'train.remat=1') for i in items)
  return label, policy, remat, items


def breakdown(setting: str) -> dict:
  """One --setting's row: the child's numbers and the components derived from them, MiB."""
  label, policy, remat, items = _parse_setting(setting)
  m = measure(policy, remat, _BATCH.value, extra=items, breakdown=True)
  row = {'label': label, 'policy': policy, 'overrides': items, **m}
  row['bytes_per_param'] = (m['weights_mib'] + m['state_mib']) * 2**20 / m['params']
  if 'allocator_peak_mib' in m:
    held = m['weights_mib'] + m['state_mib'] + m['kept_mib']
    row['transient_mib'] = m['allocator_peak_mib'] - held
    row['beyond_allocator_mib'] = m['peak_mib'] - m['allocator_peak_mib']
  logging.warning('%s: step %.0f MiB, %.2f s/step', label, m['step_mib'], m['step_seconds'])
  return row


def memory_table(memory: dict) -> str:
  """The plain run's table: each figure and its ratio to the first setting's."""
  first = next(iter(memory.values()))
  lines = [
    '| setting | step MiB | step - build MiB | working MiB |',
    '|---|---|---|---|',
  ]
  for name, m in memory.items():
    cells = [
      f'{m[k]:.0f}' + (f' ({m[k] / first[k]:.2f}x)' if m is not first and first.get(k) else '')
      if m.get(k) is not None
      else 'n/a'
      for k in ('step_mib', 'step_minus_build_mib', 'working_mib')
    ]
    lines.append(f'| {name} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def markdown(rows: list[dict]) -> str:
  """The --breakdown table, ratios against the first row."""
  cols = [
    ('bytes/param', 'bytes_per_param', '{:.1f}'),
    ('weights', 'weights_mib', '{:.1f}'),
    ('opt. state', 'state_mib', '{:.1f}'),
    ('kept', 'kept_mib', '{:.0f}'),
    ('transient', 'transient_mib', '{:.0f}'),
    ('allocator peak', 'allocator_peak_mib', '{:.0f}'),
    ('beyond allocator', 'beyond_allocator_mib', '{:.0f}'),
    ('RSS peak', 'peak_mib', '{:.0f}'),
    ('step MiB', 'step_mib', '{:.0f}'),
    ('s/step', 'step_seconds', '{:.2f}'),
  ]
  lines = ['| setting | ' + ' | '.join(c[0] for c in cols) + ' |', '|---' * (len(cols) + 1) + '|']
  first = rows[0]
  for r in rows:
    cells = []
    for _, key, fmt in cols:
      if key not in r:
        cells.append('')
        continue
      cell = fmt.format(r[key])
      if r is not first and key in ('step_mib', 'allocator_peak_mib', 'step_seconds', 'kept_mib'):
        cell += f' ({r[key] / first[key]:.2f}x)'
      cells.append(cell)
    lines.append(f'| {r["label"]} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def main(argv):
  del argv
  if _CHILD.value:
    logging.set_verbosity(logging.ERROR)
    child(json.loads(_CHILD.value))
    return
  logging.set_verbosity(logging.WARNING)
  started = results_page.start()
  settings = [(p, r.lower() == 'true') for p in _POLICY_LIST.value for r in _REMAT.value]
  results = dict(model=_MODEL.value, config=_CONFIG.value, set=_SET.value, steps=_STEPS.value)
  results.update(batch_size=_BATCH.value, load_average=os.getloadavg())
  if _BREAKDOWN.value:
    results['breakdown'] = rows = [breakdown(s) for s in _SETTINGS.value]
    results['allocator'] = _ALLOCATOR.value
    results['table'] = markdown(rows)
  elif _ACCOUNT.value:
    results['account'] = {f'{p} remat={r}': account(p, r) for p, r in settings}
  elif _TIME_ROUNDS.value:
    results['time'] = timing([_parse_setting(s) for s in _SETTINGS.value] or settings)
  elif _BUDGET.value:
    results['budget_mib'] = _BUDGET.value
    results['largest_batch'] = {
      f'{p} remat={r}': largest_batch(p, r, _BUDGET.value, _BATCH.value or 16) for p, r in settings
    }
  else:
    results['memory'] = {}
    for p, r in settings:
      results['memory'][f'{p} remat={r}'] = m = measure(p, r, _BATCH.value)
      mib = (m['step_mib'], m['step_minus_build_mib'], m.get('working_mib', float('nan')))
      logging.warning('%s remat=%s: step %.0f MiB (step - build %.0f, working %.0f)', p, r, *mib)
    results['table'] = memory_table(results['memory'])
  text = json.dumps(results, indent=2)
  print(text)
  if 'table' in results:
    print(results['table'])
  if _JSON.value:
    with open(_JSON.value, 'w') as f:
      f.write(text + '\n')
  # One page per kind of measurement (memory_breakdown.md, ...); --results_name names another.
  mode = next(
    k for k in ('breakdown', 'account', 'time', 'largest_batch', 'memory') if k in results
  )
  body = (results.get('table', '') + '\n\n```json\n' + text + '\n```').lstrip('\n')
  results_page.write(f'memory_{mode}' if mode != 'memory' else 'memory', body, started=started)


if __name__ == '__main__':
  app.run(main)
