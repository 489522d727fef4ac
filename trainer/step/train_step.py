"""The step: per batch, each update group's optimizer update, or that group's skip.

`Trainer.build_train_step()` returns a `TrainStep`; the default one is a loss-scaled optimizer
update of `Trainer.compute_loss`. A custom step subclasses `TrainStep` and overrides what differs
(docs/guides/custom-steps.md has a GAN step, docs/guides/two-loss-scales.md one with two scales):

  variables                   the variables the gradients are for (default: the model's
                              trainable variables; the groups' variables, in order, when
                              `groups` is overridden).
  groups                      the update groups, `UpdateGroup(optimizer, variables, loss_scaler,
                              name='')`; default one: (trainer.optimizer, `variables`,
                              trainer.loss_scaler). One group is the common case of the same
                              code, not another path. A step with several (a GAN's discriminator
                              and generator, each with its own loss scale) lists them here.
  build_optimizers()          creates each group's optimizer slots (before any restore).
  compute_gradients(batch)    PER REPLICA. Returns (outputs, grads): `grads` one unscaled float32
                              gradient (or None) per entry of `variables`; `outputs` a dict of
                              this replica's share of scalar values the host reads (e.g. 'loss':
                              the sum of per-example losses / global batch), summed over replicas.
                              An entry named like a stateful metric of `Trainer.build_metrics()`
                              holds the tuple of arguments for that metric's `update_state`.
                              Scale each group's loss with its `loss_scaler.scale_loss` and
                              unscale its gradients with its `.unscale`.
  apply_group(index, grads)   PER REPLICA: the ONE apply hook. Group `index` applies `grads` (one
                              per variable of the group), only when every gradient of that group
                              on every replica and the group's learning rate are finite. Keras
                              optimizers sum the replicas' gradients themselves.
  step(iterator)              CROSS-REPLICA: one whole step; returns a dict of scalar tensors.

One `step` (cross-replica context; `steps_per_loop` of them run in one compiled call of the loop,
trainer/step/loop.py, which the step does not know):
  1. `strategy.run(self.replica_step)` (public; a custom `step` calls it): reads the forward-pass
     state (variables a layer assigns in `call`, such as BatchNormalization's moving statistics),
     `compute_gradients`, the stateful metrics' updates, and this replica's non-finite count of
     each group's gradients.
  2. `groups_finite`: one flag per group, the counts reduced over all replicas (SUM): one
     non-finite gradient anywhere skips that group's update everywhere; a non-finite learning
     rate skips it too.
  3. `apply_or_skip(flags, grads, saved)`: each group is applied by `apply_group` under its own
     flag, in a `tf.cond` in cross-replica context (a cond around the apply inside
     `strategy.run` fails with merge_call). A step on which any group skipped counts as skipped:
     the forward-pass state is put back, so weights, optimizer slots and that state of a skipped
     group are bit-identical to before the step; the collapse guard prints the skip line (the
     groups skipped, each one's loss scale and the cause) and the `on_skip` callables run.
  4. `end_step(flags, loss_finite)`: the collapse guard counts, each loss scaler updates once with
     its groups' flags (not when a rate was non-finite), the global step advances.
  5. the outputs summed over replicas, plus the counters 'steps' (1), 'skipped' (0/1) and
     'nonfinite_loss' (0/1); every other output is zero on a step whose loss is not finite, so
     the host's means are over the steps whose loss was finite. Stateful metrics
     (`build_metrics`) are updated per replica, only when that replica's loss is finite.

A subclass overriding a method the step no longer calls (`apply_gradients`: each group is applied
by `apply_group`; `run`, `read_outputs`: the loop's) is refused in one line when it is built
(trainer/step/contract.py). The debug injection (config.debug.inject_nonfinite_*) wraps
`compute_gradients` from outside (trainer/step/inject.py). The hooks (and Trainer.compute_loss, a
stateful metric's update_state) are converted by autograph as in any tf.function; the framework's
own pieces are traced as written, without it (trainer/step/user_code.py).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import tensorflow as tf

from trainer.errors import UserError
from trainer.nn import fused
from trainer.step import apply_or_skip as shared
from trainer.optim import low_precision, optimizers
from trainer.step import contract
from trainer.step import outputs as step_outputs
from trainer.step import user_code
from trainer.step.forward_state import forward_state
from trainer.step.loss_scale import overwritten, update_scalers
from trainer.step.step_state import StepState, group_names

SUM = shared.SUM


class UpdateGroup(NamedTuple):
  """One optimizer's share of a step: the variables it updates, the loss scaler their gradients
  were scaled with (`compute_gradients` scales that loss with it and unscales) and a name for
  the log and TensorBoard (`train/loss_scale/<name>`); an unnamed group is called by its index
  ('0', '1', ...)."""

  optimizer: Any
  variables: list
  loss_scaler: Any
  name: str = ''


SKIP_SCOPE = shared.SKIP_SCOPE  # name scope of the skip branch (benchmarks/run.py looks for it)


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


class TrainStep:
  """The default step and the pieces a custom step reuses. Built by the trainer under the
  strategy's scope (it owns variables: the skip counter, the collapse guard)."""

  def __init__(self, trainer):
    contract.check_step_overrides(type(self), TrainStep)  # an override never called: one line
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
    self.grad_accum_steps = int(c.train.grad_accum_steps)  # divides the batch: build checked
    self.build_optimizers()
    # Keras float8 layers' scale and amax-history variables: their "gradients" are new values the
    # optimizer assigns: never unscaled, clipped or summed; MAX over micro-batches and replicas.
    self.overwritten = overwritten(self.variables)
    # The skip counter, the collapse guard and the state check: what the loop, the runner and
    # the checkpoint read of the step (trainer/step/step_state.py).
    self.state = StepState(
      strategy=self.strategy,
      global_step=self.global_step,
      variables=self.variables,
      groups=lambda: self.groups,
      max_consecutive_skips=c.precision.max_consecutive_skips,
    )
    self._forward_state = forward_state(self.model)
    self._replica_core_fn = user_code.xla_per_replica(self._replica_core, trainer.jit_compile)

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

  @property
  def group_names(self) -> list[str]:
    """Each update group's name (its index when unnamed): the log's and TensorBoard's."""
    return group_names(self.groups)

  @property
  def skipped_steps(self) -> tf.Variable:
    """The skipped steps so far (`state`'s): a step skipping without `apply_or_skip` adds to it."""
    return self.state.skipped_steps

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
    micro = (tf.nest.pack_sequence_as(batch, [parts[i] for parts in flat]) for i in range(k))
    # A generator: each micro-batch's gradients are added as they come, in the graph's order.
    return _accumulated((self._micro_gradients(m) for m in micro), self.metrics, self.overwritten)

  def apply_group(self, index: int, grads) -> None:
    """Replica context: group `index`'s optimizer applies `grads` (one per group variable).
    With clipping, the norm is that of the group's gradient summed over replicas, computed once
    here and identical on every replica. The new values of `overwritten` variables (float8
    scales and histories) are combined with MAX over replicas and left out of the norm."""
    group = self.groups[index]
    overwritten = self._split(self.overwritten)[index]
    grads = _combined(list(grads), overwritten, self.strategy.num_replicas_in_sync, self.clip_norm)
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
    optimizers = [group.optimizer for group in self.groups]
    return shared.groups_finite(self.strategy, nonfinite_counts, optimizers)

  def all_replicas_finite(self, nonfinite_counts) -> tf.Tensor:
    """Cross-replica: True when every group is finite on every replica (`groups_finite`)."""
    return tf.reduce_all(tf.stack(self.groups_finite(nonfinite_counts)))

  def apply_or_skip(self, flags, grads, saved_state=None) -> tf.Tensor:
    """Cross-replica: each group applies its share of `grads` (PerReplica) by `apply_group`
    when its flag of `flags` (`groups_finite`) is set (trainer/step/apply_or_skip.py, the code
    the public LossScaleOptimizer runs too). When any group skipped, the forward-pass state read
    before the forward pass is put back, the skip is recorded (the skip line) and `on_skip`
    runs. Returns 1 when any group skipped, else 0 (int64)."""
    flags = _flag_list(flags, len(self.groups), 'apply_or_skip')
    apply = user_code.converted(self.apply_group)

    def apply_groups(indices) -> None:
      def replica(g):
        parts = self._split(g)
        for index in indices:
          apply(index, parts[index])

      self.strategy.run(replica, args=(grads,))

    def on_skip() -> None:
      for variable, value in zip(self._forward_state, saved_state or []):
        self.strategy.extended.update(variable, lambda v, x: v.assign(x), args=(value,))
      scales = [group.loss_scaler.scale for group in self.groups]
      self.state.guard.record(grads, self.global_step, flags, scales)
      for action in self.state.on_skip:
        action()

    skipped = shared.apply_or_skip(flags, apply_groups, on_skip)
    self.state.skipped_steps.assign_add(skipped)
    return skipped

  def end_step(self, flags, loss_finite=True) -> None:
    """Cross-replica, once per step: collapse-guard count, each loss scaler's update with its
    groups' flags (`flags`: `groups_finite`'s, one per group), global step + 1."""
    flags = _flag_list(flags, len(self.groups), 'end_step')
    self.state.guard.count(tf.logical_and(tf.reduce_all(tf.stack(flags)), loss_finite))
    update_scalers(self.groups, flags)
    self.global_step.assign_add(1)

  # ---- one step -----------------------------------------------------------------------------
  def _replica_core(self, batch):
    """Per replica (the part jit_compile compiles): forward state read first, then the
    gradients and this replica's non-finite count per group ([groups] int32, 0 or 1 each)."""
    saved = [v.read_value() for v in self._forward_state]
    with fused.kernels():  # the model's element-wise chains as XLA kernels (trainer/nn/fused.py)
      gradients = user_code.converted(self.compute_gradients)(batch)
    outputs, grads = contract.step_gradients(self, gradients, self.variables)
    nonfinite = shared.nonfinite_counts(self._split(grads))
    return outputs, grads, nonfinite, saved

  def replica_step(self, batch):
    """PER REPLICA: the per-replica half of a step, for `strategy.run` (a custom `step` calls
    it rather than `compute_gradients`, so it keeps what the default step does): reads the
    forward-pass state, `compute_gradients`, updates the stateful metrics from their outputs
    (only when this replica's loss is finite). Returns (outputs without the metrics' entries,
    grads, non-finite count per group [groups] int32, the forward state read before the pass)
    for `groups_finite` and `apply_or_skip`."""
    outputs, grads, nonfinite, saved = self._replica_core_fn(batch)
    outputs = dict(outputs)
    _update_metrics(outputs, self.metrics)  # their entries popped
    return outputs, grads, nonfinite, saved

  def step(self, iterator) -> dict[str, tf.Tensor]:
    """Cross-replica: one step on the next batch of `iterator`; the outputs the loop sums."""
    batch = next(iterator)
    outputs, grads, nonfinite, saved = self.strategy.run(self.replica_step, args=(batch,))
    flags = self.groups_finite(nonfinite)
    outputs = {k: self.strategy.reduce(SUM, v, axis=None) for k, v in outputs.items()}
    skipped = self.apply_or_skip(flags, grads, saved)
    loss_finite = tf.math.is_finite(outputs['loss']) if 'loss' in outputs else True
    self.end_step(flags, loss_finite)
    return self.with_counters(outputs, skipped, loss_finite)

  @staticmethod
  def with_counters(outputs, skipped, loss_finite=True) -> dict[str, tf.Tensor]:
    """`outputs` as float32, zeroed when the loss is not finite, plus the three counters."""
    return step_outputs.with_counters(outputs, skipped, loss_finite)

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


