"""The compiled train loop: `steps_per_loop` steps of a `TrainStep` in one call.

`TrainLoop(step, strategy=..., forensics=..., element_spec=...)` owns the compiled call and what
lives across its steps; the step does not know it exists. A call (`run(iterator, n)`) runs
`step.step` up to `n` times in a `tf.while_loop`, adds each step's outputs to a float32 vector
carried through the loop (one entry per output name, in sorted order), stores it in the variable
`sums` at its end and returns the counters (`Counters`: the global step at its start and end,
skipped steps, the collapse guard's bad steps in a row, the state check's finding); nothing else
goes back to the host. Of the step it reads `step.step`, `step.metrics` and `step.state`
(trainer/step/step_state.py: the counters, the guard and the check of the state the call's
updates wrote, once per call). The loop stops early when the guard's limit is reached or, with
forensics on, right after the skip the host asked for (`stop_at_skip`), with that step's batch
kept on the device (`kept_batch`, trainer/step/kept_batch.py). At log time the host reads
`read_outputs()`.

The step is traced once, inside the loop, and the output names are learned there: the first call
traces the loop, sizes `sums` to the names, then runs it. (A variable created during the trace
would make `tf.function` trace the whole loop again; tracing `step` on its own first, for the
names, was a second trace of the step too.)
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import tensorflow as tf

from trainer.errors import UserError
from trainer.step import grappler as grappler_lib
from trainer.step import kept_batch
from trainer.step import outputs as step_outputs
from trainer.step import user_code
from trainer.distribute.strategy import state_variable


def _ours(error: Exception) -> Exception:
  """The framework's UserError (a one-line message naming the fix) behind `error`, when the
  trace raised it inside a custom step's converted code (autograph wraps it in a StagingError
  of many lines); else `error`."""
  cause: BaseException | None = error
  while cause is not None:
    if isinstance(cause, UserError):
      return cause
    cause = cause.__cause__ or cause.__context__
  return error


class Counters(NamedTuple):
  """What a compiled call returns to the host, read once: the global step at its start and at
  its end, the cumulative skipped steps, the collapse guard's bad steps in a row, and the first
  step of the first call whose updates left the state non-finite (-1: none; trainer/step/
  step_state.py). One read per call: each eager read of a variable on the host costs 0.1-0.4
  ms, a few per cent of a call of 10 MNIST MLP steps."""

  first_step: int
  global_step: int
  skipped_steps: int
  consecutive: int
  nonfinite_state_step: int


class TrainLoop:
  """Runs `step` (a TrainStep) under `strategy`. Create it under the strategy's scope (it owns
  variables: the output sums, the forensic stop, the kept batch). `element_spec`: the train
  dataset's, for the kept batch (needed with `forensics` only). `grappler`: TensorFlow's graph
  optimizer on the compiled loop (config.train.grappler)."""

  def __init__(
    self, step, strategy, *, forensics: bool = False, element_spec=None, grappler: bool = True
  ):
    self.step = step
    self.state = step.state  # what the loop reads and checks of the step between steps
    self.grappler = grappler  # TensorFlow's graph optimizer on the loop (trainer/step/grappler.py)
    self.strategy = strategy
    self.forensics = bool(forensics)
    # Forensics: the loop stops right after the skip that brings the step's skipped_steps to
    # this count (the host sets it; 0 = never): the host sees that step's pre-step weights and
    # its batch.
    self.stop_at_skip = state_variable(0, tf.int64, 'stop_at_skip')
    self._stop_at_skip = 0  # its value, known on the host (`stop_after_skip`)
    # The sums of the step's outputs, one per name (sized on the first call: `run`).
    self.sums = state_variable(tf.zeros([0]), tf.float32, 'output_sums', shape=[None])
    self.output_names: list[str] | None = None  # learned when the loop traces
    self._not_scalar: dict = {}  # outputs the trace found not to be scalars: run() raises
    self.kept_batch = kept_batch.KeptBatch(element_spec) if self.forensics else None
    self._recording: kept_batch.Recording | None = None  # while tracing, with forensics
    self._kept_on_skip = False  # whether the step's skip branch traced the batch keeping
    if self.forensics:
      # The batch is kept on the step's skip branch (its `on_skip`), so a finite step pays
      # nothing for it: a tf.cond per step costs (docs/results/ablate_step.md). A custom step
      # that skips without `apply_or_skip` gets the cond per step instead (`_one_step`).
      self.state.on_skip.append(self._keep_at_stop)
    self.compiled = tf.function(self._loop, autograph=False)  # autograph: user code only

  def _loop(self, iterator, num_steps):
    self._recording = kept_batch.Recording(iterator) if self.forensics else None
    batches = self._recording or iterator
    # Stopping early is part of the loop's condition, not a `break`: autograph turns each
    # `if ...: break` into tf.conds that run in every step (docs/results/ablate_step.md measured
    # what the checks cost). The sums' length is known only once the body is traced, so they
    # are a loop variable of shape [None] (an explicit tf.while_loop states that invariant).

    def keep_going(done, stop, sums):
      return tf.logical_and(done < num_steps, tf.logical_not(stop))

    def one_step(done, stop, sums):
      return done + 1, *self._one_step(batches, sums)

    begin = self.state.begin_call()
    _, _, sums = tf.while_loop(
      keep_going,
      one_step,
      (tf.constant(0, tf.int64), tf.constant(False), self.sums.value()),
      shape_invariants=(tf.TensorShape([]), tf.TensorShape([]), tf.TensorShape([None])),
    )
    self.sums.assign(sums)
    self._recording = None
    return self.state.end_call(begin)  # the runner raises what it found (StepState.check)

  def _one_step(self, batches, sums):
    """One step in the loop's body: (stop, sums + its outputs)."""
    self._kept_on_skip = False
    outputs = user_code.converted(self.step.step)(batches)
    if self.output_names is None:
      self.output_names = sorted(outputs)
    sums += self._stacked(outputs)
    stop = tf.convert_to_tensor(self.state.collapsed())  # the runner raises CollapseError
    if self.forensics:  # right after the skip the host asked to stop at (0 = never)
      skipped = self.state.skipped_steps  # the runner replays it (trainer/insight/forensics.py)
      at_skip = tf.logical_and(self.stop_at_skip > 0, tf.equal(skipped, self.stop_at_skip))
      if not self._kept_on_skip:  # a custom step without apply_or_skip: keep it here
        tf.cond(at_skip, lambda: self._keep(batches.last), lambda: tf.constant(True))
      stop = tf.logical_or(stop, at_skip)
    return stop, sums

  def _keep_at_stop(self) -> None:
    """On the step's skip branch: keeps the batch of the skip the host stops at (the step's
    skipped_steps counts this skip after the branch)."""
    if self._recording is None or self._recording.last is None:
      return  # the step was not traced by this loop
    self._kept_on_skip = True
    tf.cond(
      tf.equal(self.state.skipped_steps + 1, self.stop_at_skip),
      lambda: self._keep(cast(kept_batch.Recording, self._recording).last),
      lambda: tf.constant(True),
    )

  def _keep(self, batch) -> tf.Tensor:
    cast(kept_batch.KeptBatch, self.kept_batch).keep(self.strategy, batch)  # bit for bit
    return tf.constant(True)

  def _stacked(self, outputs) -> tf.Tensor:
    """The step's outputs as one float32 vector, in the order of `output_names`. A non-scalar
    output is noted (`run` raises, naming it, once the trace is done) and traced as 0."""
    values = []
    for name in cast(list, self.output_names):
      value = tf.cast(outputs[name], tf.float32)
      if value.shape.rank != 0:
        self._not_scalar[name] = value.shape
        value = tf.constant(0.0)
      values.append(value)
    return tf.stack(values)

  def stop_after_skip(self, count: int) -> None:
    """Host side: the next calls stop right after the skip that brings skipped_steps to `count`
    (0 = never). Written only when it changes: an eager assign is a host round trip per call."""
    if count != self._stop_at_skip:
      self.stop_at_skip.assign(count)
      self._stop_at_skip = count

  def run(self, iterator, num_steps: int) -> Counters:
    """Host side: one compiled call of `num_steps` steps; the counters after it."""
    steps = tf.constant(num_steps, tf.int64)
    if self.output_names is None:  # the first call: trace, then size the sums to the names
      try:
        self.compiled.get_concrete_function(iterator, steps)
      except Exception as e:  # pylint: disable=broad-except  (re-raised, maybe unwrapped)
        ours = _ours(e)
        if ours is e:
          raise
        raise ours from None
      self.sums.assign(tf.zeros([len(cast(list, self.output_names))]))  # set by the trace
    if self._not_scalar:
      shapes = ', '.join(f"'{k}' of shape {v}" for k, v in sorted(self._not_scalar.items()))
      raise UserError(
        f'{type(self.step).__name__}.step returned {shapes}: the loop adds up each '
        'output over the steps and logs its mean, so each must be a scalar '
        '(reduce it in the step, e.g. tf.reduce_mean)'
      )
    with user_code.xla_errors('the train step'), grappler_lib.passes(self.grappler):
      return Counters(*(int(v) for v in self.compiled(iterator, steps).numpy()))

  def read_outputs(self) -> dict[str, Any]:
    """Host side: the counters as counts (int), every other output as its mean over the steps whose
    loss was finite (NaN when there were none), since the last read; resets the sums. Then
    the stateful metrics' results (reset too)."""
    if self.output_names is None:
      return {}
    return step_outputs.read(self.output_names, self.sums, self.step.metrics)
