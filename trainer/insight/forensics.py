"""Forensics of a non-finite step: replay it eagerly and name the layer where the value overflowed.

A compiled step (maybe XLA, maybe several replicas) only tells that some gradient was non-finite,
which after a forward overflow is every gradient upstream. `replay(model, compute_loss, batch,
loss_scale=...)` runs the same batch from the same weights again, eagerly, on one replica, with
every layer's `call` hooked (nested layers included, so the innermost layer is named):

  forward   the layers' outputs in the order they were computed; the first non-finite one names
            the layer (its inputs were finite: an earlier layer's output would have been first);
  backward  when the loss is finite: the gradient of loss x scale with respect to every layer's
            output, input and weights, walked from the last layer to the first (innermost
            layers before the layers containing them); the first layer whose input (or weight)
            gradient is non-finite while its output gradient is finite names the layer.

The culprit layer alone is then run twice more, with every op it executes watched (TF's op
callbacks, the hook `tf.debugging.enable_check_numerics` uses): in its own dtype, which names the
first op whose output is non-finite, and in float32, which says how large that op's value and the
named tensor would have been (`op Exp: max 8.4e+04 > float16 max 65504; the layer's output:
max |x| 7.1e+02 in float32`): a layer's output can fit while a value inside it overflowed. For a
Cast, the op's value is its input. The result is a `Report`, whose `line()` is one log line.

A forensic folder (`save` / `load`, `<workdir>/forensics/step-N/`) holds the batch (batch.npz),
the pre-step weights (a tf.train.Checkpoint of the model), meta.json (step, loss scale, policy,
the config) and the report (report.txt, report.json); `replay_folder(trainer, folder)` replays
it later (`launch.py --mode=diagnose --forensics=DIR`). `RateLimiter` decides which skipped
steps get a folder (the first few, then every M-th), so a storm of skips costs little.
`ForensicStop` runs the runner's compiled calls: the loop stops right after such a skip, with
its batch kept on the device (trainer/step/loop.py) and the weights it started from (a skip
changes none); the step is replayed (`record`), then a second call runs the rest.
"""

from __future__ import annotations

import dataclasses
import math

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from trainer.errors import UserError, message_line
from trainer.insight import op_watch
from trainer.insight.forensic_folder import folder_for, load, save, write_report
from trainer.insight.forensic_folder import Forensics, run_of  # noqa: F401  (re-exported)
from trainer.nn.paths import layer_paths, variable_name
from trainer.insight.hooks import (
  Call,
  float32,
  float_leaves,
  is_float,
  quantized_calls_compiled,
  recording,
  sublayers,
  to_float32,
  trainable,
)

FORWARD, BACKWARD = 'forward', 'backward'


