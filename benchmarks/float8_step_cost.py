"""What the emulated float8 step costs, per way of running its quantize-dequantize: interleaved.

  python -m benchmarks.float8_step_cost --model=transformer_lm --policy=float32 \
      --variants=none,tensorwise:before,tensorwise,tensorwise:fused:xla --rounds=4 --round_steps=5

Each variant is `recipe[:qdq[:xla]]`: the precision.float8 recipe ('none' for the baseline); how
each operand's q/dq runs (trainer/nn/float8_quant.py):
  * 'fused' (the default): as the GEMMs run it, one XLA computation per operand (`fused`);
  * 'unfused': the same ops, `qdq` run op by op;
  * 'before': op by op and saturating under every scaling, as before the tensor and axis
    scalings dropped their (value-preserving) saturation;
and 'xla' for a step compiled whole with XLA (train.jit_compile=true; else false). The runs are
benchmarks/float8_recipes.py's (its config_for and flags: --policy, --data_root, --workdir).
Every variant is built and compiled first, then the rounds run `--round_steps` steps of each in
turn (A B C A B C ...), so a change of the machine's load falls on all of them. Reported per
variant: CPU-seconds of this process per step (user + system over all its threads: they move
less than wall seconds when other processes share the cores) and wall seconds per step, and
whether the final weights of the variants of one recipe are bit-identical (same seed and batches,
the same number of steps: 'before', 'unfused' and 'fused' must agree bit for bit; a step compiled
whole with XLA computes its GEMMs with XLA's kernels and need not).
Writes docs/results/float8_step_cost.md (benchmarks/results.py).
"""

from __future__ import annotations

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from benchmarks import float8_recipes  # noqa: E402  (config_for and its flags)
from benchmarks import results as results_page  # noqa: E402  (--results_dir)

_MODEL = flags.DEFINE_enum('model', 'transformer_lm', list(float8_recipes.MODELS), 'Model.')
_VARIANTS = flags.DEFINE_list(
  'variants', ['none', 'tensorwise:before', 'tensorwise'], 'recipe[:before|unfused|fused[:xla]]'
)
_ROUNDS = flags.DEFINE_integer('rounds', 4, 'Interleaved rounds.')
_ROUND_STEPS = flags.DEFINE_integer('round_steps', 5, 'Steps of each variant per round.')


def patched_qdq(kind: str):
  """The q/dq the GEMMs call (float8_quant.fused's signature) for a variant's `kind`."""
  from trainer.nn import float8_quant as fq

  if kind == 'fused':
    return fq.fused
  if kind == 'unfused':
    return lambda fmt, scaling, axis=-1: lambda x: fq.qdq(x, fmt, scaling, axis)

  def before(fmt, scaling, axis=-1):
    def qdq(x):
      y, back = fq.scaled(x, fmt, scaling, axis)
      return back(fq.cast_saturated(y, fmt))

    return qdq

  return before


def build(variant: str, steps: int):
  """The variant's trainer, its iterator, and the seconds its first (compiling) step took."""
  import models
  from trainer.nn import float8_quant

  recipe, kind, xla = (variant.split(':') + ['fused', ''])[:3]
  config = float8_recipes.config_for(_MODEL.value, recipe, steps)
  config.train.jit_compile = 'true' if xla == 'xla' else 'false'
  workdir = os.path.join(float8_recipes._WORK.value, f'cost-{variant.replace(":", "-")}')
  fused = float8_quant.fused
  float8_quant.fused = patched_qdq(kind)  # read when the step is traced, below
  try:
    trainer = models.get_trainer_class(_MODEL.value)(config, workdir)
    trainer.runner.restore()
    it = iter(trainer.strategy.experimental_distribute_dataset(trainer.datasets.train))
    start = time.perf_counter()
    trainer.runner.train_loop.run(it, 1)
  finally:
    float8_quant.fused = fused
  return trainer, it, time.perf_counter() - start


def bits(trainer) -> list[bytes]:
  return [v.numpy().tobytes() for v in trainer.model.variables]


def measure(variants: list[str]) -> list[str]:
  total = 1 + _ROUNDS.value * _ROUND_STEPS.value
  built = {v: build(v, max(total, float8_recipes.FULL[_MODEL.value])) for v in variants}
  cpu, wall = dict.fromkeys(variants, 0.0), dict.fromkeys(variants, 0.0)
  for _ in range(_ROUNDS.value):
    for v in variants:
      trainer, it, _ = built[v]
      start, cpu_start = time.perf_counter(), time.process_time()
      trainer.runner.train_loop.run(it, _ROUND_STEPS.value)
      cpu[v] += time.process_time() - cpu_start
      wall[v] += time.perf_counter() - start
  n = _ROUNDS.value * _ROUND_STEPS.value
  base = cpu[variants[0]] / n
  lines = [
    f'| variant | CPU-s per step | vs {variants[0]} | s per step (wall) | first step (s, '
    'compilation) | weights after the steps |',
    '| --- | --- | --- | --- | --- | --- |',
  ]
  first: dict[str, tuple[str, list[bytes]]] = {}
  for v in variants:
    trainer, _, compile_s = built[v]
    recipe = v.split(':')[0]
    same = '-'
    if 'xla' not in v:
      weights = bits(trainer)
      if recipe in first:
        same = f'bit-identical to {first[recipe][0]}: {weights == first[recipe][1]}'
      else:
        first[recipe] = (v, weights)
    lines.append(
      f'| {v} | {cpu[v] / n:.3f} | {cpu[v] / n / base:.2f}x | {wall[v] / n:.3f} '
      f'| {compile_s:.1f} | {same} |'
    )
  return lines


def main(argv):
  del argv
  started = results_page.start()
  lines = measure(_VARIANTS.value)
  n = _ROUNDS.value * _ROUND_STEPS.value
  body = [
    '# Float8 step cost',
    '',
    f'{_MODEL.value}, {float8_recipes._POLICY.value} compute; {n} steps per variant in '
    f'{_ROUNDS.value} interleaved rounds of {_ROUND_STEPS.value}, after one compiling step.',
    '',
    *lines,
  ]
  print('\n'.join(lines), flush=True)
  results_page.write('float8_step_cost', '\n'.join(body), started=started)


if __name__ == '__main__':
  app.run(main)
