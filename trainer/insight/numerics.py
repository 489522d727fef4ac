"""On-device numerics statistics: where the precision is tight, per layer, at log steps.

Every `numerics.every` steps (at the first log boundary past each multiple; 0 = off) the trainer
runs one compiled probe: a forward and backward pass of `compute_loss` at the current weights and
loss scale, on a batch from an iterator of its own (the training iterator's order, hence a
resume, is untouched), with the forward-pass state (BatchNorm statistics) put back afterwards.
The probe computes what one replica's (first) micro-batch computes in a step, with the default
step's loss (`TrainStep.replica_share`, `share_loss`): a whole global batch would sum replicas x
micro-batches as many examples into each weight gradient and under-report its underflow.
Only the statistics are read back:

  per layer, over the gradients of its variables as the backward pass computes them (scaled):
    grad_max         the largest |gradient| after unscaling (of that share of the batch);
    grad_underflow   the fraction of elements that are zero or below the smallest normal number
                     of the layer's compute dtype (float16: 6.1e-5), i.e. lost or losing
                     precision at this loss scale;
    grad_nonfinite   the fraction that is inf or NaN;
  per layer, over its forward output:
    output_max       the largest |output|;
    headroom_bits    log2(largest finite value of the compute dtype / output_max): how many
                     doublings the activations can take before they overflow.

They go to TensorBoard under `numerics/<layer>/...`, and one console line names the worst layers.
The train step itself is unchanged: off costs nothing, on costs one probe per interval.
"""
from __future__ import annotations

import contextlib
import math

import ml_dtypes
import numpy as np
import tensorflow as tf
from absl import logging

from trainer.step.forward_state import forward_state_kept


def smallest_normal(dtype) -> float:
  return float(ml_dtypes.finfo(tf.as_dtype(dtype).as_numpy_dtype).tiny)  # numpy lacks bfloat16


def largest(dtype) -> float:
  return float(ml_dtypes.finfo(tf.as_dtype(dtype).as_numpy_dtype).max)


def leaf_layers(model) -> list:
  """The model's layers that hold no other layers, in order."""
  return [layer for layer in model._flatten_layers(include_self=False)  # pylint: disable=protected-access
          if not list(layer._flatten_layers(include_self=False))]  # pylint: disable=protected-access


def layer_name(layer) -> str:
  return getattr(layer, 'path', None) or layer.name


@contextlib.contextmanager
def recording_outputs(layers, record):
  """While active, each layer's `call` also calls `record(layer, output)`. Used while a
  tf.function traces, so the recorded tensors are the graph's."""
  originals = {}
  for layer in layers:
    original = layer.call
    originals[layer] = original

    def call(*args, __original=original, __layer=layer, **kwargs):
      output = __original(*args, **kwargs)
      record(__layer, output)
      return output

    layer.call = call
  try:
    yield
  finally:
    for layer, original in originals.items():
      layer.call = original


class Probe:
  """The compiled statistics pass for one trainer (built on first use)."""

  def __init__(self, trainer):
    self.trainer = trainer
    model = trainer.model
    self.layers = leaf_layers(model)
    self.variables = list(trainer.train_step.variables)
    owner = {}
    for layer in self.layers:
      for v in layer.trainable_weights:
        owner.setdefault(id(getattr(v, 'value', v)), layer)
    self.owners = [owner.get(id(getattr(v, 'value', v))) for v in self.variables]
    self._fn = tf.function(self._stats)
    self._iterator = None

  def _stats(self, batch):
    t = self.trainer
    outputs = {}

    def record(layer, output):
      values = [o for o in tf.nest.flatten(output) if hasattr(o, 'dtype') and o.dtype.is_floating]
      if values:
        outputs[layer_name(layer)] = tf.reduce_max(
            tf.stack([tf.reduce_max(tf.abs(tf.cast(o, tf.float32))) for o in values]))

    # One replica's (micro-)batch with the step's own loss: the gradients the step computes.
    share = t.train_step.replica_share(batch)
    with forward_state_kept(t.model):
      with recording_outputs(self.layers, record), tf.GradientTape() as tape:
        per_example, _ = t.compute_loss(share, training=True)
        scaled = t.loss_scaler.scale_loss(t.train_step.share_loss(per_example))
      grads = tape.gradient(scaled, self.variables)
    scale = tf.cast(t.loss_scaler.scale, tf.float32) if t.loss_scaler.mode != 'none' else 1.0
    grad_stats = []
    for g, layer in zip(grads, self.owners):
      if g is None:
        grad_stats.append(tf.zeros([4]))
        continue
      g = tf.convert_to_tensor(g)
      magnitude = tf.abs(tf.cast(g, tf.float32))
      tiny = smallest_normal(layer.compute_dtype if layer is not None else tf.float32)
      finite = tf.math.is_finite(magnitude)
      grad_stats.append(tf.stack([
          tf.reduce_max(tf.where(finite, magnitude, 0.0)) / scale,
          tf.reduce_sum(tf.cast(magnitude < tiny, tf.float32)),
          tf.reduce_sum(1.0 - tf.cast(finite, tf.float32)),
          tf.cast(tf.size(magnitude), tf.float32)]))
    return tf.stack(grad_stats), outputs

  def next_batch(self):
    if self._iterator is None:
      self._iterator = iter(self.trainer.datasets.train)
    return next(self._iterator)

  def measure(self, batch=None) -> tuple[dict[str, dict[str, float]], float]:
    """({layer: {statistic: value}}, the underflow fraction over all gradient elements) for one
    batch (default: the probe's next train batch)."""
    grad_stats, output_max = self._fn(self.next_batch() if batch is None else batch)
    stats: dict[str, dict[str, float]] = {}
    sums: dict[str, np.ndarray] = {}
    for row, layer in zip(grad_stats.numpy(), self.owners):
      name = layer_name(layer) if layer is not None else '?'
      if name not in sums:
        sums[name] = np.zeros(4)
      sums[name] = np.array([max(sums[name][0], row[0]), *(sums[name][1:] + row[1:])])
    for name, (grad_max, under, nonfinite, count) in sums.items():
      if count:
        stats[name] = {'grad_max': float(grad_max), 'grad_underflow': under / count,
                       'grad_nonfinite': nonfinite / count}
    total = sum(sums.values(), np.zeros(4))
    overall = float(total[1] / total[3]) if total[3] else 0.0
    dtypes = {layer_name(layer): layer.compute_dtype for layer in self.layers}
    for name, value in output_max.items():
      value = float(value)
      entry = stats.setdefault(name, {})
      entry['output_max'] = value
      entry['headroom_bits'] = (math.log2(largest(dtypes[name]) / value) if 0 < value < math.inf
                                else (math.inf if value == 0 else -math.inf))
    return stats, overall


