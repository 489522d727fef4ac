"""The compiled inner loop and its public step contract.

`Trainer.build_train_step()` returns a `TrainStep`; the default one is a loss-scaled optimizer
update of `Trainer.compute_loss`. A custom step subclasses `TrainStep` and overrides what differs
(see "Beyond the three hooks" in the README for a two-optimizer GAN step):

  variables                   the variables the gradients are for (default: the model's
                              trainable variables); the optimizers are built over them.
  compute_gradients(batch)    PER REPLICA. Returns (outputs, grads): `grads` one unscaled float32
                              gradient (or None) per entry of `variables`; `outputs` a dict of
                              this replica's share of scalar values the host reads (e.g. 'loss':
                              the sum of per-example losses / global batch), summed over replicas.
                              An entry named like a stateful metric of `Trainer.build_metrics()`
                              holds the tuple of arguments for that metric's `update_state`.
                              Use `self.loss_scaler.scale_loss` / `.unscale` around the tape.
  apply_gradients(grads)      PER REPLICA, only when every gradient on every replica is finite.
                              Keras optimizers sum the replicas' gradients themselves.
  step(iterator)              CROSS-REPLICA: one whole step; returns a dict of scalar tensors.

One `step` (cross-replica context, inside the compiled loop):
  1. `strategy.run(self._replica_step)`: reads the forward-pass state (variables a layer assigns
     in `call`, such as BatchNormalization's moving statistics), `compute_gradients`, updates
     the stateful metrics, computes a non-finite count of this replica's gradients.
  2. `all_replicas_finite`: the counts are reduced over all replicas (SUM): one non-finite
     gradient anywhere skips the step everywhere; a non-finite learning rate skips it too.
  3. `apply_or_skip`: `tf.cond` in cross-replica context (a cond around `apply_gradients` inside
     `strategy.run` fails). apply: `strategy.run(apply_gradients)`. skip: the forward-pass state
     is put back, so weights, optimizer slots and that state are bit-identical to before the
     step; the collapse guard records which variables had non-finite gradients.
  4. `end_step`: the collapse guard counts, the loss scaler updates once with the all-replica
     flag, the global step advances (skipped or not).
  5. the outputs summed over replicas, plus the counters 'steps' (1), 'skipped' (0/1) and
     'nonfinite_loss' (0/1); every other output is zero on a step whose loss is not finite, so
     the host's means are over the steps whose loss was finite. Stateful metrics
     (`build_metrics`) are updated per replica, only when that replica's loss is finite.

The compiled loop (`train_loop`) runs `steps_per_loop` steps per call and sums the step outputs
in the loop's carry, added to one variable per output once per call; nothing in a call reads a
value back to the host. Between calls the host reads `global_step` (and, with the collapse guard
on, its counter), and at log time `read_outputs()` (sums since the last read, then reset).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import tensorflow as tf

from trainer.config import parse_steps
from trainer.errors import ConfigError
from trainer.loss_scale import all_finite, overwritten, state_variable
from trainer.skip_guard import SkipGuard

SUM = tf.distribute.ReduceOp.SUM
SKIP_SCOPE = 'skipped_step_only'  # name scope of the skip branch (benchmarks/run.py looks for it)
COUNTERS = ('steps', 'skipped', 'nonfinite_loss')  # outputs read as counts, not means

# compute_loss(batch, training=...) -> (per_example_loss [B], {metric name: per-example [B]})
LossFn = Callable[..., tuple[tf.Tensor, dict[str, tf.Tensor]]]


def forward_state(model) -> list[tf.Variable]:
  """The variables a forward pass may assign: the model's non-trainable variables (Batch-
  Normalization's moving statistics, any state a layer updates in `call`), as tf.Variables."""
  return [getattr(v, 'value', v) for v in model.non_trainable_variables]


@contextlib.contextmanager
def forward_state_kept(model):
  """Within: a forward pass may assign the model's forward state (`forward_state`); on exit every
  replica's copy of it is put back. Eager or while a tf.function traces (the reads and the
  restoring assignments are ordered with the forward pass's own by the shared variables)."""
  state = [c for v in forward_state(model) for c in getattr(v, 'values', (v,))]
  saved = [v.read_value() for v in state]
  try:
    yield
  finally:
    for variable, value in zip(state, saved):
      variable.assign(value)