@dataclasses.dataclass
class Report:
  """Where a replayed step first became non-finite. `phase` is 'forward', 'backward' or ''
  (the replay was finite). `tensor`: 'output', 'input gradient', 'weight gradient', 'output
  gradient', 'input' (the batch itself) or 'loss'."""

  phase: str
  layer: str = ''
  layer_class: str = ''
  tensor: str = ''
  op: str = ''
  dtype: str = ''  # the dtype the value was computed in
  max_abs_float32: float | None = None  # the same value computed in float32 (None: not run)
  loss: float | None = None
  loss_scale: float = 1.0
  detail: str = ''  # e.g. the variables, or why no range is given
  skipped: bool = False  # the compiled step skipped this step (else: a replay on request)
  op_max_abs_float32: float | None = None  # the op's own output computed in float32
  largest_of: str = ''  # of several non-finite weight gradients, the one max_abs_float32 is of

  def line(self) -> str:
    if not self.phase:
      text = (
        'replay finite: no non-finite value in the forward or backward pass at loss scale '
        f'{self.loss_scale:g}'
      )
      if self.skipped:  # the same batch and weights: what differs is how the step computed
        text += (
          " (the compiled step differed: its replicas' or micro-batches' gradient sums, "
          'a different random draw, XLA, or a debug.inject_nonfinite_* injection)'
        )
      return text
    where = f"'{self.layer}' ({self.layer_class})" if self.layer else 'compute_loss'
    text = f'first non-finite: {self.phase} {self.tensor} of {where}'
    if self.detail:
      text += f' [{self.detail}]'
    symbol = 'x' if self.phase == FORWARD else 'dw' if self.tensor == 'weight gradient' else 'dx'
    of = f' ({self.largest_of})' if self.largest_of else ''
    tensor = self.max_abs_float32
    op = self.op_max_abs_float32 if self.dtype else None
    if op is not None and tensor is not None and f'{op:.2g}' == f'{tensor:.2g}':
      op = None  # the same value to the digits shown: one figure for both
    if self.op:
      text += f', op {self.op}'
      if op is not None:
        text += f': {self._range("max", op)}'
    if tensor is not None and self.dtype:
      # After the op's own value, say whose this one is: a layer's output can fit while a value
      # inside the layer overflowed.
      if op is not None:
        text += f"; the layer's {self.tensor}{of}: " + self._range(f'max |{symbol}|', tensor)
      else:
        text += ', ' + self._range(f'max |{symbol}|{of}', tensor)
    if self.phase == BACKWARD:
      text += f' at loss scale {self.loss_scale:g}'
    return text

  def _range(self, what: str, value: float) -> str:
    """`what` computed in float32 against the compute dtype's largest finite value."""
    limit = _dtype_max(self.dtype)
    if not math.isfinite(value):
      return f'{what} non-finite in float32 too (not a range problem of {self.dtype})'
    if limit is not None and value > limit:
      return f'{what} {value:.2g} > {self.dtype} max {limit:.6g}'
    return f'{what} {value:.2g} in float32 ({self.dtype} max {limit:.6g})'

  def to_json(self) -> dict:
    """The fields and the line, JSON-safe: a non-finite float is written as 'nan' or 'inf'
    (JSON has no NaN; Python's float() reads them back)."""
    fields = {
      k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
      for k, v in dataclasses.asdict(self).items()
    }
    return {**fields, 'line': self.line()}


def _dtype_max(dtype: str) -> float | None:
  try:
    return (
      float(np.finfo(tf.as_dtype(dtype).as_numpy_dtype).max)
      if dtype != 'bfloat16'
      else float(tf.bfloat16.max)
    )
  except (TypeError, ValueError):
    return None


def nonfinite(tensors) -> bool:
  """Whether some float tensor in the (nested) `tensors` has a non-finite element."""
  return any(
    is_float(t) and not bool(tf.reduce_all(tf.math.is_finite(t)))
    for t in tf.nest.flatten(tensors)
    if t is not None
  )


def max_abs(tensors) -> float:
  values = [
    float(tf.reduce_max(tf.abs(tf.cast(t, tf.float32))))
    for t in tf.nest.flatten(tensors)
    if is_float(t) and tf.size(t) > 0
  ]
  return max(values, default=0.0)


def _forward_report(call: Call, path: str, scale, loss=None) -> Report:
  layer = call.layer
  run = lambda: layer(*call.args, **call.kwargs)
  _, ops = op_watch.watched(run)
  with float32(layer):
    outputs32, ops32 = op_watch.watched(
      lambda: layer(*to_float32(call.args), **to_float32(call.kwargs))
    )
  op, value = op_watch.culprit(ops, ops32) or (op_watch.failing_op(run), None)
  return Report(
    FORWARD,
    path,
    type(layer).__name__,
    'output',
    op,
    layer.compute_dtype,
    max_abs(outputs32),
    loss,
    scale,
    op_max_abs_float32=value,
  )


def _layer_vjp(call: Call, upstream, float32: bool):
  """(input gradients, weight gradients) of one layer call for the output gradient `upstream`."""
  args, kwargs = call.args, call.kwargs
  if float32:
    args, kwargs, upstream = to_float32(args), to_float32(kwargs), to_float32(upstream)
  inputs = float_leaves((args, kwargs))
  weights = trainable(call.layer)
  with tf.GradientTape() as tape:
    for t in inputs:
      tape.watch(t)
    outputs = call.layer(*args, **kwargs)
  outs = float_leaves(outputs)
  ups = [
    tf.cast(u, o.dtype) if u is not None else tf.zeros_like(o)
    for o, u in zip(outs, tf.nest.flatten(upstream))
  ]
  grads = tape.gradient(outs, inputs + list(weights), output_gradients=ups)
  return grads[: len(inputs)], grads[len(inputs) :]