def _combined(grads: list, overwritten: list, replicas: int, clip_norm: float) -> list:
  """Replica context: one group's gradients as its optimizer applies them: an overwritten
  variable's new value the MAX over replicas, the others clipped to `clip_norm` (> 0) by the
  norm of their sum over replicas."""
  context = tf.distribute.get_replica_context()
  stepped = [i for i, g in enumerate(grads) if g is not None and not overwritten[i]]
  if replicas > 1:
    for i, g in enumerate(grads):
      if g is not None and overwritten[i]:
        grads[i] = tf.reduce_max(context.all_gather(g[None], axis=0), axis=0)
  if clip_norm > 0:
    norm = global_norm(context.all_reduce(SUM, [grads[i] for i in stepped]))
    # min(1, c / norm) is finite for every finite c and norm (a norm that overflows float32
    # gives 0, not NaN; a zero norm gives 1).
    factor = tf.where(norm > clip_norm, clip_norm / norm, 1.0)
    for i in stepped:
      grads[i] = grads[i] * tf.cast(factor, grads[i].dtype)
  return grads


def _update_metrics(outputs: dict, metrics: dict) -> None:
  """Replica context: each stateful metric's entry popped from `outputs` and, when this
  replica's loss is finite, given to its update_state. As the summed outputs leave out steps
  whose loss is not finite, the metrics leave out this replica's (a NaN logit would corrupt an
  AUC). Outside XLA: metric variables sync on read."""
  updates = [(metric, outputs.pop(name)) for name, metric in metrics.items() if name in outputs]
  if not updates:
    return

  def update():
    for metric, args in updates:
      user_code.converted(metric.update_state)(*args)
    return tf.constant(True)

  loss = outputs.get('loss')
  loss_finite = tf.reduce_all(tf.math.is_finite(loss)) if loss is not None else tf.constant(True)
  tf.cond(loss_finite, update, lambda: tf.constant(False))


