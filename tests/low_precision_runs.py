"""Trainer-level checks shared by tests/step/test_master_weights.py and
tests/step/test_state_bits.py:
skipped steps leave every stored tensor bit-identical, and a resumed run is bit-identical to an
uninterrupted one. Also runnable as `python tests/low_precision_runs.py OUT_DIR` with the CPU
split into 2 logical devices (MirroredStrategy); it writes OUT_DIR/results.json."""

from __future__ import annotations

import json
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny import TinyTrainer, tiny_config  # noqa: E402

SETTINGS = {
  'bfloat16_sr': dict(master_weights='bfloat16_sr'),
  'bfloat16_kahan': dict(master_weights='bfloat16_kahan'),
  'state_bits_8': dict(state_bits=8),
  'bfloat16_sr_state_bits_8': dict(master_weights='bfloat16_sr', state_bits=8),
}


def overrides(setting: str, optimizer: str = 'adamw', **extra) -> dict:
  s = SETTINGS[setting]
  return {
    'precision.policy': 'mixed_bfloat16',
    'precision.master_weights': s.get('master_weights', 'float32'),
    'optimizer.state_bits': s.get('state_bits', 32),
    'optimizer.name': optimizer,
    'optimizer.weight_decay': 0.01,
    'optimizer.clip_norm': 1.0,
    'optimizer.learning_rate': 1e-2,
    **extra,
  }


def stored(trainer) -> dict[str, np.ndarray]:
  """Every tensor the step may write: the model's weights and the optimizer's variables (slots,
  codes, scales, compensation buffers, iteration count), by position and name (the layer names
  Keras numbers per process, e.g. dense_2, are left out: two trainers are compared)."""
  out = {}
  for prefix, variables in (
    ('model', trainer.model.weights),
    ('optimizer', trainer.optimizer.variables),
  ):
    for i, v in enumerate(variables):
      out[f'{prefix}/{i}/{re.sub(r"_[0-9]+", "", v.name)}'] = np.array(v.numpy())
  return out


def identical(a: dict, b: dict) -> list[str]:
  """The names whose arrays differ in dtype or in any bit."""
  assert a.keys() == b.keys()
  return [k for k in a if a[k].dtype != b[k].dtype or a[k].tobytes() != b[k].tobytes()]


def replicas_differ(trainer) -> list[str]:
  """The variables whose mirrored copies differ in any bit (none under one device)."""
  out = []
  for v in [*trainer.model.weights, *trainer.optimizer.variables]:
    copies = [np.array(c.numpy()).tobytes() for c in getattr(v.value, 'values', (v.value,))]
    if len(set(copies)) > 1:
      out.append(v.path)
  return out


def run_steps(trainer, n: int, iterator=None):
  if iterator is None:
    iterator = iter(trainer.strategy.experimental_distribute_dataset(trainer.datasets.train))
  for _ in range(n):
    trainer.runner.train_loop.run(iterator, 1)
  return iterator


def skip_check(workdir: str, setting: str, optimizer: str = 'adamw', strategy=None) -> dict:
  """3 steps, then a step whose gradients are made non-finite (global step 3), then one more."""
  config = tiny_config(**overrides(setting, optimizer, **{'debug.inject_nonfinite_steps': '3'}))
  trainer = TinyTrainer(config, workdir, strategy=strategy)
  iterator = run_steps(trainer, 3)
  before = stored(trainer)
  run_steps(trainer, 1, iterator)
  after_skip = stored(trainer)
  skipped = int(trainer.train_step.skipped_steps.numpy())
  run_steps(trainer, 1, iterator)
  after_next = stored(trainer)
  return {
    'skipped': skipped,
    'changed_by_skip': identical(before, after_skip),
    'replicas_differ': replicas_differ(trainer),
    'changed_by_next': identical(after_skip, after_next),
    'dtypes': sorted({str(v.dtype) for v in trainer.model.trainable_variables}),
  }


def resume_check(
  root: str, setting: str, optimizer: str = 'adamw', strategy=None, steps: int = 20
) -> list[str]:
  """`steps` steps straight vs steps/2, a new trainer resuming the workdir, steps/2 more: the
  names of stored tensors that differ (none expected)."""
  extra = {
    'train.steps': steps,
    'train.checkpoint_every': 5,
    'train.steps_per_loop': 5,
    'train.log_every': 5,
    'train.deterministic': True,
    'numerics.every': 0,
  }
  straight = TinyTrainer(
    tiny_config(**overrides(setting, optimizer, **extra)),
    os.path.join(root, 'straight'),
    strategy=strategy,
  )
  straight.train()
  half = dict(extra, **{'train.steps': steps // 2})
  first = TinyTrainer(
    tiny_config(**overrides(setting, optimizer, **half)),
    os.path.join(root, 'resumed'),
    strategy=strategy,
  )
  first.train()
  resumed = TinyTrainer(
    tiny_config(**overrides(setting, optimizer, **extra)),
    os.path.join(root, 'resumed'),
    strategy=strategy,
  )
  resumed.train()
  assert int(resumed.global_step.numpy()) == steps
  return identical(stored(straight), stored(resumed))


def main(out_dir: str) -> None:
  import tensorflow as tf

  cpu = tf.config.list_physical_devices('CPU')[0]
  tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
  strategy = tf.distribute.MirroredStrategy(['CPU:0', 'CPU:1'])
  results = {}
  for setting in ('bfloat16_sr', 'bfloat16_kahan', 'state_bits_8'):
    check = skip_check(os.path.join(out_dir, f'skip_{setting}'), setting, strategy=strategy)
    results[setting] = {
      **check,
      'replicas': strategy.num_replicas_in_sync,
      'resume_differs': resume_check(
        os.path.join(out_dir, setting), setting, strategy=strategy, steps=10
      ),
    }
  with open(os.path.join(out_dir, 'results.json'), 'w') as f:
    json.dump(results, f)


if __name__ == '__main__':
  main(sys.argv[1])
  from quick_exit import exit_now

  exit_now()  # the results are written; skip TensorFlow's teardown (tests/quick_exit.py)