def _backward_report(
  call: Call, path: str, upstream, tensor: str, bad: list[str], scale, loss
) -> Report:
  """`path`: the layer's (trainer/nn/paths.py); `bad`: the paths of the layer's non-finite weight
  gradients (tensor 'weight gradient')."""
  layer = call.layer
  run = lambda: _layer_vjp(call, upstream, float32=False)  # noqa: E731
  _, ops = op_watch.watched(run)
  largest, largest_of, ops32 = None, '', []
  if upstream is not None and not nonfinite(upstream):
    with float32(layer):
      (dx32, dw32), ops32 = op_watch.watched(lambda: _layer_vjp(call, upstream, float32=True))
    if tensor == 'input gradient':
      largest = max_abs(dx32)
    else:  # the non-finite weights' gradients only; which one, when several
      sizes = {
        variable_name(v): max_abs(g)
        for v, g in zip(trainable(layer), dw32)
        if variable_name(v) in bad and g is not None
      }
      if sizes:
        largest_of = max(sizes, key=lambda path: sizes[path])
        largest = sizes[largest_of]
        largest_of = largest_of if len(sizes) > 1 else ''
  # Without a float32 run (a non-finite upstream) no op but a Cast has a value.
  op, op_value = op_watch.culprit(ops, ops32) or (op_watch.failing_op(run), None)
  return Report(
    BACKWARD,
    path,
    type(layer).__name__,
    tensor,
    op,
    layer.compute_dtype,
    largest,
    loss,
    scale,
    ', '.join(bad),
    op_max_abs_float32=op_value,
    largest_of=largest_of,
  )


def replay(model: keras.Model, compute_loss, batch, *, loss_scale: float = 1.0) -> Report:
  """Replays one step eagerly on `batch` from the model's current weights and reports where the
  first non-finite value appeared (see the module docstring). `compute_loss(batch, training=True)`
  returns (per-example loss, metrics), as the Trainer's hook; the loss is their mean (plus the
  model's regularization losses), times `loss_scale`. The model's state is as it was after: the
  variables its forward pass assigns (BatchNorm statistics) are put back.

  The whole global batch is replayed, so an example of any replica is in it: each example's
  gradients are the step's (1/global batch x scale in both); only the weight gradients sum more
  examples (all replicas' and micro-batches') than any one replica's in the step."""
  from trainer.step.forward_state import forward_state_kept

  with forward_state_kept(model), quantized_calls_compiled(model):
    return _replay(model, compute_loss, batch, float(loss_scale))


