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

The culprit layer alone is then run twice more: with `tf.debugging.enable_check_numerics` in its
own dtype (which names the first op whose output is non-finite), and in float32 (how large the
value would have been: `max |x| 2.1e+05 > float16 max 65504`). The result is a `Report`, whose
`line()` is one log line.

A forensic folder (`save` / `load`, `<workdir>/forensics/step-N/`) holds the batch (batch.npz),
the pre-step weights (a tf.train.Checkpoint of the model), meta.json (step, loss scale, policy,
the config) and the report (report.txt, report.json); `replay_folder(trainer, folder)` replays
it later (`launch.py --mode=diagnose --forensics=DIR`). `RateLimiter` decides which skipped
steps get a folder (the first few, then every M-th), so a storm of skips costs little.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from trainer.errors import UserError

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
  detail: str = ''  # e.g. the variable, or why no range is given

  def line(self) -> str:
    if not self.phase:
      return (f'replay finite: no non-finite value in the forward or backward pass at loss scale '
              f'{self.loss_scale:g} (the compiled step differed: another replica, a different '
              'random draw, or XLA)')
    where = f"'{self.layer}' ({self.layer_class})" if self.layer else 'compute_loss'
    text = f'first non-finite: {self.phase} {self.tensor} of {where}'
    if self.detail:
      text += f' [{self.detail}]'
    if self.op:
      text += f", op {self.op}"
    symbol = ('x' if self.phase == FORWARD else
              'dw' if self.tensor == 'weight gradient' else 'dx')
    if self.max_abs_float32 is not None and self.dtype:
      limit = _dtype_max(self.dtype)
      if not math.isfinite(self.max_abs_float32):
        text += f', non-finite in float32 too (not a range problem of {self.dtype})'
      elif limit is not None and self.max_abs_float32 > limit:
        text += (f', max |{symbol}| {self.max_abs_float32:.2g} > {self.dtype} max '
                 f'{limit:.6g}')
      else:
        text += f', max |{symbol}| {self.max_abs_float32:.2g} in float32 ({self.dtype} max ' \
                f'{limit:.6g})'
    if self.phase == BACKWARD:
      text += f' at loss scale {self.loss_scale:g}'
    return text

  def to_json(self) -> dict:
    return {**dataclasses.asdict(self), 'line': self.line()}


def _dtype_max(dtype: str) -> float | None:
  try:
    return float(np.finfo(tf.as_dtype(dtype).as_numpy_dtype).max) if dtype != 'bfloat16' \
        else float(tf.bfloat16.max)
  except (TypeError, ValueError):
    return None


def is_float(t) -> bool:
  return isinstance(t, (tf.Tensor, tf.Variable)) and t.dtype.is_floating


def _nonfinite(tensors) -> bool:
  return any(is_float(t) and not bool(tf.reduce_all(tf.math.is_finite(t)))
             for t in tf.nest.flatten(tensors) if t is not None)


def max_abs(tensors) -> float:
  values = [float(tf.reduce_max(tf.abs(tf.cast(t, tf.float32))))
            for t in tf.nest.flatten(tensors) if is_float(t) and tf.size(t) > 0]
  return max(values, default=0.0)


def _float_leaves(structure):
  return [t for t in tf.nest.flatten(structure) if is_float(t)]


@dataclasses.dataclass
class _Call:
  layer: keras.layers.Layer
  args: tuple
  kwargs: dict
  outputs: object


def sublayers(layer, include_self=False) -> list:
  """Every layer inside `layer` (nested ones too, depth first), without InputLayers."""
  # pylint: disable-next=protected-access
  return [l for l in layer._flatten_layers(include_self=include_self)
          if not isinstance(l, keras.layers.InputLayer)]


@contextlib.contextmanager
def recording(model, tape):
  """Wraps every layer's `call` (an instance attribute, removed on exit) to record its inputs
  and outputs in call-completion order, watching the inputs on `tape`."""
  calls = []
  layers = sublayers(model)
  for layer in layers:
    original = layer.call

    def hooked(*args, __original=original, __layer=layer, **kwargs):
      for t in _float_leaves((args, kwargs)):
        tape.watch(t)
      outputs = __original(*args, **kwargs)
      calls.append(_Call(__layer, args, kwargs, outputs))
      return outputs

    object.__setattr__(layer, 'call', hooked)
  try:
    yield calls
  finally:
    for layer in layers:
      layer.__dict__.pop('call', None)


