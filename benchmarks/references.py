"""Published small-scale results reproduced with our trainer, per precision policy.

  python -m benchmarks.references                 # every reference x policy (tens of minutes)
  python -m benchmarks.references --only=nanogpt_cpu --policies=float32,mixed_bfloat16
  python -m benchmarks.references --quick         # a few steps each: checks the plumbing

Each reference is a config file in configs/ whose docstring names the published figure and its
source (nanoGPT's CPU recipe, keras.io's Simple MNIST convnet). Every (reference, policy) cell
trains in its own subprocess from the config as written, only the policy changed (mixed_float16
with dynamic loss scaling); its wall and CPU-seconds are the subprocess's whole life. --quick
runs the cells in this process, a few steps each; its figures mean nothing. The nanoGPT cell is
evaluated on the full validation split (the trainer's eval) and as nanoGPT estimates it (20
seeded batches of 12 random windows: `nanogpt_estimate`). `--side=keras_fit` runs the convnet as
the example itself does (its model with a float32 softmax, `fit` with `validation_split=0.1`,
`evaluate`; Keras's LossScaleOptimizer under mixed_float16). Prints a markdown table; --out also
writes it, with the raw results as JSON next to it. Method and findings: docs/references.md.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from absl import app, flags, logging  # noqa: E402

from benchmarks import results as results_page  # noqa: E402
from benchmarks import overrides as config_overrides  # noqa: E402

POLICIES = ('float32', 'mixed_bfloat16', 'mixed_float16')
# name: (config file, data folder under --data_root, metric, the published figure, lower is
# better); the config's docstring names the source.
REFERENCES = {
  'nanogpt_cpu': ('configs/nanogpt_cpu.py', 'tinyshakespeare', 'loss', 1.88, True),
  'keras_mnist_convnet': ('configs/keras_mnist_convnet.py', 'mnist', 'accuracy', 0.9922, False),
}
NANOGPT_EVAL_ITERS = 20  # nanoGPT's --eval_iters in its CPU recipe

_QUICK = flags.DEFINE_bool('quick', False, 'A few steps per cell, in this process: the plumbing.')
_ONLY = flags.DEFINE_list('only', list(REFERENCES), 'References to run.')
_POLICIES = flags.DEFINE_list('policies', list(POLICIES), 'Policies to run.')
_DATA_ROOT = flags.DEFINE_string(
  'data_root', os.path.join(ROOT, '..', 'shared', 'data'), 'Folder of mnist/, tinyshakespeare/.'
)
_OUT = flags.DEFINE_string('out', '', "Folder for references.md and .json; '' = print only.")
_CELL = flags.DEFINE_string('cell', None, 'Internal: reference:policy to run in this process.')
_SIDE = flags.DEFINE_enum(
  'side',
  'ours',
  ['ours', 'keras_fit'],
  "Who trains: 'keras_fit' is the convnet example as published.",
)
_SET = flags.DEFINE_multi_string('set', [], "key=value overrides of every cell's config.")


def build_config(name: str, policy: str, data_root: str, quick: bool, overrides=()):
  from trainer import config as config_lib

  file, data, *_ = REFERENCES[name]
  config = config_lib.load_file(os.path.join(ROOT, file))
  config.data.dir = os.path.join(data_root, data)
  config.precision.policy = policy
  config.precision.loss_scale = 'dynamic' if policy == 'mixed_float16' else 'none'
  if quick:
    config.train.steps = 20
    config.train.steps_per_loop = 10
    config.train.log_every = 10
    config.train.checkpoint_every = 20
    # The recipe's warm-up (nanoGPT: 100 steps) within the 20: a longer one is refused.
    config.optimizer.warmup_steps = min(config.optimizer.warmup_steps, 10)
  config_overrides.apply(config, overrides)
  return config


def nanogpt_estimate(trainer, iters: int = NANOGPT_EVAL_ITERS, seed: int = 1337) -> float:
  """nanoGPT's estimate_loss on the validation split: the mean over `iters` batches of
  batch_size windows at uniformly random offsets (get_batch: ix in [0, len(val) - context)) of
  each batch's mean per-character cross-entropy."""
  import numpy as np
  import tensorflow as tf

  val, context = trainer.corpus.val, trainer.m.context
  batch = trainer.config.train.batch_size
  rng = np.random.default_rng(seed)

  @tf.function
  def batch_loss(x, y):
    loss, _ = trainer.compute_loss((x, y), training=False)
    return tf.reduce_mean(loss)

  losses = []
  for _ in range(iters):
    starts = rng.integers(0, len(val) - context, size=batch)
    windows = val[starts[:, None] + np.arange(context + 1)[None]]
    losses.append(float(batch_loss(tf.constant(windows[:, :-1]), tf.constant(windows[:, 1:]))))
  return float(np.mean(losses))


def run_cell(name: str, policy: str, data_root: str, quick: bool, overrides=()) -> dict:
  """Trains one reference under one policy in this process; returns its figures."""
  import models

  start, cpu_start = time.perf_counter(), time.process_time()
  config = build_config(name, policy, data_root, quick, overrides)
  with tempfile.TemporaryDirectory(prefix=f'ref_{name}_') as workdir:
    trainer = models.get_trainer_class(config.model)(config, workdir)
    metrics = trainer.train()
    result = {
      'reference': name,
      'policy': policy,
      'steps': int(trainer.total_steps),
      'metrics': {k: float(v) for k, v in metrics.items()},
      'skipped': int(trainer.train_step.skipped_steps.numpy()),
    }
    if name == 'nanogpt_cpu':
      result['nanogpt_estimate'] = nanogpt_estimate(trainer)
  result['wall_s'] = time.perf_counter() - start
  result['cpu_s'] = time.process_time() - cpu_start
  return result