def summary_line(step: int, stats: dict, scale: float, overall_underflow: float) -> str:
  """One console line: the gradient underflow overall and the worst layer, the least headroom."""
  parts = [f'numerics at step {step}: gradient underflow {100 * overall_underflow:.1f} % at '
           f'scale {scale:g}']
  under = [(v['grad_underflow'], k) for k, v in stats.items() if 'grad_underflow' in v]
  if under:
    worst, name = max(under)
    parts.append(f'worst {name} {100 * worst:.1f} %')
  bad = [(v['grad_nonfinite'], k) for k, v in stats.items() if v.get('grad_nonfinite', 0) > 0]
  if bad:
    parts.append('non-finite gradients in ' + ', '.join(k for _, k in sorted(bad)[::-1][:3]))
  room = [(v['headroom_bits'], k) for k, v in stats.items() if 'headroom_bits' in v]
  if room:
    bits, name = min(room)
    parts.append(f'least headroom {name} ({bits:.1f} doublings to overflow)')
  return '; '.join(parts)


class Recorder:
  """The trainer's side: when to measure, and where the numbers go."""

  def __init__(self, trainer, every: int, write_scalars=None):
    self.trainer, self.every = trainer, int(every)
    self.write_scalars = write_scalars  # (prefix, {name: value}, step); None: no TensorBoard
    self.probe = None
    self.last = None

  def start(self, step: int) -> None:
    """The run (or resumed run) starts at `step`."""
    self.last = step

  def due(self, step: int) -> bool:
    """At a log step: whether a multiple of `every` was passed since the last measurement."""
    if self.every <= 0:
      return False
    if self.last is None:
      self.last = 0
    if step // self.every > self.last // self.every:
      self.last = step
      return True
    return False

  def record(self, step: int) -> dict:
    """Measures, writes TensorBoard scalars numerics/<layer>/<statistic>, returns the stats and
    the console line."""
    if self.probe is None:
      self.probe = Probe(self.trainer)
    try:
      stats, overall = self.probe.measure()
    except Exception as e:  # pylint: disable=broad-except  (diagnostics never end a run)
      self.every = 0
      line = (f'numerics at step {step}: the statistics probe failed ({type(e).__name__}: '
              f'{str(e).strip().splitlines()[-1][:200]}); numerics.every is off for this run')
      logging.warning(line)
      return {'stats': {}, 'line': line}
    scale = float(self.trainer.loss_scaler.scale.numpy())
    line = summary_line(step, stats, scale, overall)
    scalars = {f'{layer}/{k}': v for layer, values in stats.items() for k, v in values.items()
               if math.isfinite(v)}
    scalars['gradient_underflow'] = overall
    if self.write_scalars is not None:
      self.write_scalars('numerics', scalars, step)
    return {'stats': stats, 'line': line}


class NumericsLine:
  """The built-in action that logs the numerics line at the log steps `Recorder.due` picks."""

  def __init__(self, recorder: Recorder):
    self.recorder = recorder

  def __call__(self, event) -> None:
    if event.kind == 'log' and self.recorder.due(event.step):
      logging.info(self.recorder.record(event.step)['line'])