@contextlib.contextmanager
def _float32(layer):
  """The layer and every layer inside it compute in float32 (their variables are float32 under
  any mixed policy already)."""
  layers = sublayers(layer, include_self=True)
  saved = [l._dtype_policy for l in layers]  # pylint: disable=protected-access
  for l in layers:
    l._dtype_policy = keras.DTypePolicy('float32')  # pylint: disable=protected-access
  try:
    yield
  finally:
    for l, policy in zip(layers, saved):
      l._dtype_policy = policy  # pylint: disable=protected-access


def _to_float32(structure):
  return tf.nest.map_structure(lambda t: tf.cast(t, tf.float32) if is_float(t) else t,
                               structure)


_OP = re.compile(r'op "?([A-Za-z0-9_]+)"?')


@contextlib.contextmanager
def _check_numerics():
  tf.debugging.enable_check_numerics()
  try:
    yield
  finally:
    tf.debugging.disable_check_numerics()


def _failing_op(run) -> str:
  """Runs `run()` with check_numerics on; the type of the first op whose output was non-finite
  ('' when none was caught)."""
  try:
    with _check_numerics():
      run()
  except (tf.errors.InvalidArgumentError, tf.errors.OpError) as e:
    message = str(e)
    match = re.search(r'eagerly-executing op "([^"]+)"', message) or re.search(
        r'op "([^"]+)"', message) or _OP.search(message)
    return match.group(1) if match else ''
  return ''


def _call_layer(call: _Call, args, kwargs):
  return call.layer(*args, **kwargs)


def _forward_report(call: _Call, scale, loss=None) -> Report:
  layer = call.layer
  dtype = layer.compute_dtype
  op = _failing_op(lambda: _call_layer(call, call.args, call.kwargs))
  with _float32(layer):
    outputs32 = _call_layer(call, _to_float32(call.args), _to_float32(call.kwargs))
  return Report(FORWARD, layer.name, type(layer).__name__, 'output', op, dtype,
                max_abs(outputs32), loss, scale)


def _layer_vjp(call: _Call, upstream, float32: bool):
  """(input gradients, weight gradients) of one layer call for the output gradient `upstream`."""
  args, kwargs = call.args, call.kwargs
  if float32:
    args, kwargs, upstream = _to_float32(args), _to_float32(kwargs), _to_float32(upstream)
  inputs = _float_leaves((args, kwargs))
  weights = call.layer.trainable_variables
  with tf.GradientTape() as tape:
    for t in inputs:
      tape.watch(t)
    outputs = _call_layer(call, args, kwargs)
  outs = _float_leaves(outputs)
  ups = [tf.cast(u, o.dtype) if u is not None else tf.zeros_like(o)
         for o, u in zip(outs, tf.nest.flatten(upstream))]
  grads = tape.gradient(outs, inputs + list(weights), output_gradients=ups)
  return grads[:len(inputs)], grads[len(inputs):]


def _backward_report(call: _Call, upstream, tensor: str, detail: str, scale, loss) -> Report:
  layer = call.layer

  def run():
    _layer_vjp(call, upstream, float32=False)

  op = _failing_op(run)
  largest = None
  if upstream is not None and not _nonfinite(upstream):
    with _float32(layer):
      dx32, dw32 = _layer_vjp(call, upstream, float32=True)
    largest = max_abs(dx32 if tensor == 'input gradient' else dw32)
  return Report(BACKWARD, layer.name, type(layer).__name__, tensor, op, layer.compute_dtype,
                largest, loss, scale, detail)


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
  with forward_state_kept(model):
    return _replay(model, compute_loss, batch, float(loss_scale))


