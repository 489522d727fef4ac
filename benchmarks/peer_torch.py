"""Peer benchmark: our trainer against our own PyTorch model of the same Transformer LM.

  python -m benchmarks.peer_torch --out=/tmp/peer                  # both shapes, 1 round
  python -m benchmarks.peer_torch --quick                          # ~1 minute: checks it works
  python -m benchmarks.peer_torch --sides=ours,torch,torch_compile --shapes=shakespeare

Not a test. PyTorch lives in its own virtual environment, never in TensorFlow's:
  python3 -m venv /work/torchvenv
  /work/torchvenv/bin/pip install torch numpy     # a CPU-only wheel keeps CUDA out
(--torch_python names its interpreter.) The PyTorch side is benchmarks/peer_torch_model.py
(its docstring states how it matches models/transformer_lm.py); the TensorFlow side is our
Trainer run from the config file as written (subprocess: `--tf_child`), with only the policy and
the run length changed.

Shapes: nanogpt_cpu (configs/nanogpt_cpu.py: context 64, batch 12, 2000 steps) and shakespeare
(configs/shakespeare.py: context 128, batch 64, cut to 300 steps with no eval during training).
Sides (--sides): ours, torch (eager) and torch_compile (the same model under torch.compile,
inductor's CPU C++ backend: it needs a C++ compiler; its compilation is in the first step, and so
in the train and process figures, and apart in 'first call' with 'steady' the steps after it).
Precisions: float32 (both eager float32) and bfloat16 (ours mixed_bfloat16, PyTorch
torch.autocast(bfloat16)). Rounds interleave the sides: for each shape and precision,
ours, PyTorch, ours, PyTorch, ... so both see the same machine load.
Per run: the child's whole life (wall, and CPU-seconds from getrusage of the child: imports,
data, build, tracing, training, the final full-split evaluation) and the training alone (ours:
Trainer.train() minus a second, warm, evaluate(); PyTorch: its training loop), per step; cores
used = CPU-seconds / wall; the validation loss of the full split, computed the same way on both
sides. Prints markdown tables; --out writes peer.md and peer.json.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from benchmarks import child  # noqa: E402
from benchmarks import results as results_page  # noqa: E402
from benchmarks import overrides as config_overrides  # noqa: E402

SHAPES = {  # name: (config file, steps, quick steps)
  'nanogpt_cpu': ('configs/nanogpt_cpu.py', 2000, 30),
  'shakespeare': ('configs/shakespeare.py', 300, 10),
}
PRECISIONS = {'float32': 'float32', 'bfloat16': 'mixed_bfloat16'}  # ours per precision

_QUICK = flags.DEFINE_bool(
  'quick',
  False,
  'A few steps of each, one round: checks that both '
  'sides run and report; the figures mean nothing.',
)
_SHAPES = flags.DEFINE_list('shapes', list(SHAPES), 'Shapes to run.')
_PRECISIONS = flags.DEFINE_list('precisions', list(PRECISIONS), 'float32 and/or bfloat16.')
_ROUNDS = flags.DEFINE_integer('rounds', 1, 'Interleaved rounds (ours, PyTorch) per cell.')
_STEPS = flags.DEFINE_integer('steps', 0, "Override every shape's steps (0 = the shape's).")
_DATA = flags.DEFINE_string(
  'data', os.path.join(ROOT, '..', 'shared', 'data', 'tinyshakespeare'), 'Folder holding input.txt.'
)
_TORCH_PYTHON = flags.DEFINE_string(
  'torch_python', '/work/torchvenv/bin/python', 'Python of the virtual environment holding PyTorch.'
)
_TORCH_THREADS = flags.DEFINE_integer(
  'torch_threads',
  0,
  "PyTorch's intra-op threads "
  "(torch.set_num_threads); 0 = PyTorch's default (one per "
  'core). On a machine shared with other jobs its default '
  'OpenMP threads spin waiting for each other (see '
  'docs/references.md).',
)
_SIDES = flags.DEFINE_list(
  'sides',
  ['ours', 'torch'],
  'Sides to run, interleaved: ours, torch (eager), torch_compile (torch.compile, inductor).',
)
_OUT = flags.DEFINE_string('out', '', "Folder for peer.md and peer.json; '' = print only.")
_SET = flags.DEFINE_multi_string(
  'set',
  [],
  "key=value overrides of our side's config only (e.g. train.intra_op_threads=2), to try settings.",
)
_TF_CHILD = flags.DEFINE_string('tf_child', None, "Internal: JSON settings of our side's run.")


def config_for(shape: str, precision: str, steps: int, overrides=()):
  """The validated config our trainer runs for (shape, precision)."""
  from trainer import config as config_lib

  path, _, _ = SHAPES[shape]
  config = config_lib.load_file(os.path.join(ROOT, path))
  config.data.dir = _DATA.value
  config.precision.policy = PRECISIONS[precision]
  config.train.steps = steps
  # A cut run (--quick, --steps) needs a warm-up no longer than itself (the trainer refuses one).
  if config.optimizer.warmup_steps > steps:
    config.optimizer.warmup_steps = steps // 2
  config.train.eval_every = 0
  loop = min(config.train.steps_per_loop, steps)
  config.train.steps_per_loop = loop
  config.train.log_every = config.train.checkpoint_every = loop * max(steps // loop, 1)
  config_overrides.apply(config, overrides)
  return config_lib.validate(config)


def torch_settings(config, precision: str) -> dict:
  """What the PyTorch side needs, read from our validated config (one source of truth)."""
  from models import transformer_lm

  m, o = transformer_lm.model_config(config), config.optimizer
  return {
    'data': os.path.join(config.data.dir, 'input.txt'),
    'seed': config.seed,
    'precision': precision,
    'steps': config.train.steps,
    'batch_size': config.train.batch_size,
    'context': m.context,
    'd_model': m.d_model,
    'num_heads': m.num_heads,
    'num_layers': m.num_layers,
    'mlp_ratio': m.mlp_ratio,
    'val_fraction': m.val_fraction,
    'learning_rate': o.learning_rate,
    'min_learning_rate': o.min_learning_rate,
    'schedule': o.schedule,
    'warmup': o.warmup_steps,
    'weight_decay': o.weight_decay,
    'clip_norm': o.clip_norm,
    'beta_1': o.beta_1,
    'beta_2': o.beta_2,
    'epsilon': o.epsilon,
    'threads': _TORCH_THREADS.value,
  }


def tf_child(settings: dict) -> dict:
  """Our side, in this (child) process."""
  import models

  config = config_for(settings['shape'], settings['precision'], settings['steps'], settings['set'])
  with tempfile.TemporaryDirectory(prefix='peer_tf_') as workdir:
    trainer = models.get_trainer_class(config.model)(config, workdir)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    metrics = trainer.train()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    wall0, cpu0 = time.perf_counter(), time.process_time()
    trainer.evaluate()  # warm: what the final eval inside train() cost, minus its tracing
    eval_wall, eval_cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    import tensorflow as tf

    usage = resource.getrusage(resource.RUSAGE_SELF)
    clock = trainer.runner.clock  # trainer/run/goodput.py: the first compiled call, the later ones
    first_s, first_n = clock.first_call or (0.0, 0)
    later_s, later_n = clock.later
    return {
      'side': 'ours',
      'first_call_s': first_s,
      'first_call_steps': first_n,
      'steady_ms': 1000 * later_s / later_n if later_n else None,
      'val_loss': float(metrics['loss']),
      'train_wall_s': wall - eval_wall,
      'train_cpu_s': cpu - eval_cpu,
      'eval_wall_s': eval_wall,
      'eval_cpu_s': eval_cpu,
      'steps': int(trainer.total_steps),
      'tensorflow': tf.__version__,
      'policy': str(trainer.policy),
      'intra_op_threads': tf.config.threading.get_intra_op_parallelism_threads(),
      'inter_op_threads': tf.config.threading.get_inter_op_parallelism_threads(),
      'jit_compile': bool(trainer.jit_compile),
      'parameters': int(trainer.model.count_params()),
      'peak_rss_mib': usage.ru_maxrss / 1024,
    }


def run_child(command: list[str]) -> dict:
  """Runs a child (benchmarks/child.py: tried twice); adds its whole-life wall and CPU-seconds
  (getrusage of the child)."""
  result, wall, cpu = child.run(command, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'))
  result['process_wall_s'], result['process_cpu_s'] = wall, cpu
  return result


def _median(results, key):
  return statistics.median(r[key] for r in results)


SIDE_NAMES = {'ours': 'ours', 'torch': 'PyTorch', 'torch_compile': 'PyTorch torch.compile'}


def _first(r):
  """Seconds of the first call: ours the first compiled call (tracing, compilation and its
  steps_per_loop steps), PyTorch the first step (with torch.compile: its compilation)."""
  return r.get('first_call_s', r.get('first_step_s'))


def tables(cells: dict) -> str:
  lines = [
    '| shape | precision | side | steps | train ms/step | train CPU-ms/step | train cores '
    '| first call s | steady ms/step | process wall s | process CPU-s | process cores '
    '| val loss (full split) |',
    '|---|---|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for (shape, precision), runs in cells.items():
    for side, name in SIDE_NAMES.items():
      rs = [r for r in runs if r['side'] == side]
      if not rs:
        continue
      steps = rs[0]['steps']
      wall, cpu = _median(rs, 'train_wall_s'), _median(rs, 'train_cpu_s')
      pwall, pcpu = _median(rs, 'process_wall_s'), _median(rs, 'process_cpu_s')
      first = statistics.median(_first(r) for r in rs)
      steady = [r['steady_ms'] for r in rs if r.get('steady_ms') is not None]
      lines.append(
        f'| {shape} | {precision} | {name} | '
        f'{steps} | {1000 * wall / steps:.1f} | {1000 * cpu / steps:.1f} | '
        f'{cpu / wall:.2f} | {first:.1f} | '
        f'{statistics.median(steady) if steady else float("nan"):.1f} | '
        f'{pwall:.0f} | {pcpu:.0f} | {pcpu / pwall:.2f} | '
        f'{_median(rs, "val_loss"):.4f} |'
      )
  lines += [
    '',
    '| shape | precision | against | ours / it, train wall per step | ours / it, train CPU per '
    'step | ours / it, steady step | ours / it, process wall | val loss ours - it |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for (shape, precision), runs in cells.items():
    ours = [r for r in runs if r['side'] == 'ours']
    for side in ('torch', 'torch_compile'):
      other = [r for r in runs if r['side'] == side]
      if not (ours and other):
        continue
      steady = [r.get('steady_ms') for r in ours + other]
      steady_ratio = (
        f'{_median(ours, "steady_ms") / _median(other, "steady_ms"):.2f}'
        if None not in steady
        else '-'
      )
      lines.append(
        f'| {shape} | {precision} | {SIDE_NAMES[side]} | '
        f'{_median(ours, "train_wall_s") / _median(other, "train_wall_s"):.2f} | '
        f'{_median(ours, "train_cpu_s") / _median(other, "train_cpu_s"):.2f} | '
        f'{steady_ratio} | '
        f'{_median(ours, "process_wall_s") / _median(other, "process_wall_s"):.2f} | '
        f'{_median(ours, "val_loss") - _median(other, "val_loss"):+.4f} |'
      )
  lines += [
    '',
    'First call: ours, the first compiled call (tracing, compilation and its steps_per_loop '
    'steps); PyTorch, the first step (with torch.compile, its compilation). Steady: ours, the '
    'later compiled calls per step; PyTorch, the steps after the first.',
  ]
  return '\n'.join(lines)


def main(argv):
  del argv
  if _TF_CHILD.value:
    print(json.dumps(tf_child(json.loads(_TF_CHILD.value))), flush=True)
    return
  if not os.path.exists(_TORCH_PYTHON.value):
    raise app.UsageError(
      f'--torch_python={_TORCH_PYTHON.value} does not exist; make the venv: '
      'python3 -m venv /work/torchvenv && /work/torchvenv/bin/pip install '
      'torch numpy'
    )
  started, cells = results_page.start(), {}
  for shape in _SHAPES.value:
    steps = _STEPS.value or SHAPES[shape][2 if _QUICK.value else 1]
    for precision in _PRECISIONS.value:
      config = config_for(shape, precision, steps, _SET.value)
      runs = cells[(shape, precision)] = []
      for round_ in range(1 if _QUICK.value else _ROUNDS.value):
        tf_settings = {'shape': shape, 'precision': precision, 'steps': steps, 'set': _SET.value}
        commands = {
          'ours': [
            sys.executable,
            '-m',
            'benchmarks.peer_torch',
            f'--tf_child={json.dumps(tf_settings)}',
          ],
        }
        for side in ('torch', 'torch_compile'):
          settings = dict(torch_settings(config, precision), compile=side == 'torch_compile')
          commands[side] = [
            _TORCH_PYTHON.value,
            os.path.join(ROOT, 'benchmarks', 'peer_torch_model.py'),
            json.dumps(settings),
          ]
        for side in _SIDES.value:
          result = run_child(commands[side])
          result['side'] = side
          result.update(shape=shape, precision=precision, round=round_)
          print(json.dumps(result), flush=True)
          runs.append(result)
  child.report(
    _OUT.value,
    'peer',
    tables(cells),
    [r for runs in cells.values() for r in runs],
    page='peer_torch',
    started=started,
    quick=_QUICK.value,
  )


if __name__ == '__main__':
  app.run(main)
