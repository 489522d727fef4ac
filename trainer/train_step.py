"""The compiled inner loop: one loss-scaled optimizer update, run `steps_per_loop` times per call.

A step (cross-replica context, inside one `tf.function`):
  1. `strategy.run(replica_grads)`: forward under the GradientTape, loss averaged over the global
     batch (`tf.nn.compute_average_loss`), loss x scale, gradients, divide by the scale in float32,
     a per-replica non-finite flag (0/1). This per-replica compute is what `jit_compile` compiles.
  2. The flags are reduced over all replicas (a SUM of non-finite counts): one non-finite gradient
     anywhere skips the step everywhere.
  3. `tf.cond(finite, apply, skip)`: `apply` runs `strategy.run(apply_gradients)`; `skip` leaves
     weights and optimizer slots bit-identical and only records (and prints) which variables had
     non-finite gradients (`trainer/skip_guard.py`; the loop stops early on a collapse).
  4. The loss scaler updates once with the all-replica flag; the global step advances either way;
     skipped steps are counted; loss and metrics are accumulated for the host to read between calls
     (summed in the loop's carried tensor and added to one variable once per call: per-step
     variable updates cost a measurable share of a small model's step).
Nothing in a call reads a value back to the host.
"""
from __future__ import annotations

from typing import Callable

import tensorflow as tf

from trainer.errors import ConfigError
from trainer.loss_scale import LossScaler, all_finite, state_variable
from trainer.skip_guard import SkipGuard

SUM = tf.distribute.ReduceOp.SUM
SKIP_SCOPE = 'skipped_step_only'  # name scope of the skip branch (benchmarks/run.py looks for it)

# compute_loss(batch, training=...) -> (per_example_loss [B], {metric name: per-example [B]})
LossFn = Callable[..., tuple[tf.Tensor, dict[str, tf.Tensor]]]