def _replay(model, compute_loss, batch, scale: float) -> Report:
  batch = tf.nest.map_structure(tf.convert_to_tensor, batch)
  if _nonfinite(batch):
    return Report(FORWARD, tensor='input', detail='the batch itself has non-finite values',
                  loss_scale=scale)
  with tf.GradientTape(persistent=True) as tape:
    with recording(model, tape) as calls:
      per_example, _ = compute_loss(batch, training=True)
    per_example = tf.cast(per_example, tf.float32)
    loss = tf.reduce_mean(per_example)
    if model.losses:
      loss += tf.add_n([tf.cast(l, tf.float32) for l in model.losses])
    scaled = loss * scale
  loss_value = float(loss)
  for call in calls:  # forward, in the order the outputs were computed
    if _nonfinite(call.outputs):
      if _nonfinite((call.args, call.kwargs)):  # not from a layer: an op between layers
        return Report(FORWARD, call.layer.name, type(call.layer).__name__, 'input',
                      detail='non-finite before this layer: made by an op outside the layers '
                      '(compute_loss or a containing layer\'s own code)', loss_scale=scale)
      return _forward_report(call, scale, loss_value)
  if not math.isfinite(loss_value):
    return Report(FORWARD, tensor='loss', detail='every layer output finite; the loss is not',
                  loss=loss_value, loss_scale=scale)

  # Backward: one gradient call for every recorded output, input and weight.
  outputs = [_float_leaves(c.outputs) for c in calls]
  inputs = [_float_leaves((c.args, c.kwargs)) for c in calls]
  weights = [list(c.layer.trainable_variables) for c in calls]
  flat = [t for group in (outputs, inputs, weights) for ts in group for t in ts]
  grads = iter(tape.gradient(scaled, flat, unconnected_gradients=tf.UnconnectedGradients.NONE))
  del tape
  d_out = [[next(grads) for _ in ts] for ts in outputs]
  d_in = [[next(grads) for _ in ts] for ts in inputs]
  d_w = [[next(grads) for _ in ts] for ts in weights]
  leaf = [not sublayers(c.layer) for c in calls]
  # From the loss back to the input: the innermost layers first, containers (whose own ops may
  # be at fault) only when no layer inside them is.
  order = ([i for i in reversed(range(len(calls))) if leaf[i]] +
           [i for i in reversed(range(len(calls))) if not leaf[i]])
  for i in order:
    call = calls[i]
    if _nonfinite(d_out[i]):
      return Report(BACKWARD, call.layer.name, type(call.layer).__name__, 'output gradient',
                    detail='non-finite where it enters this layer (from compute_loss or a cast '
                    'between layers)', dtype=call.layer.compute_dtype, loss=loss_value,
                    loss_scale=scale)
    upstream = tf.nest.pack_sequence_as(call.outputs, _expand(call.outputs, d_out[i]))
    if _nonfinite(d_in[i]):
      return _backward_report(call, upstream, 'input gradient', '', scale, loss_value)
    if leaf[i]:
      bad = [v.path for v, g in zip(weights[i], d_w[i]) if g is not None and _nonfinite(g)]
      if bad:
        return _backward_report(call, upstream, 'weight gradient', bad[0], scale, loss_value)
  return Report('', loss=loss_value, loss_scale=scale)


def _expand(structure, float_grads):
  """Gradients for every leaf of `structure` (None for non-float leaves)."""
  grads = iter(float_grads)
  return [next(grads) if is_float(t) else None for t in tf.nest.flatten(structure)]


# ---- the forensic folder ---------------------------------------------------------------------

def _encode(structure, arrays):
  if isinstance(structure, dict):
    return {'dict': {k: _encode(v, arrays) for k, v in structure.items()}}
  if isinstance(structure, (list, tuple)):
    return {'tuple' if isinstance(structure, tuple) else 'list':
            [_encode(v, arrays) for v in structure]}
  arrays[f'leaf_{len(arrays)}'] = np.asarray(structure)
  return {'leaf': f'leaf_{len(arrays) - 1}'}


def _decode(spec, arrays):
  if 'dict' in spec:
    return {k: _decode(v, arrays) for k, v in spec['dict'].items()}
  if 'tuple' in spec:
    return tuple(_decode(v, arrays) for v in spec['tuple'])
  if 'list' in spec:
    return [_decode(v, arrays) for v in spec['list']]
  return arrays[spec['leaf']]


def folder_for(workdir: str, step: int) -> str:
  return os.path.join(workdir, 'forensics', f'step-{step}')