class TrainStep:
  """The default step and the pieces a custom step reuses. Built by the trainer under the
  strategy's scope (it owns variables: the skip counter, the collapse guard, the output sums)."""

  def __init__(self, trainer):
    c = trainer.config
    self.trainer = trainer
    self.strategy = trainer.strategy
    self.model = trainer.model
    self.optimizer = trainer.optimizer
    self.loss_scaler = trainer.loss_scaler
    self.compute_loss = trainer.compute_loss
    self.metrics = dict(trainer.train_metrics)  # stateful Keras metrics, by name
    self.global_step = trainer.global_step
    self.global_batch_size = int(c.train.batch_size)
    self.clip_norm = float(c.optimizer.clip_norm)
    self.grad_accum_steps = int(c.train.grad_accum_steps)
    self.inject_every = int(c.debug.inject_nonfinite_every)
    self.inject_steps = parse_steps(c.debug.inject_nonfinite_steps)
    self.inject_replica = int(c.debug.inject_nonfinite_replica)
    replicas = self.strategy.num_replicas_in_sync
    per_replica = self.global_batch_size // replicas
    if per_replica % self.grad_accum_steps:
      raise ConfigError(f'config.train.grad_accum_steps={self.grad_accum_steps} does not divide '
                        f'the per-replica batch {per_replica} (config.train.batch_size='
                        f'{self.global_batch_size} over {replicas} replicas).')

    self.build_optimizers()
    # Keras float8 layers' scale and amax-history variables: their "gradients" are new values
    # (computed from the scaled backward pass, as the float8 casts see it), assigned by the
    # optimizer: never unscaled, clipped or summed, combined with MAX over micro-batches and
    # replicas.
    self.overwritten = overwritten(self.variables)
    self.skipped_steps = state_variable(0, tf.int64, 'skipped_steps')  # cumulative, checkpointed
    self.guard = SkipGuard(strategy=self.strategy, variables=self.variables,
                           max_consecutive_skips=c.precision.max_consecutive_skips)
    self._forward_state = forward_state(self.model)
    # Forensics: the loop stops right after the skip that brings skipped_steps to this count
    # (the host sets it; 0 = never), so the host sees that step's pre-step weights.
    self.forensics = c.numerics.forensics_first > 0 or c.numerics.forensics_every > 0
    self.stop_at_skip = state_variable(0, tf.int64, 'stop_at_skip')
    self._totals = None  # {output name: variable}, created on the first call (host side)

    replica_core = self._replica_core
    if trainer.jit_compile:
      compiled = tf.function(replica_core, jit_compile=True)
      # Called through a plain function: given a tf.function directly, MirroredStrategy.run
      # lifts it into one XLA cluster over all replicas unless every device is a GPU, and that
      # fails on other devices (a replica's variables read from another device).
      replica_core = lambda batch: compiled(batch)  # pylint: disable=unnecessary-lambda
    self._replica_core_fn = replica_core
    self.train_loop = tf.function(self._train_loop)

  def replica_share(self, batch):
    """The first examples of a global batch, as many as one replica's (first) micro-batch has in
    a step: batch_size / (replicas * grad_accum_steps). A probe that stands for a step (the
    numerics statistics) computes on it with `share_loss`, so its weight gradients have the
    magnitudes the step's have (a whole global batch sums replicas x micro-batches as many)."""
    n = self.global_batch_size // (self.strategy.num_replicas_in_sync * self.grad_accum_steps)
    return tf.nest.map_structure(lambda t: t[:n], batch)

  def share_loss(self, per_example_loss) -> tf.Tensor:
    """The loss the default step differentiates for one replica's (micro-)batch (its
    `compute_gradients` calls this; so does a probe on a `replica_share`): the per-example
    losses summed / global batch size, plus the model's regularization losses / (replicas x
    micro-batches); float32. Any context (no replica context needed)."""
    loss = tf.nn.compute_average_loss(tf.cast(per_example_loss, tf.float32),
                                      global_batch_size=self.global_batch_size)
    if self.model.losses:
      loss += tf.add_n([tf.cast(l, tf.float32) for l in self.model.losses]) / (
          self.strategy.num_replicas_in_sync * self.grad_accum_steps)
    return loss

  # ---- what a custom step overrides ---------------------------------------------------------
  @property
  def variables(self) -> list:
    """The variables `compute_gradients` returns gradients for, in that order."""
    return self.model.trainable_variables

  def build_optimizers(self) -> None:
    """Creates the optimizers' slots for `variables` (before any checkpoint is restored)."""
    self.optimizer.build(self.variables)

  def compute_gradients(self, batch):
    """Replica context: (outputs, grads) for one batch; see the module docstring.

    The default: `compute_loss`, loss averaged over the global batch, x scale, gradients,
    / scale in float32. With grad_accum_steps = k > 1 the replica's batch is split into k
    micro-batches (unrolled in the graph) whose unscaled float32 gradients are summed (each loss
    is already divided by the global batch, so the sum is the whole batch's gradient)."""
    k = self.grad_accum_steps
    if k == 1:
      return self._micro_gradients(batch)
    flat = [tf.split(t, k, axis=0) for t in tf.nest.flatten(batch)]
    outputs, grads = None, None
    for i in range(k):
      micro = tf.nest.pack_sequence_as(batch, [parts[i] for parts in flat])
      micro_outputs, micro_grads = self._micro_gradients(micro)
      micro_grads = [None if g is None else tf.convert_to_tensor(g) for g in micro_grads]
      if grads is None:
        outputs, grads = micro_outputs, micro_grads
        outputs = {n: [v] if n in self.metrics else v for n, v in outputs.items()}
        continue
      for name, value in micro_outputs.items():  # stateful metrics see every micro-batch
        outputs[name] = outputs[name] + ([value] if name in self.metrics else value)
      grads = [a if b is None else b if a is None else tf.maximum(a, b) if new_value else a + b
               for a, b, new_value in zip(grads, micro_grads, self.overwritten)]
    return {n: tuple(tf.concat(parts, 0) for parts in zip(*v)) if n in self.metrics else v
            for n, v in outputs.items()}, grads

  def apply_gradients(self, grads) -> None:
    """Replica context, finite steps only. With clipping, the norm is that of the gradient
    summed over replicas, computed once here and identical on every replica. The new values of
    `overwritten` variables are combined with MAX over replicas and left out of the norm."""
    grads = list(grads)
    context = tf.distribute.get_replica_context()
    stepped = [i for i, g in enumerate(grads) if g is not None and not self.overwritten[i]]
    if self.strategy.num_replicas_in_sync > 1:
      for i, g in enumerate(grads):
        if g is not None and self.overwritten[i]:
          grads[i] = tf.reduce_max(context.all_gather(g[None], axis=0), axis=0)
    if self.clip_norm > 0:
      summed = context.all_reduce(SUM, [grads[i] for i in stepped])
      norm = tf.linalg.global_norm(summed)
      # min(1, c / norm) is finite for every finite c and norm (a norm that overflows float32
      # gives 0, not NaN; a zero norm gives 1).
      factor = tf.where(norm > self.clip_norm, self.clip_norm / norm, 1.0)
      for i in stepped:
        grads[i] = grads[i] * factor
    self.optimizer.apply_gradients(zip(grads, self.variables))

  # ---- the reusable pieces ------------------------------------------------------------------
  def all_replicas_finite(self, nonfinite_counts) -> tf.Tensor:
    """Cross-replica: True when no replica counted a non-finite gradient and the learning rate
    of this step is finite (so nothing applied after the check can be non-finite)."""
    nonfinite = self.strategy.reduce(SUM, nonfinite_counts, axis=None)
    rate = tf.cast(self.optimizer.learning_rate, tf.float32)  # the rate this update would use
    return tf.logical_and(tf.equal(nonfinite, 0), tf.math.is_finite(rate))

  def apply_or_skip(self, finite, grads, saved_state=None) -> tf.Tensor:
    """Cross-replica: applies `grads` (PerReplica) when `finite`; otherwise restores the
    forward-pass state read before the forward pass and records the skip. Returns 1 when
    skipped, else 0 (int64)."""

    def apply():
      self.strategy.run(self.apply_gradients, args=(grads,))
      return tf.constant(0, tf.int64)

    def skip():
      with tf.name_scope(SKIP_SCOPE):  # ops here run on skipped steps only
        if saved_state:
          for variable, value in zip(self._forward_state, saved_state):
            self.strategy.extended.update(variable, lambda v, x: v.assign(x), args=(value,))
        self.guard.record(grads, self.global_step, self.loss_scaler.scale)
        return tf.constant(1, tf.int64)

    skipped = tf.cond(finite, apply, skip)
    self.skipped_steps.assign_add(skipped)
    return skipped

  def end_step(self, finite, loss_finite=True) -> None:
    """Cross-replica, once per step: collapse-guard count, loss-scale update, global step + 1."""
    self.guard.count(tf.logical_and(finite, loss_finite))
    self.loss_scaler.update(finite)
    self.global_step.assign_add(1)

  # ---- one step -----------------------------------------------------------------------------
  def _replica_core(self, batch):
    """Per replica (the part jit_compile compiles): forward state read first, then the
    gradients, the debug injection and this replica's non-finite count."""
    saved = [v.read_value() for v in self._forward_state]
    outputs, grads = self.compute_gradients(batch)
    grads = self._maybe_inject(list(grads))
    nonfinite = tf.cast(tf.logical_not(all_finite(grads)), tf.int32)  # 0 or 1 on this replica
    return outputs, grads, nonfinite, saved

  def _replica_step(self, batch):
    outputs, grads, nonfinite, saved = self._replica_core_fn(batch)
    outputs = dict(outputs)
    updates = [(metric, outputs.pop(name)) for name, metric in self.metrics.items()
               if name in outputs]
    if updates:  # outside XLA: metric variables sync on read

      def update():
        for metric, args in updates:
          metric.update_state(*args)
        return tf.constant(True)

      # As the summed outputs leave out steps whose loss is not finite, the stateful metrics
      # leave out this replica's non-finite-loss steps (a NaN logit would corrupt an AUC).
      loss_finite = (tf.reduce_all(tf.math.is_finite(outputs['loss'])) if 'loss' in outputs
                     else tf.constant(True))
      tf.cond(loss_finite, update, lambda: tf.constant(False))
    return outputs, grads, nonfinite, saved

  def step(self, iterator) -> dict[str, tf.Tensor]:
    """Cross-replica: one step on the next batch of `iterator`; the outputs the loop sums."""
    batch = next(iterator)
    outputs, grads, nonfinite, saved = self.strategy.run(self._replica_step, args=(batch,))
    finite = self.all_replicas_finite(nonfinite)
    outputs = {k: self.strategy.reduce(SUM, v, axis=None) for k, v in outputs.items()}
    skipped = self.apply_or_skip(finite, grads, saved)
    loss_finite = tf.math.is_finite(outputs['loss']) if 'loss' in outputs else True
    self.end_step(finite, loss_finite)
    return self.with_counters(outputs, skipped, loss_finite)

  @staticmethod
  def with_counters(outputs, skipped, loss_finite=True) -> dict[str, tf.Tensor]:
    """`outputs` as float32, zeroed when the loss is not finite, plus the three counters."""
    loss_finite = tf.convert_to_tensor(loss_finite)
    values = {k: tf.where(loss_finite, tf.cast(v, tf.float32), 0.0) for k, v in outputs.items()}
    values.update(steps=tf.constant(1.0), skipped=tf.cast(skipped, tf.float32),
                  nonfinite_loss=1.0 - tf.cast(loss_finite, tf.float32))
    return values

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

  def _micro_gradients(self, batch):
    with tf.GradientTape() as tape:
      per_example_loss, metrics = self.compute_loss(batch, training=True)
      loss = self.share_loss(per_example_loss)
      scaled_loss = self.loss_scaler.scale_loss(loss)
    grads = self.loss_scaler.unscale(tape.gradient(scaled_loss, self.variables), self.variables)
    outputs = {'loss': loss}
    for name, value in metrics.items():
      outputs[name] = (tuple(value) if name in self.metrics else
                       tf.reduce_sum(tf.cast(value, tf.float32)) / self.global_batch_size)
    return outputs, grads

  # ---- the compiled loop and the host's reads ----------------------------------------------
  def _train_loop(self, iterator, num_steps):
    totals = {k: tf.zeros_like(v) for k, v in self._totals.items()}
    for _ in tf.range(num_steps):
      outputs = self.step(iterator)
      totals = {k: totals[k] + outputs[k] for k in totals}
      if self.guard.collapsed():  # stops early; the trainer raises CollapseError
        break
      if self.forensics and tf.logical_and(self.stop_at_skip > 0,
                                           tf.equal(self.skipped_steps, self.stop_at_skip)):
        break  # the trainer replays the skipped step (trainer/forensics.py), then goes on
    for k, v in totals.items():
      self._totals[k].assign_add(v)

  def run(self, iterator, num_steps) -> None:
    """Host side: one compiled call of `num_steps` steps. The first call finds the step's
    output names (by tracing `step` once) and creates one sum variable per output."""
    if self._totals is None:
      spec = tf.function(self.step).get_concrete_function(iterator).structured_outputs
      with self.strategy.scope():
        self._totals = {k: state_variable(0.0, tf.float32, f'sum_{k}') for k in sorted(spec)}
    self.train_loop(iterator, tf.constant(num_steps, tf.int64))

  def read_outputs(self) -> dict[str, float]:
    """Host side: the counters as counts, every other output as its mean over the steps whose
    loss was finite (NaN when there were none), since the last read; resets the sums. Then
    the stateful metrics' results (reset too)."""
    if self._totals is None:
      return {}
    sums = {k: float(v.numpy()) for k, v in self._totals.items()}
    for v in self._totals.values():
      v.assign(0.0)
    counted = sums.get('steps', 0.0) - sums.get('nonfinite_loss', 0.0)
    means = {k: (v / counted if counted else float('nan')) for k, v in sums.items()
             if k not in COUNTERS}
    ordered = {'loss': means.pop('loss')} if 'loss' in means else {}
    ordered.update(means)
    ordered.update(read_metrics(self.metrics))
    ordered.update({k: int(sums[k]) for k in COUNTERS if k in sums})
    return ordered


