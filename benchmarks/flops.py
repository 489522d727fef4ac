"""FLOPs per training step, counted from the model, and the machine's measured matmul peak.

FLOPs per step: the forward pass, loss and gradients of one global batch (the model's own
`compute_loss` under `tape.gradient`) traced into a graph, whose float operations
`tf.compat.v1.profiler` sums as TensorFlow registers them per op (2 per multiply-add). The update
and ops without a registered count (element-wise ones, softmax) count 0: MFU is a lower bound.

Peak: a square `tf.matmul` of float32 (and bfloat16, float16) operands, timed best-of-N in the same
process as the training runs; 2 n^3 FLOPs per product.
"""

from __future__ import annotations

import time

import tensorflow as tf


def step_flops(trainer) -> int:
  """Float operations of one forward + backward pass of `trainer`'s model on one batch."""
  spec = trainer.datasets.train.element_spec
  model = trainer.model

  @tf.function
  def grads(batch):
    with tf.GradientTape() as tape:
      per_example_loss, _ = trainer.compute_loss(batch, training=True)
      loss = tf.reduce_mean(tf.cast(per_example_loss, tf.float32))
    return tape.gradient(loss, model.trainable_variables)

  graph = grads.get_concrete_function(spec).graph
  options = tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()
  options['output'] = 'none'
  profile = tf.compat.v1.profiler.profile(graph, options=options)
  return int(profile.total_float_ops)


def matmul_peak(dtype: tf.DType, n: int, repeats: int = 5) -> float:
  """FLOP/s of the fastest of `repeats` n x n matmuls (after one warm-up)."""
  a = tf.random.normal([n, n], dtype=tf.float32)
  b = tf.random.normal([n, n], dtype=tf.float32)
  a, b = tf.cast(a, dtype), tf.cast(b, dtype)
  matmul = tf.function(lambda x, y: tf.reduce_sum(tf.cast(tf.matmul(x, y)[0, :1], tf.float32)))
  matmul(a, b).numpy()
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a, b).numpy()
    best = min(best, time.perf_counter() - start)
  return 2.0 * n**3 / best