class TrainStep:
  """Builds the compiled train loop for one model, optimizer and loss scaler.

  Create it under the strategy's scope (it owns variables: the skip counter and the metric
  accumulators). `global_step` is the trainer's: it also drives the learning-rate schedule.
  """

  def __init__(self, *, strategy: tf.distribute.Strategy, model, optimizer,
               loss_scaler: LossScaler, compute_loss: LossFn, metric_names,
               global_step: tf.Variable, global_batch_size: int, clip_norm: float = 0.0,
               jit_compile: bool = False,
               inject_every: int = 0, inject_steps=(), inject_replica: int = -1,
               max_consecutive_skips: int = 0, grad_accum_steps: int = 1):
    self.strategy = strategy
    self.model = model
    self.optimizer = optimizer
    self.loss_scaler = loss_scaler
    self.compute_loss = compute_loss
    self.global_batch_size = int(global_batch_size)
    self.clip_norm = float(clip_norm)
    self.inject_every = int(inject_every)
    self.inject_steps = tuple(int(s) for s in inject_steps)
    self.inject_replica = int(inject_replica)
    self.grad_accum_steps = int(grad_accum_steps)
    per_replica = self.global_batch_size // strategy.num_replicas_in_sync
    if per_replica % self.grad_accum_steps:
      raise ConfigError(f'config.train.grad_accum_steps={self.grad_accum_steps} does not divide '
                        f'the per-replica batch {per_replica} (config.train.batch_size='
                        f'{self.global_batch_size} over {strategy.num_replicas_in_sync} '
                        'replicas).')

    self.global_step = global_step
    self.skipped_steps = state_variable(0, tf.int64, 'skipped_steps')  # cumulative, checkpointed
    self.guard = SkipGuard(strategy=strategy, variables=model.trainable_variables,
                           max_consecutive_skips=max_consecutive_skips)
    # Accumulated between host reads (reset by `read_metrics`); not checkpointed. One vector:
    # the sums of ('loss', *metric_names), then the number of steps whose loss was finite.
    self._metric_names = ('loss', *metric_names)
    self._totals = state_variable(tf.zeros([len(self._metric_names) + 1]), tf.float32,
                                  'metric_totals')

    replica_grads = self._replica_grads
    if jit_compile:
      compiled = tf.function(replica_grads, jit_compile=True)
      # Called through a plain function: given a tf.function directly, MirroredStrategy.run
      # lifts it into one XLA cluster over all replicas unless every device is a GPU, and that
      # fails on other devices (a replica's variables read from another device).
      replica_grads = lambda batch: compiled(batch)  # pylint: disable=unnecessary-lambda
    self._replica_grads_fn = replica_grads
    self.train_loop = tf.function(self._train_loop)

  # ---- per replica -------------------------------------------------------------------------
  def _replica_grads(self, batch):
    """With grad_accum_steps = k > 1 the replica's batch is split into k micro-batches whose
    unscaled float32 gradients are summed (each loss is already divided by the global batch, so
    the sum is the whole batch's gradient); one non-finite micro-batch makes the sum, hence the
    step, non-finite. The k micro-batches are unrolled in the graph."""
    k = self.grad_accum_steps
    if k == 1:
      loss, metric_shares, grads = self._micro_grads(batch, 1.0)
    else:
      flat = [tf.split(t, k, axis=0) for t in tf.nest.flatten(batch)]
      loss, metric_shares, grads = 0.0, None, None
      for i in range(k):
        micro = tf.nest.pack_sequence_as(batch, [parts[i] for parts in flat])
        micro_loss, micro_metrics, micro_grads = self._micro_grads(micro, 1.0 / k)
        micro_grads = [None if g is None else tf.convert_to_tensor(g) for g in micro_grads]
        loss += micro_loss
        if grads is None:
          metric_shares, grads = micro_metrics, micro_grads
        else:
          metric_shares = {m: metric_shares[m] + v for m, v in micro_metrics.items()}
          grads = [a if b is None else b if a is None else a + b
                   for a, b in zip(grads, micro_grads)]
    grads = self._maybe_inject(grads)
    nonfinite = tf.cast(tf.logical_not(all_finite(grads)), tf.int32)  # 0 or 1 on this replica
    return loss, metric_shares, grads, nonfinite

  def _micro_grads(self, batch, regularization_weight):
    variables = self.model.trainable_variables
    with tf.GradientTape() as tape:
      per_example_loss, metrics = self.compute_loss(batch, training=True)
      per_example_loss = tf.cast(per_example_loss, tf.float32)
      loss = tf.nn.compute_average_loss(per_example_loss,
                                        global_batch_size=self.global_batch_size)
      if self.model.losses:
        loss += regularization_weight * tf.nn.scale_regularization_loss(
            tf.add_n([tf.cast(l, tf.float32) for l in self.model.losses]))
      scaled_loss = self.loss_scaler.scale_loss(loss)
    grads = self.loss_scaler.unscale(tape.gradient(scaled_loss, variables))
    metric_shares = {k: tf.reduce_sum(tf.cast(v, tf.float32)) / self.global_batch_size
                     for k, v in metrics.items()}
    return loss, metric_shares, grads

  def _maybe_inject(self, grads):
    """debug.inject_nonfinite_*: makes the gradients of chosen global steps non-finite, on
    every replica or only on replica `inject_replica`."""
    if not (self.inject_every or self.inject_steps):
      return grads
    step = self.global_step.read_value()
    hit = tf.constant(False)
    if self.inject_every:
      hit = tf.logical_or(hit, tf.logical_and(step > 0, step % self.inject_every == 0))
    if self.inject_steps:
      hit = tf.logical_or(hit, tf.reduce_any(tf.equal(step, self.inject_steps)))
    if self.inject_replica >= 0:
      replica = tf.distribute.get_replica_context().replica_id_in_sync_group
      hit = tf.logical_and(hit, tf.equal(replica, self.inject_replica))
    poison = tf.where(hit, float('inf'), 1.0)
    first = next(i for i, g in enumerate(grads) if g is not None)
    return [g * poison if i == first else g for i, g in enumerate(grads)]

  def _apply(self, grads):
    """Replica context. Keras 3 optimizers all-reduce (sum) gradients inside apply_gradients,
    so each replica passes its local share; with clipping the norm is that of the summed
    gradient, computed once here and identical on every replica."""
    if self.clip_norm > 0:
      context = tf.distribute.get_replica_context()
      summed = context.all_reduce(SUM, grads)
      norm = tf.linalg.global_norm(summed)
      factor = self.clip_norm / tf.maximum(norm, self.clip_norm)
      grads = [g * factor for g in grads]
    self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))

  # ---- cross replica -----------------------------------------------------------------------
  def _step(self, iterator):
    batch = next(iterator)
    loss, metrics, grads, nonfinite = self.strategy.run(self._replica_grads_fn, args=(batch,))
    finite = tf.equal(self.strategy.reduce(SUM, nonfinite, axis=None), 0)  # all replicas
    loss = self.strategy.reduce(SUM, loss, axis=None)
    metrics = {k: self.strategy.reduce(SUM, v, axis=None) for k, v in metrics.items()}

    def apply():
      self.strategy.run(self._apply, args=(grads,))
      return tf.constant(0, tf.int64)

    def skip():
      with tf.name_scope(SKIP_SCOPE):  # ops here run on skipped steps only
        self.guard.record(grads, self.global_step, self.loss_scaler.scale)
        return tf.constant(1, tf.int64)

    self.skipped_steps.assign_add(tf.cond(finite, apply, skip))
    self.guard.count(finite)
    self.loss_scaler.update(finite)
    self.global_step.assign_add(1)

    # This step's (loss, *metrics, 1), or zeros when the loss is not finite.
    values = tf.stack([loss, *(metrics[k] for k in self._metric_names[1:]), 1.0])
    return tf.where(tf.math.is_finite(loss), values, tf.zeros_like(values))

  def _train_loop(self, iterator, num_steps):
    totals = tf.zeros_like(self._totals)
    for _ in tf.range(num_steps):
      totals += self._step(iterator)
      if self.guard.collapsed():  # stops early; the trainer raises CollapseError
        break
    self._totals.assign_add(totals)

  def read_metrics(self) -> dict[str, float]:
    """Means since the last read over steps whose loss was finite; resets the sums. Host side."""
    *sums, count = (float(x) for x in self._totals.numpy())
    means = {k: (v / count if count else float('nan')) for k, v in zip(self._metric_names, sums)}
    self._totals.assign(tf.zeros_like(self._totals))
    return means


