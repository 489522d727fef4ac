"""The compiled inner loop and its public step contract.

`Trainer.build_train_step()` returns a `TrainStep`; the default one is a loss-scaled optimizer
update of `Trainer.compute_loss`. A custom step subclasses `TrainStep` and overrides what differs
(docs/guides/custom-steps.md has a two-optimizer GAN step):

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
  groups                      the update groups (`UpdateGroup(optimizer, variables,
                              loss_scaler)`); default: one, (trainer.optimizer, `variables`,
                              trainer.loss_scaler). A step with several (a GAN's discriminator
                              and generator, each with its own loss scale) lists them here:
                              `variables` is then their variables in order, each group is
                              applied or skipped on its own gradients' finiteness
                              (`apply_group`), and each loss scaler updates on its groups' flag.

One `step` (cross-replica context, inside the compiled loop):
  1. `strategy.run(self.replica_step)` (public; a custom `step` calls it): reads the forward-pass
     state (variables a layer assigns in `call`, such as BatchNormalization's moving statistics),
     `compute_gradients`, the debug injection, the stateful metrics' updates, and this replica's
     non-finite count of each group's gradients.
  2. `groups_finite` (one flag per group; `all_replicas_finite` is their AND): the counts are
     reduced over all replicas (SUM): one non-finite gradient anywhere skips that group's update
     everywhere; a non-finite learning rate skips it too.
  3. `apply_or_skip`: `tf.cond` in cross-replica context (a cond around `apply_gradients` inside
     `strategy.run` fails). apply: `strategy.run(apply_gradients)` (with several groups, one cond
     and `strategy.run(apply_group)` per group). skip (any group): the forward-pass state is put
     back, so weights, optimizer slots and that state are bit-identical to before the step; the
     collapse guard records which variables had non-finite gradients.
  4. `end_step`: the collapse guard counts, each loss scaler updates once with its all-replica
     flag (not when the rate was non-finite), the global step advances (skipped or not).
  5. the outputs summed over replicas, plus the counters 'steps' (1), 'skipped' (0/1) and
     'nonfinite_loss' (0/1); every other output is zero on a step whose loss is not finite, so
     the host's means are over the steps whose loss was finite. Stateful metrics
     (`build_metrics`) are updated per replica, only when that replica's loss is finite.

The hooks above (and Trainer.compute_loss, a stateful metric's update_state) are converted by
autograph as in any tf.function; the framework's own pieces are traced as written, without it
(trainer/step/user_code.py). The compiled loop running `step` (`train_loop`): trainer/step/loop.py.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import tensorflow as tf

from trainer.steps_text import steps as parse_steps
from trainer.errors import ConfigError
from trainer.step.loss_scale import all_finite, overwritten, state_variable, update_scalers
from trainer.step import contract, inject, low_precision, optimizers
from trainer.step.loop import CompiledLoop
from trainer.step import outputs as step_outputs
from trainer.step import user_code
from trainer.step.forward_state import forward_state, forward_state_kept  # noqa: F401
from trainer.step.skip_guard import SkipGuard

SUM = tf.distribute.ReduceOp.SUM


class UpdateGroup(NamedTuple):
  """One optimizer's share of a step: the variables it updates and the loss scaler their
  gradients were scaled with (`compute_gradients` scales that loss with it and unscales)."""

  optimizer: Any
  variables: list
  loss_scaler: Any


SKIP_SCOPE = 'skipped_step_only'  # name scope of the skip branch (benchmarks/run.py looks for it)


def global_norm(grads) -> tf.Tensor:
  """The L2 norm (float32) of all of `grads` as the dense gradients they stand for. An
  IndexedSlices (an embedding's gradient) holds one row per lookup: a token seen twice in the
  batch has two rows that its dense gradient sums, so they are summed per index first.
  tf.linalg.global_norm takes the rows as they are, which under-reports such a gradient: the
  clipped gradients were then larger than `clip_norm` (tests/step/test_train_step.py)."""
  squares = []
  for g in grads:
    if isinstance(g, tf.IndexedSlices):
      unique, position = tf.unique(g.indices)
      g = tf.math.unsorted_segment_sum(g.values, position, tf.shape(unique)[0])
    squares.append(tf.reduce_sum(tf.square(tf.cast(g, tf.float32))))
  return tf.sqrt(tf.add_n(squares)) if squares else tf.constant(0.0)


class TrainStep(CompiledLoop):
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
      raise ConfigError(
        f'config.train.grad_accum_steps={self.grad_accum_steps} does not divide '
        f'the per-replica batch {per_replica} (config.train.batch_size='
        f'{self.global_batch_size} over {replicas} replicas).'
      )

    self.build_optimizers()
    # Keras float8 layers' scale and amax-history variables: their "gradients" are new values the
    # optimizer assigns: never unscaled, clipped or summed; MAX over micro-batches and replicas.
    self.overwritten = overwritten(self.variables)
    self.skipped_steps = state_variable(0, tf.int64, 'skipped_steps')  # cumulative, checkpointed
    self.guard = SkipGuard(
      strategy=self.strategy,
      variables=self.variables,
      max_consecutive_skips=c.precision.max_consecutive_skips,
    )
    self._forward_state = forward_state(self.model)
    # Forensics: the loop stops right after the skip that brings skipped_steps to this count
    # (the host sets it; 0 = never): the host sees that step's pre-step weights and its batch.
    self.forensics = c.numerics.forensics_first > 0 or c.numerics.forensics_every > 0
    self.stop_at_skip = state_variable(0, tf.int64, 'stop_at_skip')
    # The loop's sums of the step's outputs, one per name (sized on the first call: loop.py).
    self._sums = state_variable(tf.zeros([0]), tf.float32, 'output_sums', shape=[None])
    self._output_names = None  # the names of the step's outputs, learned when the loop traces
    self._not_scalar: dict = {}  # outputs the trace found not to be scalars: run() raises
    self.kept_batch = None  # with forensics: the skipped step's batch (trainer/step/kept_batch.py)
    self._recording = None  # while the loop traces, with forensics: its iterator, recording
    self._batch_kept_on_skip = False  # ... and whether apply_or_skip's skip branch keeps it

    replica_core = self._replica_core
    if trainer.jit_compile:
      compiled = tf.function(replica_core, jit_compile=True, autograph=False)
      # Called through a plain function: given a tf.function directly, MirroredStrategy.run
      # lifts it into one XLA cluster over all replicas unless every device is a GPU, and that
      # fails on other devices (a replica's variables read from another device).
      replica_core = lambda batch: compiled(batch)  # pylint: disable=unnecessary-lambda
    self._replica_core_fn = replica_core
    # autograph only for the user's hooks (trainer/step/user_code.py)
    self.train_loop = tf.function(self._train_loop, autograph=False)

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
    loss = tf.nn.compute_average_loss(
      tf.cast(per_example_loss, tf.float32), global_batch_size=self.global_batch_size
    )
    if self.model.losses:
      loss += tf.add_n([tf.cast(l, tf.float32) for l in self.model.losses]) / (
        self.strategy.num_replicas_in_sync * self.grad_accum_steps
      )
    return loss

  # ---- what a custom step overrides ---------------------------------------------------------
  @property
  def variables(self) -> list:
    """The variables `compute_gradients` returns gradients for, in that order: the groups'
    variables when `groups` is overridden, else the model's trainable variables."""
    if type(self).groups is not TrainStep.groups:
      return [v for group in self.groups for v in group.variables]
    return self.model.trainable_variables

  @property
  def groups(self) -> list[UpdateGroup]:
    """The update groups; default one: (the trainer's optimizer, `variables`, its loss scaler)."""
    return [UpdateGroup(self.optimizer, self.variables, self.loss_scaler)]

  def build_optimizers(self) -> None:
    """Creates each group's optimizer slots for its variables (before any restore), and gives
    each group's low-precision optimizer its own random bits (its `stream`: the group's index)."""
    streams: dict = {}
    for index, group in enumerate(self.groups):
      own = group.optimizer is self.optimizer  # then the error says "build_optimizer returned"
      low_precision.check_optimizer(group.optimizer, self.trainer.config, None if own else index)
      if hasattr(group.optimizer, 'stream'):
        group.optimizer.stream = streams.setdefault(id(group.optimizer), index)
      optimizers.reset_loss_scale_factor(group.optimizer)  # the loss is scaled here, not there
      group.optimizer.build(group.variables)

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
      grads = [
        a if b is None else b if a is None else tf.maximum(a, b) if new_value else a + b
        for a, b, new_value in zip(grads, micro_grads, self.overwritten)
      ]
    return {
      n: tuple(tf.concat(parts, 0) for parts in zip(*v)) if n in self.metrics else v
      for n, v in outputs.items()
    }, grads

  def apply_gradients(self, grads) -> None:
    """Replica context, finite steps only (one group): `apply_group` for each group's share of
    `grads`. With several groups the step calls `apply_group` per group instead, each under its
    own finiteness flag; override `apply_group` then."""
    for index, part in enumerate(self._split(grads)):
      user_code.converted(self.apply_group)(index, part)

  def apply_group(self, index: int, grads) -> None:
    """Replica context: group `index`'s optimizer applies `grads` (one per group variable).
    With clipping, the norm is that of the group's gradient summed over replicas, computed once
    here and identical on every replica. The new values of `overwritten` variables (float8
    scales and histories) are combined with MAX over replicas and left out of the norm."""
    group = self.groups[index]
    grads = list(grads)
    overwritten = self._split(self.overwritten)[index]
    context = tf.distribute.get_replica_context()
    stepped = [i for i, g in enumerate(grads) if g is not None and not overwritten[i]]
    if self.strategy.num_replicas_in_sync > 1:
      for i, g in enumerate(grads):
        if g is not None and overwritten[i]:
          grads[i] = tf.reduce_max(context.all_gather(g[None], axis=0), axis=0)
    if self.clip_norm > 0:
      norm = global_norm(context.all_reduce(SUM, [grads[i] for i in stepped]))
      # min(1, c / norm) is finite for every finite c and norm (a norm that overflows float32
      # gives 0, not NaN; a zero norm gives 1).
      factor = tf.where(norm > self.clip_norm, self.clip_norm / norm, 1.0)
      for i in stepped:
        grads[i] = grads[i] * tf.cast(factor, grads[i].dtype)
    group.optimizer.apply_gradients(zip(grads, group.variables))

  def _split(self, values) -> list[list]:
    """`values` (one per entry of `variables`) cut into one list per group."""
    values, parts, start = list(values), [], 0
    for group in self.groups:
      parts.append(values[start : start + len(group.variables)])
      start += len(group.variables)
    return parts

  # ---- the reusable pieces ------------------------------------------------------------------
  def groups_finite(self, nonfinite_counts) -> list[tf.Tensor]:
    """Cross-replica: one flag per group, True when no replica counted a non-finite gradient of
    that group and its optimizer's learning rate for this step is finite (so nothing applied
    after the check can be non-finite). `nonfinite_counts`: `replica_step`'s counts."""
    nonfinite = tf.reshape(self.strategy.reduce(SUM, nonfinite_counts, axis=None), [-1])
    flags = []
    for index, group in enumerate(self.groups):
      rate = tf.cast(group.optimizer.learning_rate, tf.float32)  # the rate this update uses
      flags.append(tf.logical_and(tf.equal(nonfinite[index], 0), tf.math.is_finite(rate)))
    return flags

  def all_replicas_finite(self, nonfinite_counts) -> tf.Tensor:
    """Cross-replica: True when every group is finite on every replica (`groups_finite`)."""
    return tf.reduce_all(tf.stack(self.groups_finite(nonfinite_counts)))

  def apply_or_skip(self, finite, grads, saved_state=None) -> tf.Tensor:
    """Cross-replica: applies `grads` (PerReplica) when `finite` (a flag, or one per group);
    otherwise restores the forward-pass state read before the forward pass and records the
    skip. With one flag per group, each group applies or skips on its own, and the step counts
    as skipped (the forward state put back) when any group skipped. Returns 1 when skipped,
    else 0 (int64)."""

    def skip():
      with tf.name_scope(SKIP_SCOPE):  # ops here run on skipped steps only
        if saved_state:
          for variable, value in zip(self._forward_state, saved_state):
            self.strategy.extended.update(variable, lambda v, x: v.assign(x), args=(value,))
        self.guard.record(grads, self.global_step, self.groups[0].loss_scaler.scale)
        if self._recording is not None and self._recording.last is not None:
          # The skip the host stops at (skipped_steps counts it after this branch): its batch
          # is kept here, on the skip branch only, so a finite step pays nothing.
          self._batch_kept_on_skip = True
          tf.cond(
            tf.equal(self.skipped_steps + 1, self.stop_at_skip),
            lambda: self._keep_batch(self._recording.last),
            lambda: tf.constant(True),
          )
        return tf.constant(1, tf.int64)

    if not isinstance(finite, (list, tuple)):

      def apply():
        self.strategy.run(user_code.converted(self.apply_gradients), args=(grads,))
        return tf.constant(0, tf.int64)

      skipped = tf.cond(finite, apply, skip)
    else:
      for index, flag in enumerate(finite):

        def apply_group(index=index):
          apply = user_code.converted(self.apply_group)
          self.strategy.run(lambda g: apply(index, self._split(g)[index]), args=(grads,))
          return tf.constant(0, tf.int64)

        tf.cond(flag, apply_group, lambda: tf.constant(1, tf.int64))
      skipped = tf.cond(tf.reduce_all(tf.stack(finite)), lambda: tf.constant(0, tf.int64), skip)
    self.skipped_steps.assign_add(skipped)
    return skipped

  def end_step(self, finite, loss_finite=True) -> None:
    """Cross-replica, once per step: collapse-guard count, each loss scaler's update with its
    groups' flag (`finite`: one flag, or one per group), global step + 1."""
    flags = list(finite) if isinstance(finite, (list, tuple)) else [finite] * len(self.groups)
    self.guard.count(tf.logical_and(tf.reduce_all(tf.stack(flags)), loss_finite))
    update_scalers(self.groups, flags)
    self.global_step.assign_add(1)

  # ---- one step -----------------------------------------------------------------------------
  def _replica_core(self, batch):
    """Per replica (the part jit_compile compiles): forward state read first, then the
    gradients, the debug injection and this replica's non-finite count per group ([groups]
    int32, 0 or 1 each)."""
    saved = [v.read_value() for v in self._forward_state]
    outputs, grads = contract.step_gradients(
      self, user_code.converted(self.compute_gradients)(batch), self.variables
    )
    grads = self._maybe_inject(grads)
    nonfinite = tf.stack(
      [tf.cast(tf.logical_not(all_finite(part)), tf.int32) for part in self._split(grads)]
    )
    return outputs, grads, nonfinite, saved

  def replica_step(self, batch):
    """PER REPLICA: the per-replica half of a step, for `strategy.run` (a custom `step` calls
    it rather than `compute_gradients`, so it keeps what the default step does): reads the
    forward-pass state, `compute_gradients`, the debug injection (config.debug.inject_*),
    updates the stateful metrics from their outputs (only when this replica's loss is finite).
    Returns (outputs without the metrics' entries, grads, non-finite count per group [groups]
    int32, the forward state read before the pass) for `groups_finite` and `apply_or_skip`."""
    outputs, grads, nonfinite, saved = self._replica_core_fn(batch)
    outputs = dict(outputs)
    updates = [
      (metric, outputs.pop(name)) for name, metric in self.metrics.items() if name in outputs
    ]
    if updates:  # outside XLA: metric variables sync on read

      def update():
        for metric, args in updates:
          user_code.converted(metric.update_state)(*args)
        return tf.constant(True)

      # As the summed outputs leave out steps whose loss is not finite, the stateful metrics
      # leave out this replica's non-finite-loss steps (a NaN logit would corrupt an AUC).
      loss_finite = (
        tf.reduce_all(tf.math.is_finite(outputs['loss']))
        if 'loss' in outputs
        else tf.constant(True)
      )
      tf.cond(loss_finite, update, lambda: tf.constant(False))
    return outputs, grads, nonfinite, saved

  def step(self, iterator) -> dict[str, tf.Tensor]:
    """Cross-replica: one step on the next batch of `iterator`; the outputs the loop sums."""
    batch = next(iterator)
    outputs, grads, nonfinite, saved = self.strategy.run(self.replica_step, args=(batch,))
    finite = self.groups_finite(nonfinite)
    finite = finite[0] if len(finite) == 1 else finite  # one group: the step as before
    outputs = {k: self.strategy.reduce(SUM, v, axis=None) for k, v in outputs.items()}
    skipped = self.apply_or_skip(finite, grads, saved)
    loss_finite = tf.math.is_finite(outputs['loss']) if 'loss' in outputs else True
    self.end_step(finite, loss_finite)
    return self.with_counters(outputs, skipped, loss_finite)

  @staticmethod
  def with_counters(outputs, skipped, loss_finite=True) -> dict[str, tf.Tensor]:
    """`outputs` as float32, zeroed when the loss is not finite, plus the three counters."""
    return step_outputs.with_counters(outputs, skipped, loss_finite)

  def _maybe_inject(self, grads):
    """debug.inject_nonfinite_*: the gradients of chosen global steps made non-finite."""
    if not (self.inject_every or self.inject_steps):
      return grads
    return inject.nonfinite(
      grads,
      self.global_step.read_value(),
      every=self.inject_every,
      steps=self.inject_steps,
      replica=self.inject_replica,
    )

  def _micro_gradients(self, batch):
    with tf.GradientTape() as tape:
      per_example_loss, metrics = user_code.converted(self.compute_loss)(batch, training=True)
      loss = self.share_loss(per_example_loss)
      scaled_loss = self.loss_scaler.scale_loss(loss)
    grads = self.loss_scaler.unscale(tape.gradient(scaled_loss, self.variables), self.variables)
    outputs = {'loss': loss}
    for name, value in metrics.items():
      outputs[name] = (
        tuple(value)
        if name in self.metrics
        else tf.reduce_sum(tf.cast(value, tf.float32)) / self.global_batch_size
      )
    return outputs, grads
