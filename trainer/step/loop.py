"""The compiled inner loop of a `TrainStep` (its base class): `steps_per_loop` steps a call.

The compiled loop (`train_loop`, `steps_per_loop` steps a call) adds each step's outputs to a
float32 vector carried through the loop (one entry per output name, in sorted order), stores it
in the variable `_sums` at its end and returns the counters (global step, skipped steps, the
collapse guard's bad steps in a row); nothing else goes back to the host. The loop stops early
when the guard's limit is reached or, with forensics on, right after the skip the host asked for.
At log time the host reads `read_outputs()`.

The step is traced once, inside the loop, and the output names are learned there: the first call
traces the loop, sizes `_sums` to the names, then runs it. (A variable created during the trace
would make `tf.function` trace the whole loop again; tracing `step` on its own first, for the
names, was a second trace of the step too.)
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import tensorflow as tf

from trainer.errors import UserError
from trainer.step import kept_batch
from trainer.step import outputs as step_outputs
from trainer.step import user_code


class Counters(NamedTuple):
  """What a compiled call returns to the host, read once: the global step, the cumulative
  skipped steps and the collapse guard's bad steps in a row."""

  global_step: int
  skipped_steps: int
  consecutive: int


class CompiledLoop:
  """`train_loop` (tf.function of `_train_loop`), `run` and `read_outputs`, mixed into TrainStep
  (which sets the attributes read here: strategy, trainer, step, guard, global_step,
  skipped_steps, stop_at_skip, forensics, metrics, kept_batch, _sums, _output_names,
  _not_scalar, _recording)."""

  # Set by TrainStep (annotations only).
  strategy: Any
  trainer: Any
  guard: Any
  step: Any
  train_loop: Any
  metrics: dict
  forensics: bool
  global_step: tf.Variable
  skipped_steps: tf.Variable
  stop_at_skip: tf.Variable
  kept_batch: Any
  _sums: tf.Variable
  _output_names: list | None
  _not_scalar: dict
  _recording: Any
  _batch_kept_on_skip: bool

  def _train_loop(self, iterator, num_steps):
    self._recording = kept_batch.Recording(iterator) if self.forensics else None
    self._batch_kept_on_skip = False
    batches = self._recording or iterator
    # Stopping early is part of the loop's condition, not a `break`: autograph turns each
    # `if ...: break` into tf.conds that run in every step (benchmarks/ablate_step.py measures
    # what the checks cost). The sums' length is known only once the body is traced, so they
    # are a loop variable of shape [None] (an explicit tf.while_loop states that invariant).

    def keep_going(done, stop, sums):
      return tf.logical_and(done < num_steps, tf.logical_not(stop))

    def one_step(done, stop, sums):
      outputs = user_code.converted(self.step)(batches)
      if self._output_names is None:
        self._output_names = sorted(outputs)
      sums += self._stacked(outputs)
      stop = tf.convert_to_tensor(self.guard.collapsed())  # the trainer raises CollapseError
      if self.forensics:  # the runner replays the skipped step (trainer/insight/forensics.py)
        at_skip = self.forensic_stop()
        if not self._batch_kept_on_skip:  # a custom step without apply_or_skip: keep it here
          tf.cond(at_skip, lambda: self._keep_batch(batches.last), lambda: tf.constant(True))
        stop = tf.logical_or(stop, at_skip)
      return done + 1, stop, sums

    # The sums start from `_sums`, sized to the names after the first trace (`run`).
    _, _, sums = tf.while_loop(
      keep_going,
      one_step,
      (tf.constant(0, tf.int64), tf.constant(False), self._sums.value()),
      shape_invariants=(tf.TensorShape([]), tf.TensorShape([]), tf.TensorShape([None])),
    )
    self._sums.assign(sums)
    self._recording = None
    return tf.stack(
      [
        self.global_step.read_value(),
        self.skipped_steps.read_value(),
        self.guard.consecutive.read_value(),
      ]
    )

  def _stacked(self, outputs) -> tf.Tensor:
    """The step's outputs as one float32 vector, in the order of `_output_names`. A non-scalar
    output is noted (`run` raises, naming it, once the trace is done) and traced as 0."""
    values = []
    for name in cast(list, self._output_names):
      value = tf.cast(outputs[name], tf.float32)
      if value.shape.rank != 0:
        self._not_scalar[name] = value.shape
        value = tf.constant(0.0)
      values.append(value)
    return tf.stack(values)

  def forensic_stop(self) -> tf.Tensor:
    """True right after the skip the host asked to stop at (stop_at_skip; 0 = never)."""
    return tf.logical_and(self.stop_at_skip > 0, tf.equal(self.skipped_steps, self.stop_at_skip))

  def _keep_batch(self, batch) -> tf.Tensor:
    self.kept_batch.keep(self.strategy, batch)  # the replay's batch, bit for bit
    return tf.constant(True)

  def run(self, iterator, num_steps) -> Counters:
    """Host side: one compiled call of `num_steps` steps; the counters after it."""
    if self.forensics and self.kept_batch is None:
      with self.strategy.scope():
        self.kept_batch = kept_batch.KeptBatch(self.trainer.datasets.train.element_spec)
    num_steps = tf.constant(num_steps, tf.int64)
    if self._output_names is None:  # the first call: trace, then size the sums to the names
      self.train_loop.get_concrete_function(iterator, num_steps)
      self._sums.assign(tf.zeros([len(cast(list, self._output_names))]))  # set by the trace
    if self._not_scalar:
      shapes = ', '.join(f"'{k}' of shape {v}" for k, v in sorted(self._not_scalar.items()))
      raise UserError(
        f'{type(self).__name__}.step returned {shapes}: the loop adds up each '
        'output over the steps and logs its mean, so each must be a scalar '
        '(reduce it in the step, e.g. tf.reduce_mean)'
      )
    return Counters(*(int(v) for v in self.train_loop(iterator, num_steps).numpy()))

  def read_outputs(self) -> dict[str, float]:
    """Host side: the counters as counts, every other output as its mean over the steps whose
    loss was finite (NaN when there were none), since the last read; resets the sums. Then
    the stateful metrics' results (reset too)."""
    if self._output_names is None:
      return {}
    return step_outputs.read(self._output_names, self._sums, self.metrics)
