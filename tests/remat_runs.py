"""Runs for tests/nn/test_remat.py that need the CPU split into 2 logical devices (a fresh process:
`python tests/remat_runs.py OUT_DIR NAME REMAT` with NAME float32 or mixed_float16 and REMAT 0
or 1 writes OUT_DIR/<NAME>_remat<REMAT>.npz): the tiny Transformer LM trained 3 steps under
MirroredStrategy, in float32, or in mixed_float16 with dynamic loss scaling and an injected
non-finite step. Each setting runs in its own process (the config's seed gives every run the same
initial weights): a second mirrored trainer with a different gradient graph in the same process
failed in a collective with a shape mismatch (seen with remat off too; not investigated)."""

from __future__ import annotations

import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3


def main(out_dir, only, remat):
  from distribute_runs import split_cpu

  split_cpu()
  sys.path[:0] = [ROOT, os.path.join(ROOT, 'tests', 'nn')]
  from test_remat import train

  arrays = {}
  for name, overrides in {
    'float32': {'precision.policy': 'float32'},
    'mixed_float16': {
      'precision.policy': 'mixed_float16',
      'precision.loss_scale': 'dynamic',
      'debug.inject_nonfinite_steps': '2',
    },
  }.items():
    if name != only:
      continue
    overrides.update({'distribute.strategy': 'mirrored', 'distribute.devices': 'CPU:0,CPU:1'})
    start, end, scalars = train(os.path.join(out_dir, f'{name}{remat}'), STEPS, remat, **overrides)
    for i, (a, b) in enumerate(zip(start, end)):
      arrays[f'{name}/start/{i}'], arrays[f'{name}/end/{i}'] = a, b
    for k, v in scalars.items():
      arrays[f'{name}/{k}'] = np.asarray(v)
  np.savez(os.path.join(out_dir, f'{only}_remat{remat}.npz'), **arrays)


if __name__ == '__main__':
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
  from quick_exit import exit_now

  exit_now()  # the results are written; skip TensorFlow's teardown (tests/quick_exit.py)