def save(folder: str, *, model: keras.Model, batch, loss_scale: float, step: int,
         config=None, policy: str = '', report: Report | None = None) -> str:
  """Writes a forensic folder: batch.npz, weights/ (tf.train.Checkpoint of `model`, the
  pre-step weights), meta.json and, given a report, report.txt and report.json."""
  os.makedirs(folder, exist_ok=True)
  arrays = {}
  spec = _encode(tf.nest.map_structure(lambda t: np.asarray(t), batch), arrays)
  np.savez(os.path.join(folder, 'batch.npz'), **arrays)
  tf.train.Checkpoint(model=model).write(os.path.join(folder, 'weights', 'ckpt'))
  meta = {'step': int(step), 'loss_scale': float(loss_scale), 'policy': policy,
          'batch_structure': spec,
          'config': config.to_dict() if hasattr(config, 'to_dict') else config}
  with open(os.path.join(folder, 'meta.json'), 'w') as f:
    json.dump(meta, f, indent=2, sort_keys=True, default=str)
  if report is not None:
    write_report(folder, report)
  return folder


def write_report(folder: str, report: Report) -> None:
  with open(os.path.join(folder, 'report.txt'), 'w') as f:
    f.write(report.line() + '\n')
  with open(os.path.join(folder, 'report.json'), 'w') as f:
    json.dump(report.to_json(), f, indent=2, sort_keys=True)


@dataclasses.dataclass
class Forensics:
  folder: str
  step: int
  loss_scale: float
  policy: str
  config: dict | None
  batch: object

  def restore_weights(self, model: keras.Model) -> None:
    """Loads the saved pre-step weights into `model` (built the same way)."""
    try:
      tf.train.Checkpoint(model=model).read(
          os.path.join(self.folder, 'weights', 'ckpt')).assert_existing_objects_matched()
    except (AssertionError, ValueError, tf.errors.OpError) as e:
      first = (str(e).strip().splitlines() or [''])[0]
      raise UserError(f'--forensics={self.folder}: its weights do not fit the model built from '
                      f'the config ({type(e).__name__}: {first[:200]}); pass the --config of '
                      'the run that wrote the folder') from None


def load(folder: str) -> Forensics:
  meta_path = os.path.join(folder, 'meta.json')
  if not os.path.isfile(meta_path):
    raise UserError(f'--forensics={folder}: no meta.json there; pass a folder written by a '
                    'skipped step, such as <workdir>/forensics/step-N')
  with open(meta_path) as f:
    meta = json.load(f)
  with np.load(os.path.join(folder, 'batch.npz')) as arrays:
    batch = _decode(meta['batch_structure'], {k: arrays[k] for k in arrays.files})
  return Forensics(folder, meta['step'], meta['loss_scale'], meta.get('policy', ''),
                   meta.get('config'), batch)


def replay_folder(trainer, folder: str) -> Report:
  """Restores a folder's weights into `trainer.model`, replays its batch with its loss scale,
  writes report.txt / report.json next to it and returns the report."""
  forensics = load(folder)
  forensics.restore_weights(trainer.model)
  report = replay(trainer.model, trainer.compute_loss, forensics.batch,
                  loss_scale=forensics.loss_scale)
  write_report(folder, report)
  return report


def record(trainer, batch, step: int, *, loss_scale: float | None = None) -> Report:
  """For the outer loop, after a skipped step: replays `batch` from the trainer's current
  (pre-step: the skipped step changed nothing) weights, logs the report's line and writes
  <workdir>/forensics/step-N/. Call it before any later step changes the weights."""
  scale = float(trainer.loss_scaler.scale.numpy()) if loss_scale is None else loss_scale
  report = replay(trainer.model, trainer.compute_loss, batch, loss_scale=scale)
  folder = save(folder_for(trainer.workdir, step), model=trainer.model, batch=batch,
                loss_scale=scale, step=step, config=trainer.config, policy=trainer.policy,
                report=report)
  logging.warning('step %d: %s (forensics: %s)', step, report.line(), folder)
  return report


class RateLimiter:
  """Which skipped steps get forensics: the first `first`, then every `every`-th skip after
  them (0: none after the first few). `should_record()` counts one skip per call."""

  def __init__(self, first: int = 3, every: int = 100):
    self.first, self.every, self.seen = int(first), int(every), 0

  def should_record(self) -> bool:
    self.seen += 1
    return self.wants(self.seen)

  def wants(self, k: int) -> bool:
    """Whether the k-th skip (1-based) gets forensics."""
    if k <= self.first:
      return True
    return self.every > 0 and (k - self.first) % self.every == 0

  def next_after(self, count: int) -> int:
    """The number of the first skip after `count` skips that gets forensics (0: none)."""
    if count < self.first:
      return count + 1
    if self.every <= 0:
      return 0
    return self.first + ((count - self.first) // self.every + 1) * self.every