def _replay(model, compute_loss, batch, scale: float) -> Report:
  batch = tf.nest.map_structure(tf.convert_to_tensor, batch)
  if nonfinite(batch):
    return Report(
      FORWARD, tensor='input', detail='the batch itself has non-finite values', loss_scale=scale
    )
  # Not persistent: one gradient call below; and a persistent tape cannot differentiate the
  # compiled float8 calls (quantized_calls_compiled).
  with tf.GradientTape() as tape:
    with recording(model, tape) as calls:
      per_example, _ = compute_loss(batch, training=True)
    per_example = tf.cast(per_example, tf.float32)
    loss = tf.reduce_mean(per_example)
    if model.losses:
      loss += tf.add_n([tf.cast(l, tf.float32) for l in model.losses])
    scaled = loss * scale
  loss_value = float(loss)
  paths = layer_paths(model)
  name = lambda layer: paths.get(id(layer), layer.name)  # noqa: E731
  for call in calls:  # forward, in the order the outputs were computed
    if nonfinite(call.outputs):
      if nonfinite((call.args, call.kwargs)):  # not from a layer: an op between layers
        return Report(
          FORWARD,
          name(call.layer),
          type(call.layer).__name__,
          'input',
          detail='non-finite before this layer: made by an op outside the layers '
          "(compute_loss or a containing layer's own code)",
          loss_scale=scale,
        )
      return _forward_report(call, name(call.layer), scale, loss_value)
  if not math.isfinite(loss_value):
    return Report(
      FORWARD,
      tensor='loss',
      detail='every layer output finite; the loss is not',
      loss=loss_value,
      loss_scale=scale,
    )

  # Backward: one gradient call for every recorded output, input and weight.
  outputs = [float_leaves(c.outputs) for c in calls]
  inputs = [float_leaves((c.args, c.kwargs)) for c in calls]
  weights = [trainable(c.layer) for c in calls]
  flat = [t for group in (outputs, inputs, weights) for ts in group for t in ts]
  grads = iter(tape.gradient(scaled, flat, unconnected_gradients=tf.UnconnectedGradients.NONE))
  del tape
  d_out = [[next(grads) for _ in ts] for ts in outputs]
  d_in = [[next(grads) for _ in ts] for ts in inputs]
  d_w = [[next(grads) for _ in ts] for ts in weights]
  leaf = [not sublayers(c.layer) for c in calls]
  # From the loss back to the input: the innermost layers first, containers (whose own ops may
  # be at fault) only when no layer inside them is.
  order = [i for i in reversed(range(len(calls))) if leaf[i]] + [
    i for i in reversed(range(len(calls))) if not leaf[i]
  ]
  for i in order:
    call = calls[i]
    if nonfinite(d_out[i]):
      return Report(
        BACKWARD,
        name(call.layer),
        type(call.layer).__name__,
        'output gradient',
        detail='non-finite where it enters this layer (from compute_loss or a cast between layers)',
        dtype=call.layer.compute_dtype,
        loss=loss_value,
        loss_scale=scale,
      )
    upstream = tf.nest.pack_sequence_as(call.outputs, _expand(call.outputs, d_out[i]))
    if nonfinite(d_in[i]):
      return _backward_report(
        call, name(call.layer), upstream, 'input gradient', [], scale, loss_value
      )
    if leaf[i]:
      bad = [variable_name(v) for v, g in zip(weights[i], d_w[i]) if g is not None and nonfinite(g)]
      if bad:
        return _backward_report(
          call, name(call.layer), upstream, 'weight gradient', bad, scale, loss_value
        )
  return Report('', loss=loss_value, loss_scale=scale)


def _expand(structure, float_grads):
  """Gradients for every leaf of `structure` (None for non-float leaves)."""
  grads = iter(float_grads)
  return [next(grads) if is_float(t) else None for t in tf.nest.flatten(structure)]


def replay_folder(trainer, folder: str) -> Report:
  """Restores a folder's weights into `trainer.model`, replays its batch with its loss scale,
  writes report.txt / report.json next to it and returns the report."""
  forensics = load(folder)
  forensics.restore_weights(trainer.model)
  try:
    report = replay(
      trainer.model, trainer.compute_loss, forensics.batch, loss_scale=forensics.loss_scale
    )
  except (ValueError, TypeError, KeyError, IndexError, tf.errors.InvalidArgumentError) as e:
    first = message_line(e)[:200]
    raise UserError(
      f'--forensics={folder}: its batch does not fit the model built from the '
      f'config ({type(e).__name__}: {first}); pass the --config of the run that '
      'wrote the folder'
    ) from None
  report.skipped = forensics.skipped
  write_report(folder, report)
  return report


def record(
  trainer, batch, step: int, *, loss_scale: float | None = None, skipped: bool = True
) -> Report:
  """For the outer loop, after a skipped step: replays `batch` from the trainer's current
  (pre-step: the skipped step changed nothing) weights, logs the report's line and writes
  <workdir>/forensics/step-N/. Call it before any later step changes the weights. `skipped`
  False: a replay on request (--mode=diagnose), of a step no compiled step skipped."""
  scale = float(trainer.loss_scaler.scale.numpy()) if loss_scale is None else loss_scale
  report = replay(trainer.model, trainer.compute_loss, batch, loss_scale=scale)
  report.skipped = skipped
  folder = save(
    folder_for(trainer.workdir, step),
    model=trainer.model,
    batch=batch,
    loss_scale=scale,
    step=step,
    config=trainer.config,
    policy=trainer.policy,
    report=report,
    run=trainer.workdir,
  )
  logging.warning('step %d: %s (forensics: %s)', step, report.line(), folder)
  return report


