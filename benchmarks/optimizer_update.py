"""The Adam update alone: Keras's Adam, TF's one-kernel ResourceApplyAdam, and ours (FusedAdam).

  python benchmarks/optimizer_update.py [--shapes=784x128,128,128x10,10] [--rounds=7]

Times `--updates` compiled `apply_gradients` calls (one tf.function looping over them) on
variables of the given shapes (default: the MNIST MLP's), the contenders interleaved in rounds
in one process; prints the median time per update and each contender's speed relative to
Keras's Adam. bfloat16_sr, bfloat16_kahan (bfloat16 variables), state_bits_8 and the two
combinations (bfloat16_sr_8, bfloat16_kahan_8) are trainer/optim/low_precision.py's Adam updates
(`--low_precision`, default on). `tf_kernel` is
the one-kernel update trainer/optim/fused_optimizers.py used before
it was made bit-identical to Keras (its `1 - beta` rounds differently); it is here as the speed
bound.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

from benchmarks import results as results_page  # noqa: E402  (--results_dir)

_SHAPES = flags.DEFINE_string(
  'shapes', '784x128,128,128x10,10', 'Variable shapes, comma-separated.'
)
_ROUNDS = flags.DEFINE_integer('rounds', 7, 'Interleaved rounds.')
_UPDATES = flags.DEFINE_integer('updates', 200, 'Updates per contender per round.')
_LOW = flags.DEFINE_bool(
  'low_precision', True, 'Also time the 16-bit-master and 8-bit-state updates.'
)


def contenders():
  import keras
  import tensorflow as tf

  from trainer.optim import fused_optimizers

  class TfKernelAdam(keras.optimizers.Adam):
    def update_step(self, gradient, variable, learning_rate):
      index = self._get_variable_index(variable)
      handle = lambda v: fused_optimizers._resource(v).handle  # pylint: disable=protected-access
      step = tf.cast(self.iterations + 1, tf.float32)
      tf.raw_ops.ResourceApplyAdam(
        var=handle(variable),
        m=handle(self._momentums[index]),
        v=handle(self._velocities[index]),
        beta1_power=tf.pow(self.beta_1, step),
        beta2_power=tf.pow(self.beta_2, step),
        lr=tf.cast(learning_rate, tf.float32),
        beta1=self.beta_1,
        beta2=self.beta_2,
        epsilon=self.epsilon,
        grad=gradient,
      )

  out = {
    'keras': keras.optimizers.Adam,
    'tf_kernel': TfKernelAdam,
    'ours': fused_optimizers.FusedAdam,
  }
  if _LOW.value:
    import functools

    from trainer.optim import low_precision

    for name, kwargs in (
      ('bfloat16_sr', dict(master_weights='bfloat16_sr')),
      ('bfloat16_kahan', dict(master_weights='bfloat16_kahan')),
      ('state_bits_8', dict(state_bits=8)),
      ('bfloat16_sr_8', dict(master_weights='bfloat16_sr', state_bits=8)),
      ('bfloat16_kahan_8', dict(master_weights='bfloat16_kahan', state_bits=8)),
    ):
      out[name] = functools.partial(low_precision.LowPrecisionAdam, **kwargs)
  return out


def measure_and_print(argv):
  del argv
  import numpy as np
  import tensorflow as tf

  shapes = [tuple(int(d) for d in s.split('x')) for s in _SHAPES.value.split(',')]
  rng = np.random.default_rng(0)
  grads = [tf.constant(rng.normal(size=s).astype(np.float32) * 1e-2) for s in shapes]
  runs = {}
  for name, cls in contenders().items():
    dtype = tf.bfloat16 if name.startswith('bfloat16') else tf.float32
    variables = [tf.Variable(tf.cast(rng.normal(size=s).astype(np.float32), dtype)) for s in shapes]
    optimizer = cls(learning_rate=1e-3)
    optimizer.build(variables)

    @tf.function
    def loop(n, optimizer=optimizer, variables=variables):
      for _ in tf.range(n):
        optimizer.apply_gradients(zip(grads, variables))

    loop(tf.constant(2))  # trace and warm up
    runs[name] = loop
  times = {name: [] for name in runs}
  n = tf.constant(_UPDATES.value)
  for _ in range(_ROUNDS.value):
    for name, loop in runs.items():
      start = time.perf_counter()
      loop(n)
      times[name].append((time.perf_counter() - start) / _UPDATES.value)
  print(f'shapes {_SHAPES.value}, {_ROUNDS.value} rounds of {_UPDATES.value} updates\n')
  print('| update | us per update (median, min-max) | speed vs Keras (median of rounds) |')
  print('|---|---|---|')
  for name, ts in times.items():
    ratio = statistics.median(k / t for k, t in zip(times['keras'], ts))
    print(
      f'| {name} | {statistics.median(ts) * 1e6:.1f} ({min(ts) * 1e6:.1f}-'
      f'{max(ts) * 1e6:.1f}) | {ratio:.2f}x |'
    )


def main(argv):
  """What it prints is also docs/results/optimizer_update.md (benchmarks/results.py)."""
  with results_page.recording('optimizer_update', markdown=True):
    measure_and_print(argv)


if __name__ == '__main__':
  app.run(main)
