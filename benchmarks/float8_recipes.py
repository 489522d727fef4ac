"""The float8 recipes table: per recipe, what it costs a model in quality against mixed_bfloat16.

  python benchmarks/float8_recipes.py --mlp_steps=936 --cnn_steps=936 --lm_steps=750 \
      --results_dir=docs/results

For each model (the MNIST MLP and CNN: test accuracy; the Shakespeare LM: validation loss) and
each value of precision.float8 ('none' is the mixed_bfloat16 baseline), one training run from
the same seed under mixed_bfloat16 with dynamic loss scaling (--policy=float32: float32 compute,
no loss scaling, the layers that are float32 under mixed_bfloat16 left out of float8), then:
  * the gap to the baseline (accuracy points, or nats/char);
  * per quantized layer, the share of its values saturated (scaled beyond the format's largest)
    or flushed (nonzero, quantized to zero): the activations x and weights w as the forward GEMM
    quantizes them, the output gradients g as the input-gradient GEMM does, measured eagerly on
    one evaluation batch after training (trainer/nn/float8_gemm.observe; the current-scaling
    recipes only, Keras's delayed layers are not instrumented);
  * the emulated step's cost: wall and CPU-seconds per compiled train step, and their ratios to
    the baseline's: the emulation's overhead (quantize, dequantize, float32 GEMM), not float8
    hardware's speed-up.
Writes docs/results/float8.md (benchmarks/results.py: a header of command, commit, machine, load).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from benchmarks import results as results_page  # noqa: E402  (--results_dir)

RECIPES = ('none', 'delayed', 'tensorwise', 'rowwise', 'mxfp8', 'mxfp8_rceil')
MODELS = {  # name: (config file, data folder, metric, higher is better)
  'mnist_mlp': ('mnist_mlp.py', 'mnist', 'accuracy', True),
  'mnist_cnn': ('mnist.py', 'mnist', 'accuracy', True),
  'transformer_lm': ('shakespeare.py', 'tinyshakespeare', 'loss', False),
}
# The layers that compute in float32 under mixed_bfloat16 (the logits), named so that a float32
# run leaves them out of float8 too (precision.float32_layers). The MNIST models' logits have
# Keras's per-process names: each run starts from a cleared Keras session, where they are the
# second Dense layer's (one_run checks that the named layer is the model's last).
FLOAT32_LAYERS = {'transformer_lm': 'logits', 'mnist_mlp': 'dense_1', 'mnist_cnn': 'dense_1'}
FULL = {'mnist_mlp': 4680, 'mnist_cnn': 2340, 'transformer_lm': 750}  # the configs' lengths

_MLP = flags.DEFINE_integer('mlp_steps', 936, 'Train steps of the MNIST MLP.')
_CNN = flags.DEFINE_integer('cnn_steps', 936, 'Train steps of the MNIST CNN.')
_LM = flags.DEFINE_integer('lm_steps', 750, 'Train steps of the Shakespeare LM (750 = full).')
_RECIPES = flags.DEFINE_list('recipes', list(RECIPES), 'precision.float8 values to compare.')
_MODELS = flags.DEFINE_list('models', list(MODELS), 'Models to train.')
_COST = flags.DEFINE_integer('cost_steps', 20, 'Compiled steps timed for the cost ratio.')
_POLICY = flags.DEFINE_enum(
  'policy',
  'mixed_bfloat16',
  ['mixed_bfloat16', 'float32'],
  "Compute of every run ('none' is the baseline): float32 where bfloat16 is emulated and slow.",
)
_DATA = flags.DEFINE_string('data_root', os.path.join(ROOT, '..', 'shared', 'data'), 'Data.')


def config_for(model: str, recipe: str, steps: int):
  from trainer import config as config_lib

  file, data, _, _ = MODELS[model]
  c = config_lib.load_file(os.path.join(ROOT, 'configs', file))
  c.data.dir = os.path.join(_DATA.value, data)
  c.seed = 0
  c.train.steps = steps
  loop = next(n for n in (50, 25, 20, 10, 5, 4, 2, 1) if steps % n == 0)
  c.train.steps_per_loop = c.train.log_every = loop
  c.train.eval_every = 0  # at the end only
  c.train.checkpoint_every = steps
  c.optimizer.warmup_steps = min(c.optimizer.warmup_steps, steps // 5)
  c.numerics.every = 0  # the statistics probe's own passes would be in the timing
  c.precision.policy = _POLICY.value
  c.precision.loss_scale = 'dynamic' if _POLICY.value == 'mixed_bfloat16' else 'none'
  if _POLICY.value == 'float32':
    c.precision.float32_layers = FLOAT32_LAYERS.get(model, '')
  c.precision.float8 = recipe
  return c


def shares(trainer) -> dict[str, dict[str, tuple[float, float]]]:
  """{layer: {operand: (saturated share, flushed share)}} on one evaluation batch (eager)."""
  import tensorflow as tf
  from trainer.data import checks
  from trainer.nn import float8_gemm

  sums: dict = {}

  def record(name, operand, counts):
    sums.setdefault(name, {}).setdefault(operand, 0.0)
    sums[name][operand] = sums[name][operand] + counts.numpy()

  batch = checks.first_eval_batch(trainer.datasets)
  with float8_gemm.observe(record):  # the backward pass too: g is quantized there
    with tf.GradientTape() as tape:
      loss, _ = trainer.compute_loss(batch, training=True)
      loss = tf.reduce_mean(loss)
    tape.gradient(loss, trainer.model.trainable_variables)
  return {
    layer: {op: (c[0] / max(c[2], 1), c[1] / max(c[2], 1)) for op, c in ops.items()}
    for layer, ops in sums.items()
  }


def seconds_per_step(trainer, steps: int) -> tuple[float, float]:
  """(wall seconds, CPU-seconds of this process) per compiled train step: CPU-seconds move less
  than wall seconds when other processes share the cores."""
  it = iter(trainer.strategy.experimental_distribute_dataset(trainer.datasets.train))
  trainer.runner.train_loop.run(it, 2)  # warm: the compiled loop and the iterator
  start, cpu = time.perf_counter(), time.process_time()
  trainer.runner.train_loop.run(it, steps)
  return (time.perf_counter() - start) / steps, (time.process_time() - cpu) / steps


def one_run(model: str, recipe: str, steps: int) -> dict:
  """One training run in a temporary workdir: what it measured (the module's docstring)."""
  import keras
  import models
  from trainer.errors import UserError

  keras.backend.clear_session()  # Keras's layer names from 'dense' again (FLOAT32_LAYERS)
  config = config_for(model, recipe, steps)
  with tempfile.TemporaryDirectory(prefix=f'float8_{model}_{recipe}_') as workdir:
    try:
      trainer = models.get_trainer_class(model)(config, workdir)
    except UserError as e:  # e.g. mxfp8 on a layer whose axes are not whole blocks
      return {'error': f'{type(e).__name__}: {e}'}
    left_out = config.precision.float32_layers
    if left_out and model.startswith('mnist') and trainer.model.layers[-1].name != left_out:
      raise RuntimeError(f'{model}: precision.float32_layers={left_out!r} is not its logits layer')
    start = time.perf_counter()
    metrics = trainer.train()
    out: dict = {'metric': metrics[MODELS[model][2]], 'train_seconds': time.perf_counter() - start}
    out['skipped'] = int(trainer.train_step.skipped_steps.numpy())
    out['shares'] = shares(trainer) if recipe not in ('none', 'delayed') else {}
    out['step_seconds'], out['step_cpu'] = seconds_per_step(trainer, _COST.value)
    return out


def pct(x: float) -> str:
  return '0' if x == 0 else f'{100 * x:.2g}%' if x >= 1e-4 else f'{100 * x:.1e}%'


def table(model: str, steps: int, results: dict) -> list[str]:
  _, _, metric, higher = MODELS[model]
  base = results.get('none', {})
  unit = 'points' if metric == 'accuracy' else 'nats/char'
  length = 'full length' if steps >= FULL[model] else f'short: {steps} of {FULL[model]} steps'
  lines = [
    f'### {model} ({metric}; {steps} steps, {length}; {_POLICY.value} compute)',
    '',
    f'| recipe | {metric} | gap to none ({_POLICY.value}; {unit}) | skipped steps '
    '| ms per step (wall; CPU) | step cost vs none (wall; CPU) |',
    '| --- | --- | --- | --- | --- | --- |',
  ]
  for recipe, r in results.items():
    if 'error' in r:
      lines.append(f'| {recipe} | - | not run: {r["error"]} | - | - | - |')
      continue
    gap = r['metric'] - base['metric'] if 'metric' in base else float('nan')
    if metric == 'accuracy':
      gap *= 100
    ratio = lambda k: r[k] / base[k] if k in base else float('nan')  # noqa: E731
    worse = (gap < 0) == higher and gap != 0
    lines.append(
      f'| {recipe} | {r["metric"]:.4f} | {gap:+.3f}{" (worse)" if worse else ""} '
      f'| {r["skipped"]} | {1e3 * r["step_seconds"]:.1f}; {1e3 * r["step_cpu"]:.1f} '
      f'| {ratio("step_seconds"):.2f}x; {ratio("step_cpu"):.2f}x |'
    )
  lines.append('')
  rows = [
    (rec, layer, ops) for rec, r in results.items() for layer, ops in r.get('shares', {}).items()
  ]
  if rows:
    lines += [
      f'Saturated / flushed shares per layer ({model}; x, w as the forward GEMM quantizes them, '
      'g as the input-gradient GEMM does):',
      '',
      '| recipe | layer | x saturated / flushed | w saturated / flushed | g saturated / flushed |',
      '| --- | --- | --- | --- | --- |',
    ]
    for rec, layer, ops in rows:
      cells = [f'{pct(ops[o][0])} / {pct(ops[o][1])}' if o in ops else '-' for o in 'xwg']
      lines.append(f'| {rec} | {layer} | ' + ' | '.join(cells) + ' |')
    lines.append('')
  return lines


def main(argv):
  del argv
  started = results_page.start()
  steps = {'mnist_mlp': _MLP.value, 'mnist_cnn': _CNN.value, 'transformer_lm': _LM.value}
  body = [
    f'# Float8 recipes: the gap to {_POLICY.value}',
    '',
    'Float8 is emulated here (quantize-dequantize, no float8 hardware): the cost column is the '
    "emulation's overhead on this CPU.",
    '',
  ]
  for model in _MODELS.value:
    results = {}
    for recipe in _RECIPES.value:
      results[recipe] = one_run(model, recipe, steps[model])
      print(model, recipe, results[recipe], flush=True)
      # After each run: a partial table survives a stop.
      results_page.write(
        'float8', '\n'.join(body + table(model, steps[model], results)), started=started
      )
    body += table(model, steps[model], results)


if __name__ == '__main__':
  app.run(main)