class RateLimiter:
  """Which skipped steps get forensics: the first `first`, then every `every`-th skip after
  them (0: none after the first few). It keeps no count: ForensicStop asks `next_after` with the
  number of skips so far."""

  def __init__(self, first: int = 3, every: int = 100) -> None:
    self.first, self.every = int(first), int(every)

  def next_after(self, count: int) -> int:
    """The number of the first skip after `count` skips that gets forensics (0: none)."""
    if count < self.first:
      return count + 1
    if self.every <= 0:
      return 0
    return self.first + ((count - self.first) // self.every + 1) * self.every


class ForensicStop:
  """Runs `loop` (a TrainLoop) for `trainer`; `workdir`: the run folder (`is_chief`,
  `open_for_writing`); `numerics`: config.numerics (forensics_first, forensics_every)."""

  def __init__(self, trainer, loop, workdir, numerics):
    self.trainer, self.loop, self.workdir = trainer, loop, workdir
    self.limiter = RateLimiter(numerics.forensics_first, numerics.forensics_every)

  def run(self, iterator, num_steps: int, check) -> int:
    """`num_steps` steps from `iterator` in one compiled call, or two and more when a skip that
    gets forensics ended one early (replayed before the next); `check(counters)` after each
    call raises what the call found (StepState.check). Returns the global step after them."""
    loop, state = self.loop, self.trainer.train_step.state
    target = None  # the global step to reach: the first call's start + num_steps
    skipped = state.skipped() if loop.forensics else 0
    while True:
      if loop.forensics:  # the compiled loop stops after the next skip that gets forensics
        stop_at = self.limiter.next_after(skipped)
        loop.stop_after_skip(stop_at)
      counters = loop.run(iterator, num_steps)
      if target is None:
        target = counters.first_step + num_steps
      skipped, step = counters.skipped_steps, counters.global_step
      check(counters)
      if step >= target:
        break
      # Stopped early, right after a skipped step: replay it, then run the rest of the call.
      self.replay(step - 1)
      num_steps = target - step
    if loop.forensics and skipped == stop_at:
      self.replay(step - 1)  # the skip was the call's last step
    return step

  def replay(self, step: int) -> None:
    """Replays skipped step `step` eagerly, layer by layer, from the current weights (a skip
    changed none), and writes <workdir>/forensics/step-N/ (trainer/insight/forensics.py)."""
    if not self.workdir.is_chief:
      return
    tr = self.trainer
    # The step's own batch, kept on the device by the compiled loop when it stopped after the
    # skip (trainer/step/kept_batch.py: re-reading element N of the pipeline gives another
    # batch when it reshuffles, augments at random or is non-deterministic).
    kept = self.loop.kept_batch
    batch = kept.read() if kept is not None else None
    if batch is None:
      logging.warning(
        "step %d: the skipped step's batch was not kept; replaying element %d of "
        'datasets.train, which differs when the pipeline reshuffles',
        step,
        step,
      )
      batch = next(iter(tr.datasets.train.skip(step)))
    self.workdir.open_for_writing(step)
    try:
      scale = float(tr.train_step.state.guard.last_scale.numpy())  # the skipped group's
      record(tr, batch, step, loss_scale=scale)
    except UserError as e:  # a planted symlink, a full disk: refused, said in one line
      logging.warning('step %d: %s; training goes on', step, e)
    except Exception as e:  # pylint: disable=broad-except  (diagnostics never end a run)
      logging.warning(
        'step %d: the forensic replay failed (%s: %s); training goes on',
        step,
        type(e).__name__,
        message_line(e, last=True)[:200],
      )
