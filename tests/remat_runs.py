"""Runs for tests/test_remat.py that need the CPU split into 2 logical devices (a fresh process:
`python tests/remat_runs.py OUT_DIR` writes OUT_DIR/results.json): a Transformer LM trained under
MirroredStrategy with train.remat on and off from the same weights, in float32 and in
mixed_float16 with dynamic loss scaling and an injected non-finite step."""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 3


def main(out_dir):
  from distribute_runs import split_cpu
  split_cpu()
  sys.path.insert(0, ROOT)
  from test_remat import train_pair
  results = {}
  for name, overrides in {
      'float32': {'precision.policy': 'float32'},
      'mixed_float16': {'precision.policy': 'mixed_float16', 'precision.loss_scale': 'dynamic',
                        'debug.inject_nonfinite_steps': '2'}}.items():
    overrides.update({'distribute.strategy': 'mirrored', 'distribute.devices': 'CPU:0,CPU:1'})
    pair = train_pair(os.path.join(out_dir, name), STEPS, **overrides)
    results[name] = pair
  with open(os.path.join(out_dir, 'results.json'), 'w') as f:
    json.dump(results, f)


if __name__ == '__main__':
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  main(sys.argv[1])
