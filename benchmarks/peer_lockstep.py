"""Lockstep: our trainer and the PyTorch model of benchmarks/peer_torch.py from the same start.

  python -m benchmarks.peer_lockstep                          # shakespeare shape, float32
  python -m benchmarks.peer_lockstep --shape=nanogpt_cpu --epsilon=torch --out=/tmp/lockstep

Not a test (PyTorch lives in its own virtual environment; see benchmarks/peer_torch.py). The
peer benchmark compares two runs that differ in their random streams (initial weights, batches);
this one removes both, so what is left is the two implementations. Our Trainer is built from the
shape's config (float32 by default; `--precision=bfloat16` for mixed_bfloat16 against autocast),
its initial weights are exported in PyTorch's layout (kernels transposed), and one batch of
training windows per step is drawn up front (NumPy, `--seed`). Our Trainer then trains on exactly
those batches, one per step, reading its loss every step; the PyTorch side
(benchmarks/peer_torch_model.py) loads the weights and the windows and trains the same steps.
Both evaluate the full validation split as in the peer benchmark.

`--epsilon`: Keras's Adam adds epsilon to sqrt(v) before the bias correction ("epsilon hat" in
Kingma and Ba), PyTorch's after it; 'keras' (default) makes the PyTorch side add it the Keras
way, so both run one update rule; 'torch' leaves PyTorch's own, to see what the convention alone
changes. Prints the per-step losses side by side at a few steps, the largest difference over all
steps and both validation losses; --out writes lockstep.md and lockstep.json.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from benchmarks import child  # noqa: E402
from benchmarks import results as results_page  # noqa: E402
from benchmarks import peer_torch  # noqa: E402  (its flags: --data, --steps, --out, --set)

_SHAPE = flags.DEFINE_enum('shape', 'shakespeare', list(peer_torch.SHAPES), 'The shape.')
_PRECISION = flags.DEFINE_enum(
  'precision', 'float32', list(peer_torch.PRECISIONS), 'float32 or bfloat16.'
)
_SEED = flags.DEFINE_integer('seed', 123, 'NumPy seed of the training windows.')
_EPSILON = flags.DEFINE_enum(
  'epsilon', 'keras', ['keras', 'torch'], "The PyTorch side's Adam epsilon convention."
)


def torch_name(path: str) -> str:
  """Our variable path -> the PyTorch state_dict name (benchmarks/peer_torch_model.py)."""
  layer, weight = path.split('/')[-2:]
  if layer == 'embed':
    return {'token_table': 'tokens.weight', 'position_table': 'positions.weight'}[weight]
  suffix = {'gamma': 'weight', 'beta': 'bias', 'kernel': 'weight', 'bias': 'bias'}
  if layer in ('final_ln', 'logits'):
    return f'{"ln" if layer == "final_ln" else "logits"}.{suffix[weight]}'
  block, part = layer.split('_', 1)  # block3_mlp_in -> block3, mlp_in
  if part == 'attention':
    part, weight = {
      'qkv_kernel': ('qkv', 'kernel'),
      'qkv_bias': ('qkv', 'bias'),
      'out_kernel': ('proj', 'kernel'),
      'out_bias': ('proj', 'bias'),
    }[weight]
  return f'blocks.{int(block[5:])}.{part}.{suffix[weight]}'


def run_ours(config, seed: int, folder: str) -> dict:
  """Draws one batch of training windows per step (NumPy, `seed`) from the trainer's own train
  split and saves them to <folder>/windows.npy, and its initial weights (PyTorch names and
  layout) to <folder>/init.npz; then trains our Trainer on exactly those batches. Returns the
  per-step losses and the validation loss."""
  import tensorflow as tf
  import models
  from trainer import Datasets

  class Lockstep(models.get_trainer_class(config.model)):
    def build_datasets(self):
      data = super().build_datasets()  # reads the corpus: self.corpus, self.m
      span, train = self.m.context + 1, self.corpus.train
      starts = np.random.default_rng(seed).integers(
        0, len(train) - span + 1, size=(config.train.steps, config.train.batch_size)
      )
      windows = train[starts[..., None] + np.arange(span)].astype(np.int32)
      np.save(os.path.join(folder, 'windows.npy'), windows)
      return Datasets(
        train=tf.data.Dataset.from_tensor_slices((windows[:, :, :-1], windows[:, :, 1:])),
        eval=data.eval,
        train_examples=windows.shape[0] * windows.shape[1],
      )

  losses = []

  def record(event):
    if event.kind == 'log':
      losses.append(float(event.metrics['loss']))

  def torch_layout(path, value):  # Dense kernels [in, out] -> Linear weights [out, in]
    return value.T if value.ndim == 2 and 'embed' not in path else value

  with tempfile.TemporaryDirectory(prefix='lockstep_') as workdir:
    trainer = Lockstep(config, workdir)
    np.savez(
      os.path.join(folder, 'init.npz'),
      **{torch_name(v.path): torch_layout(v.path, v.numpy()) for v in trainer.model.weights},
    )
    trainer.runner.actions.append(record)
    metrics = trainer.train()
  return {'side': 'ours', 'losses': losses, 'val_loss': float(metrics['loss'])}


def main(argv):
  del argv
  started, shape, precision = results_page.start(), _SHAPE.value, _PRECISION.value
  steps = peer_torch._STEPS.value or peer_torch.SHAPES[shape][1]
  config = peer_torch.config_for(shape, precision, steps, peer_torch._SET.value)
  config.train.steps_per_loop = config.train.log_every = 1  # a loss per step
  config.numerics.every = 0
  with tempfile.TemporaryDirectory(prefix='lockstep_') as folder:
    ours = run_ours(config, _SEED.value, folder)
    settings = {
      **peer_torch.torch_settings(config, precision),
      'init': os.path.join(folder, 'init.npz'),
      'windows': os.path.join(folder, 'windows.npy'),
      'keras_epsilon': _EPSILON.value == 'keras',
      'losses': True,
    }
    torch, _, _ = child.run(
      [
        peer_torch._TORCH_PYTHON.value,
        os.path.join(ROOT, 'benchmarks', 'peer_torch_model.py'),
        json.dumps(settings),
      ]
    )
  a, b = np.array(ours['losses']), np.array(torch['losses'])
  shown = sorted({1, 2, 10, 50, 100, steps // 2, steps} & set(range(1, steps + 1)))
  lines = [
    f'Lockstep, {shape}, {precision}, {steps} steps, windows seed {_SEED.value}, '
    f"PyTorch's epsilon: {_EPSILON.value} convention",
    '',
    '| step | ours train loss | PyTorch train loss | difference |',
    '|---|---|---|---|',
  ]
  lines += [
    f'| {s} | {a[s - 1]:.4f} | {b[s - 1]:.4f} | {a[s - 1] - b[s - 1]:+.5f} |' for s in shown
  ]
  worst = int(np.argmax(np.abs(a - b)))
  lines += [
    '',
    f'Largest difference over the {steps} steps: {a[worst] - b[worst]:+.5f} at step '
    f'{worst + 1}. Validation loss (full split): ours {ours["val_loss"]:.4f}, PyTorch '
    f'{torch["val_loss"]:.4f} ({ours["val_loss"] - torch["val_loss"]:+.4f}).',
  ]
  result = {
    'shape': shape,
    'precision': precision,
    'steps': steps,
    'seed': _SEED.value,
    'epsilon': _EPSILON.value,
    'ours': ours,
    'torch': torch,
  }
  child.report(
    peer_torch._OUT.value,
    'lockstep',
    '\n'.join(lines),
    [result],
    page='peer_lockstep',
    started=started,
    quick=peer_torch._QUICK.value,
  )


if __name__ == '__main__':
  app.run(main)