def _accumulated(micro, metrics: dict, overwritten: list) -> tuple:
  """The (outputs, grads) of micro-batches as one batch's: the gradients summed (an overwritten
  variable's new values combined with MAX), the outputs summed, a stateful metric's arguments
  concatenated (the metric sees every micro-batch)."""
  outputs: dict = {}
  grads = None
  for micro_outputs, micro_grads in micro:
    micro_grads = [None if g is None else tf.convert_to_tensor(g) for g in micro_grads]
    if grads is None:
      outputs = {n: [v] if n in metrics else v for n, v in micro_outputs.items()}
      grads = micro_grads
      continue
    for name, value in micro_outputs.items():
      outputs[name] = outputs[name] + ([value] if name in metrics else value)
    grads = [
      a if b is None else b if a is None else tf.maximum(a, b) if new_value else a + b
      for a, b, new_value in zip(grads, micro_grads, overwritten)
    ]
  return {
    n: tuple(tf.concat(parts, 0) for parts in zip(*v)) if n in metrics else v
    for n, v in outputs.items()
  }, grads


def _flag_list(flags, groups: int, method: str) -> list:
  """`flags` as a list of one flag per group; anything else is one UserError line."""
  if not isinstance(flags, (list, tuple)) or len(flags) != groups:
    raise UserError(
      f'TrainStep.{method} takes one finite flag per update group ({groups}), as '
      f'groups_finite(nonfinite_counts) returns them; got {type(flags).__name__}'
    )
  return list(flags)