def read_metrics(metrics) -> dict[str, float]:
  """Host side: {name: result} of stateful Keras metrics, then reset them."""
  results = {name: float(metric.result()) for name, metric in metrics.items()}
  for metric in metrics.values():
    metric.reset_state()
  return results


class EvalLoop:
  """One pass over a (distributed) dataset inside a tf.function: sums of per-example loss and
  metrics over every example, divided by the count, so no example is dropped or counted twice;
  stateful metrics (`Trainer.build_metrics()`) are updated per replica and read on the host."""

  def __init__(self, *, strategy, compute_loss: LossFn, metric_names, metrics=None):
    self.strategy = strategy
    self.compute_loss = compute_loss
    self.metrics = dict(metrics or {})
    self.metric_names = ('loss', *(n for n in metric_names if n not in self.metrics))
    self.run = tf.function(self._run)

  def _replica_sums(self, batch):
    per_example_loss, metrics = self.compute_loss(batch, training=False)
    sums = {'loss': tf.reduce_sum(tf.cast(per_example_loss, tf.float32))}
    for name, value in metrics.items():
      if name in self.metrics:
        self.metrics[name].update_state(*value)
      else:
        sums[name] = tf.reduce_sum(tf.cast(value, tf.float32))
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

  def evaluate(self, dataset) -> dict[str, float]:
    """Host side: resets the stateful metrics, one pass, {'loss': ..., <metric>: ...}."""
    for metric in self.metrics.values():
      metric.reset_state()
    means, _ = self.run(dataset)
    results = {k: float(v) for k, v in means.items()}
    results.update(read_metrics(self.metrics))
    return results
