"""The compiled inner loop of a `TrainStep` (its base class): `steps_per_loop` steps a call.

The compiled loop (`train_loop`, `steps_per_loop` steps a call) sums the step outputs into one
variable per output and returns the counters (global step, skipped steps, the collapse guard's
bad steps in a row) once at its end; nothing else goes back to the host. The loop stops early
when the guard's limit is reached or, with forensics on, right after the skip the host asked for.
At log time the host reads `read_outputs()`.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import tensorflow as tf

from trainer.step import kept_batch
from trainer.step import outputs as step_outputs
from trainer.step.loss_scale import state_variable


class Counters(NamedTuple):
  """What a compiled call returns to the host, read once: the global step, the cumulative
  skipped steps and the collapse guard's bad steps in a row."""
  global_step: int
  skipped_steps: int
  consecutive: int


class CompiledLoop:
  """`train_loop` (tf.function of `_train_loop`), `run` and `read_outputs`, mixed into TrainStep
  (which sets the attributes read here: strategy, trainer, step, guard, global_step,
  skipped_steps, stop_at_skip, forensics, metrics, kept_batch, _totals, _recording)."""

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
  _totals: Any
  _recording: Any
  _batch_kept_on_skip: bool

  def _train_loop(self, iterator, num_steps):
    totals = {k: tf.zeros_like(v) for k, v in self._totals.items()}
    self._recording = kept_batch.Recording(iterator) if self.forensics else None
    self._batch_kept_on_skip = False
    batches = self._recording or iterator
    done, stop = tf.constant(0, tf.int64), tf.constant(False)
    # Stopping early is part of the loop's condition, not a `break`: autograph turns each
    # `if ...: break` into tf.conds that run in every step (benchmarks/ablate_step.py measures
    # what the checks cost).
    while tf.logical_and(done < num_steps, tf.logical_not(stop)):
      outputs = self.step(batches)
      totals = {k: totals[k] + outputs[k] for k in totals}
      done += 1
      stop = tf.convert_to_tensor(self.guard.collapsed())  # the trainer raises CollapseError
      if self.forensics:  # the runner replays the skipped step (trainer/insight/forensics.py)
        at_skip = self.forensic_stop()
        if not self._batch_kept_on_skip:  # a custom step without apply_or_skip: keep it here
          tf.cond(at_skip, lambda: self._keep_batch(batches.last), lambda: tf.constant(True))
        stop = tf.logical_or(stop, at_skip)
    self._recording = None
    for k, v in totals.items():
      self._totals[k].assign_add(v)
    return tf.stack([self.global_step.read_value(), self.skipped_steps.read_value(),
                     self.guard.consecutive.read_value()])

  def forensic_stop(self) -> tf.Tensor:
    """True right after the skip the host asked to stop at (stop_at_skip; 0 = never)."""
    return tf.logical_and(self.stop_at_skip > 0, tf.equal(self.skipped_steps, self.stop_at_skip))

  def _keep_batch(self, batch) -> tf.Tensor:
    self.kept_batch.keep(self.strategy, batch)  # the replay's batch, bit for bit
    return tf.constant(True)

  def run(self, iterator, num_steps) -> Counters:
    """Host side: one compiled call of `num_steps` steps; the counters after it. The first call
    finds the step's output names (by tracing `step` once) and creates one sum variable per
    output."""
    if self._totals is None:
      spec = tf.function(self.step).get_concrete_function(iterator).structured_outputs
      with self.strategy.scope():
        self._totals = {k: state_variable(0.0, tf.float32, f'sum_{k}') for k in sorted(spec)}
        if self.forensics:
          self.kept_batch = kept_batch.KeptBatch(self.trainer.datasets.train.element_spec)
    return Counters(*(int(v) for v in self.train_loop(
        iterator, tf.constant(num_steps, tf.int64)).numpy()))

  def read_outputs(self) -> dict[str, float]:
    """Host side: the counters as counts, every other output as its mean over the steps whose
    loss was finite (NaN when there were none), since the last read; resets the sums. Then
    the stateful metrics' results (reset too)."""
    if self._totals is None:
      return {}
    return step_outputs.read(self._totals, self.metrics)