class EvalLoop:
  """One pass over a (distributed) dataset inside a tf.function: sums of per-example loss and
  metrics over every example, divided by the count, so no example is dropped or counted twice."""

  def __init__(self, *, strategy, compute_loss: LossFn, metric_names):
    self.strategy = strategy
    self.compute_loss = compute_loss
    self.metric_names = ('loss', *metric_names)
    self.run = tf.function(self._run)

  def _replica_sums(self, batch):
    per_example_loss, metrics = self.compute_loss(batch, training=False)
    sums = {'loss': tf.reduce_sum(tf.cast(per_example_loss, tf.float32))}
    sums.update({k: tf.reduce_sum(tf.cast(v, tf.float32)) for k, v in metrics.items()})
    count = tf.cast(tf.shape(per_example_loss)[0], tf.float32)
    return sums, count

  def _run(self, dataset):
    totals = {k: tf.constant(0.0) for k in self.metric_names}
    count = tf.constant(0.0)
    for batch in dataset:
      sums, n = self.strategy.run(self._replica_sums, args=(batch,))
      totals = {k: totals[k] + self.strategy.reduce(SUM, sums[k], axis=None) for k in totals}
      count += self.strategy.reduce(SUM, n, axis=None)
    return {k: v / count for k, v in totals.items()}, count