def run_keras_example(name: str, policy: str, data_root: str, quick: bool, overrides=()) -> dict:
  """The convnet example as keras.io runs it, with model.fit, from the same config (seed, batch,
  epochs, validation_split, data); --quick: 20 steps on the first 20 batches."""
  import keras
  from models.keras_mnist_convnet import build_convnet
  from trainer.data import mnist

  if name != 'keras_mnist_convnet':
    raise app.UsageError(f'--side=keras_fit runs keras_mnist_convnet only, not {name!r}')
  start, cpu_start = time.perf_counter(), time.process_time()
  config = build_config(name, policy, data_root, quick, overrides)
  keras.utils.set_random_seed(config.seed)
  keras.mixed_precision.set_global_policy(policy)
  (x, y), (x_test, y_test) = mnist.load(config.data.dir)
  x, x_test = (a[..., None].astype('float32') / 255.0 for a in (x, x_test))
  y, y_test = (keras.utils.to_categorical(a, 10) for a in (y, y_test))
  split, epochs = config.model_config.validation_split, config.train.epochs
  if quick:  # 20 steps: 22 batches, of which fit holds 1/11 out
    n = 22 * config.train.batch_size
    x, y, epochs, split = x[:n], y[:n], 1, 1 / 11
  layers = build_convnet().layers  # its Dense emits logits; the example's ends in a softmax
  model = keras.Sequential(
    [keras.Input((28, 28, 1)), *layers, keras.layers.Activation('softmax', dtype='float32')]
  )
  model.compile(loss='categorical_crossentropy', optimizer='adam', metrics=['accuracy'])
  history = model.fit(
    x, y, batch_size=config.train.batch_size, epochs=epochs, validation_split=split, verbose=0
  )
  loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
  steps = int(model.optimizer.iterations.numpy())
  return {
    'reference': name,
    'policy': policy,
    'side': 'keras_fit',
    'steps': steps,
    'metrics': {'loss': float(loss), 'accuracy': float(accuracy)},
    'skipped': None,
    'epochs': len(history.history['loss']),
    'wall_s': time.perf_counter() - start,
    'cpu_s': time.process_time() - cpu_start,
  }


def run_subprocess(name: str, policy: str, data_root: str, overrides=(), side='ours') -> dict:
  """run_cell (or run_keras_example) in a fresh Python; wall and CPU-seconds are the child's
  whole life."""
  command = [sys.executable, '-m', 'benchmarks.references', f'--cell={name}:{policy}']
  command += [f'--side={side}', f'--data_root={data_root}', *(f'--set={s}' for s in overrides)]
  before = resource.getrusage(resource.RUSAGE_CHILDREN)
  start = time.perf_counter()
  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
  wall = time.perf_counter() - start
  after = resource.getrusage(resource.RUSAGE_CHILDREN)
  if done.returncode:
    raise RuntimeError(f'{name}:{policy} failed (exit {done.returncode}): {done.stderr[-2000:]}')
  result = json.loads([line for line in done.stdout.splitlines() if line.startswith('{')][-1])
  result['in_process_wall_s'], result['in_process_cpu_s'] = result['wall_s'], result['cpu_s']
  result['wall_s'] = wall
  result['cpu_s'] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
  return result


def table(results: list[dict]) -> str:
  """The markdown table: one row per cell."""
  lines = [
    '| reference | published | policy | side | full split | nanoGPT estimate | '
    'gap to published | steps | wall s | CPU-s | cores | skipped |',
    '|---|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for r in results:
    _, _, metric, published, lower = REFERENCES[r['reference']]
    full = r['metrics'][metric]
    estimate = r.get('nanogpt_estimate')
    # The gap is taken on the figure measured as the source measured it.
    ours = estimate if estimate is not None else full
    gap = ours - published if lower else published - ours
    lines.append(
      f'| {r["reference"]} | {metric} {published} | {r["policy"]} | '
      f'{r.get("side", "ours")} | '
      f'{full:.4f} | {"-" if estimate is None else f"{estimate:.4f}"} | '
      f'{gap:+.4f} ({"worse" if gap > 0 else "met"}) | {r["steps"]} | {r["wall_s"]:.0f} | '
      f'{r["cpu_s"]:.0f} | {r["cpu_s"] / r["wall_s"]:.2f} | '
      f'{"-" if r["skipped"] is None else r["skipped"]} |'
    )
  return '\n'.join(lines)


def main(argv):
  del argv
  cell = run_keras_example if _SIDE.value == 'keras_fit' else run_cell
  if _CELL.value:
    name, policy = _CELL.value.split(':')
    print(json.dumps(cell(name, policy, _DATA_ROOT.value, False, _SET.value)), flush=True)
    return
  unknown = sorted(set(_ONLY.value) - set(REFERENCES)) + sorted(
    set(_POLICIES.value) - set(POLICIES)
  )
  if unknown:
    raise app.UsageError(
      f'--only/--policies: unknown {unknown[0]!r}; known: {", ".join([*REFERENCES, *POLICIES])}'
    )
  started, results = results_page.start(), []
  for name in _ONLY.value:
    for policy in _POLICIES.value:
      if _QUICK.value:
        result = cell(name, policy, _DATA_ROOT.value, True, _SET.value)
      else:
        result = run_subprocess(name, policy, _DATA_ROOT.value, _SET.value, _SIDE.value)
      logging.info('%s', json.dumps(result))
      results.append(result)
  results_page.report(
    _OUT.value,
    'references',
    table(results),
    results,
    page='references',
    started=started,
    quick=_QUICK.value,
  )
  # Everything is written. (A --cell child, above, ends normally: its whole life is measured.)
  results_page.exit_now()


if __name__ == '__main__':
  app.run(main)
