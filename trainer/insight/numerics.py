"""On-device numerics statistics: where the precision is tight, per layer, at log steps.

Every `numerics.every` steps (at the first log step, then at the first log boundary past each
multiple; 0 = off) one probe (`Probe`) runs a forward and backward pass of `compute_loss` at the
current weights and loss scale on the first eval batch (`Probe.next_batch`), the forward-pass
state (BatchNorm statistics, dropout seeds) put back afterwards. It computes what one replica's
(first) micro-batch computes in a step, with the step's loss (`TrainStep.replica_share`,
`share_loss`): a whole global batch would sum replicas x micro-batches as many examples into each
weight gradient and under-report what is lost. Underflow is what the precision loses, so the
same gradients are computed again with every layer in float32 (the reference; same weights,
batch and forward state), and per weight-gradient element the probe counts:

  flushed    zero in the compute dtype, non-zero in float32 and, at this loss scale, below the
             compute dtype's smallest normal number: lost to its range (directly, or upstream).
             A zero of another cause (a ReLU input rounded across 0, a sum that cancelled) is
             not range and not counted. A precision.float8 recipe's layer (under any policy) is
             measured against itself without float8; its range moves with its scales, so every
             zero of its gradients or outputs that is non-zero in float32 counts as flushed;
  subnormal  non-zero but below the smallest normal number (float16: 6.1e-5): fewer bits kept;
  zero       zero in float32 too (dead ReLU units, border pixels): context, not underflow;
  non-finite inf or NaN in the compute dtype.

Per layer: these fractions over its variables' gradients (Keras float8 layers' scale and
amax-history variables are left out: their "gradients" are new values), grad_max (the largest
unscaled |gradient|), and over its forward output (`quantized_call` hooked too) output_max,
output_flushed, output_subnormal and headroom_bits (log2(dtype max / output_max): doublings
before overflow). They go to TensorBoard under `numerics/<layer path>/...` (trainer/nn/paths.py) and
`numerics/gradient_*`; one console line (`summary_line`) gives the flushed fraction and the worst
layer, or says nothing is flushed by range (bfloat16, float32). The train step is unchanged: off
costs nothing, on one probe (two passes) per interval. More: docs/guides/numerics-statistics.md.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import ml_dtypes
import numpy as np
import tensorflow as tf
from absl import logging

from trainer.errors import message_line
from trainer.insight import hooks
from trainer.nn import paths
from trainer.data import checks
from trainer.step import user_code
from trainer.step.eager_then_compiled import EagerThenCompiled
from trainer.step.forward_state import forward_state_kept
from trainer.step.loss_scale import overwritten


def smallest_normal(dtype) -> float:
  return float(ml_dtypes.finfo(tf.as_dtype(dtype).as_numpy_dtype).tiny)  # numpy lacks bfloat16


def largest(dtype) -> float:
  return float(ml_dtypes.finfo(tf.as_dtype(dtype).as_numpy_dtype).max)


def has_float32_range(dtype) -> bool:
  """Whether `dtype` has float32's exponent range (float32, bfloat16): no gradient a float32
  computation keeps is flushed by range in it."""
  return smallest_normal(dtype) <= smallest_normal(tf.float32)


def leaf_layers(model) -> list:
  """The model's layers that hold no other layers, in order."""
  return [
    layer
    for layer in model._flatten_layers(include_self=False)  # pylint: disable=protected-access
    if not list(layer._flatten_layers(include_self=False))
  ]  # pylint: disable=protected-access


@contextlib.contextmanager
def recording_outputs(layers, record):
  """While active, each layer's `call` (or `quantized_call`) also calls `record(layer, output)`.
  Used while a tf.function traces, so the recorded tensors are the graph's."""

  def hook(layer):
    def wrap(original):
      def call(*args, **kwargs):
        output = original(*args, **kwargs)
        record(layer, output)
        return output

      return call

    return wrap

  with contextlib.ExitStack() as stack:
    for layer in layers:
      for method in hooks.call_methods(layer):
        stack.enter_context(hooks.hooked(layer, method, hook(layer)))
    yield


# Per variable, the statistics the compiled probe returns (one row each).
GRAD_MAX, FLUSHED, SUBNORMAL, ZERO, NONFINITE, COUNT = range(6)
FRACTIONS = {
  'grad_flushed': FLUSHED,
  'grad_subnormal': SUBNORMAL,
  'grad_zero': ZERO,
  'grad_nonfinite': NONFINITE,
}


def is_float8(layer) -> bool:
  """Whether `layer` computes through a precision.float8 current-scaling recipe (its float32
  reference is the same layer without float8: hooks.float32)."""
  return bool(getattr(layer, 'float8_recipe', None))


def gradient_counts(target, reference, tiny: float, scale, float8: bool = False) -> tf.Tensor:
  """[6] float32 for one gradient: the largest finite |target| / scale, then the counts of
  flushed, subnormal, zero and non-finite elements and the element count (module docstring).
  `target`: the gradient computed in the compute dtype at loss scale `scale` (still scaled);
  `reference`: the same gradient in float32, unscaled. `float8`: a precision.float8 recipe's
  layer (every zero that is non-zero in float32 is flushed: module docstring)."""
  magnitude = tf.abs(tf.cast(target, tf.float32))
  finite = tf.math.is_finite(magnitude)
  reference = tf.abs(tf.cast(reference, tf.float32))
  zero32 = tf.equal(reference, 0.0)
  zero = tf.equal(magnitude, 0.0)
  in_range = reference * scale >= tiny  # a zero there is rounding, not range
  if float8:
    in_range = tf.zeros_like(zero)

  def count(mask):
    return tf.reduce_sum(tf.cast(mask, tf.float32))

  return tf.stack(
    [
      tf.reduce_max(tf.where(finite, magnitude, 0.0)) / scale,
      count(tf.logical_and(zero, tf.logical_not(tf.logical_or(zero32, in_range)))),
      count(tf.logical_and(tf.logical_and(finite, magnitude < tiny), tf.logical_not(zero))),
      count(zero32),
      count(tf.logical_not(finite)),
      tf.cast(tf.size(magnitude), tf.float32),
    ]
  )


def output_counts(layer, values, reference) -> tf.Tensor:
  """[4] float32 for one layer's forward outputs `values` (compute dtype): the largest |output|,
  the counts of flushed and subnormal elements (as for gradients, against the float32 pass's
  outputs `reference`, None without one) and the element count. Outputs of another shape than
  the reference's (a layer whose float32 call differs) get no flushed count. A precision.float8
  recipe's layer: every zero that is non-zero in float32 is flushed (gradient_counts)."""
  tiny = smallest_normal(layer.compute_dtype)
  floor = math.inf if is_float8(layer) else tiny
  largest_out, flushed, subnormal, count = [], [], [], []
  reference = reference if reference is not None else [None] * len(values)
  for o, r in zip(values, reference):
    o = tf.abs(tf.cast(o, tf.float32))
    largest_out.append(tf.reduce_max(o))
    subnormal.append(tf.reduce_sum(tf.cast(tf.logical_and(o > 0, o < tiny), tf.float32)))
    count.append(tf.cast(tf.size(o), tf.float32))
    if r is None or not o.shape.is_compatible_with(r.shape):
      flushed.append(tf.constant(0.0))
      continue
    r = tf.abs(tf.cast(r, tf.float32))
    lost = tf.logical_and(tf.equal(o, 0.0), tf.logical_and(r > 0, r < floor))
    flushed.append(tf.reduce_sum(tf.cast(lost, tf.float32)))
  return tf.stack(
    [tf.reduce_max(tf.stack(largest_out)), tf.add_n(flushed), tf.add_n(subnormal), tf.add_n(count)]
  )


# Eager until compiling would have been cheaper at the shapes measured (the slowest break-even
# and a large model's slow eager pass: docs/references.md, "Start-up", and
# docs/results/eager_or_compiled.md).
EAGER_CALLS, EAGER_SECONDS = 8, 2.0


class Probe:
  """The statistics pass for one trainer (built on first use; eager for its first calls, then
  compiled: trainer/step/eager_then_compiled.py)."""

  def __init__(self, trainer, batch=None):
    self.trainer = trainer
    model = trainer.model
    self.layers = leaf_layers(model)
    self.paths = paths.layer_paths(model)  # what every statistic and tag names a layer by
    variables = list(trainer.train_step.variables)
    # Float8 layers' scale and amax-history variables: their "gradients" are new values.
    self.variables = [v for v, new_value in zip(variables, overwritten(variables)) if not new_value]
    owner: dict[int, Any] = {}  # id(variable) -> its layer
    for layer in self.layers:
      for v in layer.trainable_weights:
        owner.setdefault(id(getattr(v, 'value', v)), layer)
    self.owners = [owner.get(id(getattr(v, 'value', v))) for v in self.variables]
    # A reference pass is needed only with a compute dtype other than float32 or a float8 layer.
    self.low_precision = sorted(
      {layer.compute_dtype for layer in self.layers if layer.compute_dtype != 'float32'}
    )
    self.needs_reference = bool(self.low_precision) or any(
      getattr(layer, 'quantization_mode', None) or is_float8(layer) for layer in self.layers
    )
    # Eager, then compiled (trainer/step/eager_then_compiled.py); autograph=False: user_code.py.
    self._fn = EagerThenCompiled(
      self._stats, eager_calls=EAGER_CALLS, eager_seconds=EAGER_SECONDS, autograph=False
    )
    self._batch = batch  # measured by default; None: the first eval batch, read on first use

  def _gradients(self, share, scaled: bool, record=None):
    t = self.trainer
    with contextlib.ExitStack() as stack:
      if record is not None:
        stack.enter_context(recording_outputs(self.layers, record))
      tape = stack.enter_context(tf.GradientTape())
      per_example, _ = user_code.converted(t.compute_loss)(share, training=True)
      loss = t.train_step.share_loss(per_example)
      if scaled:
        loss = t.loss_scaler.scale_loss(loss)
    return tape.gradient(loss, self.variables)

  def _stats(self, batch):
    t = self.trainer
    outputs: dict[str, tuple] = {}
    outputs32: dict[str, tuple] = {}

    def recorder(into):
      def record(layer, output):
        values = [o for o in tf.nest.flatten(output) if hasattr(o, 'dtype') and o.dtype.is_floating]
        if values:
          into[self.name(layer)] = (layer, values)  # a layer called twice: its last call

      return record

    # One replica's (micro-)batch with the step's own loss: the gradients the step computes.
    share = t.train_step.replica_share(batch)
    with forward_state_kept(t.model):  # the reference pass starts from the same state
      grads = self._gradients(share, scaled=True, record=recorder(outputs))
    if self.needs_reference:
      with forward_state_kept(t.model), hooks.float32(t.model):
        reference = self._gradients(share, scaled=False, record=recorder(outputs32))
    else:
      reference = grads
    scale = tf.cast(t.loss_scaler.scale, tf.float32) if t.loss_scaler.mode != 'none' else 1.0
    rows = []
    for g, r, layer in zip(grads, reference, self.owners):
      if g is None:
        rows.append(tf.zeros([6]))
        continue
      g = tf.convert_to_tensor(g)
      r = tf.zeros_like(g) if r is None else tf.convert_to_tensor(r)
      tiny = smallest_normal(layer.compute_dtype if layer is not None else tf.float32)
      rows.append(gradient_counts(g, r, tiny, scale, is_float8(layer)))
    return tf.stack(rows), {
      name: output_counts(layer, values, outputs32.get(name, (None, None))[1])
      for name, (layer, values) in outputs.items()
    }

  def name(self, layer) -> str:
    """The layer's path (trainer/nn/paths.py); Keras's own for a layer outside the model."""
    return self.paths.get(id(layer)) or getattr(layer, 'path', None) or layer.name

  def next_batch(self):
    """The first eval batch, every time: measurements compare the same examples, and the train
    pipeline is never read (a shuffled dataset's iterators share one seed generator: another one
    would change the order training sees, and resumes would differ; test_numerics.py)."""
    if self._batch is None:
      self._batch = checks.first_eval_batch(self.trainer.datasets)
    return self._batch

  def measure(self, batch=None) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """({layer: {statistic: value}}, {'grad_flushed', 'grad_subnormal', 'grad_zero',
    'grad_nonfinite': fraction of all gradient elements}) for one batch (default: the probe's
    next train batch)."""
    rows, output_max = self._fn(self.next_batch() if batch is None else batch)
    stats: dict[str, dict[str, float]] = {}
    sums: dict[str, np.ndarray] = {}
    for row, layer in zip(rows.numpy().astype(np.float64), self.owners):
      name = self.name(layer) if layer is not None else '?'
      before = sums.get(name, np.zeros(6))
      sums[name] = np.concatenate([[max(before[GRAD_MAX], row[GRAD_MAX])], before[1:] + row[1:]])
    for name, row in sums.items():
      if row[COUNT]:
        stats[name] = {
          'grad_max': float(row[GRAD_MAX]),
          **{k: float(row[i] / row[COUNT]) for k, i in FRACTIONS.items()},
        }
    total = sum(sums.values(), np.zeros(6))
    overall = {
      k: float(total[i] / total[COUNT]) if total[COUNT] else 0.0 for k, i in FRACTIONS.items()
    }
    dtypes = {self.name(layer): layer.compute_dtype for layer in self.layers}
    for name, row in output_max.items():
      value, flushed, subnormal, count = (float(x) for x in row.numpy())
      entry = stats.setdefault(name, {})
      entry['output_max'] = value
      # 1 when the output held inf or NaN: output_max and headroom_bits are not finite then, and
      # TensorBoard gets no scalar for them (non-finite scalars are left out), this one instead.
      entry['output_nonfinite'] = float(not math.isfinite(value))
      if count:
        entry['output_flushed'], entry['output_subnormal'] = flushed / count, subnormal / count
      entry['headroom_bits'] = (
        math.log2(largest(dtypes[name]) / value)
        if 0 < value < math.inf
        else (math.inf if value == 0 else -math.inf)
      )
    return stats, overall


def summary_line(step: int, stats: dict, overall: dict, *, scale: float | None, dtypes) -> str:
  """One console line: what the compute dtypes lose of the gradients (flushed to zero, overall
  and the worst layer; subnormal; exact zeros for context) at `scale` (None: the loss is not
  scaled), non-finite gradients, and the least headroom. `dtypes`: the low-precision compute
  dtypes of the model's layers (empty: float32 throughout)."""
  at = f' at loss scale {scale:g}' if scale is not None else ' (loss not scaled)'
  zero = f'exact zeros {100 * overall["grad_zero"]:.1f} % (zero in float32 too)'
  ranged = [d for d in dtypes if not has_float32_range(d)]
  if not ranged and not overall['grad_flushed']:
    what = ', '.join(dtypes) or 'float32'
    parts = [
      f'numerics at step {step}: gradient range is not the issue under {what} '
      f"(float32's exponent range: nothing flushed to zero); {zero}"
    ]
  else:
    parts = [
      f'numerics at step {step}: gradients flushed to zero {_pct(overall["grad_flushed"])}'
      f'{at}, subnormal {_pct(overall["grad_subnormal"])}; {zero}'
    ]
    flushed = [(v['grad_flushed'], k) for k, v in stats.items() if 'grad_flushed' in v]
    if flushed and max(flushed)[0] > 0:
      worst, name = max(flushed)
      parts.append(f'most flushed {name} {_pct(worst)}')
  # In the order of `stats` (the model's variables, then layers without any): among equals an
  # earlier layer, where a non-finite value usually starts, comes first.
  bad = sorted(
    (k for k, v in stats.items() if v.get('grad_nonfinite', 0) > 0),
    key=lambda k: -stats[k]['grad_nonfinite'],
  )  # stable: ties keep the order
  if bad:
    parts.append('non-finite gradients in ' + _first(bad))
  room = [(v['headroom_bits'], k) for k, v in stats.items() if 'headroom_bits' in v]
  if inf := [k for bits, k in room if bits == -math.inf]:
    parts.append('non-finite outputs in ' + _first(inf))
  if room := [(bits, k) for bits, k in room if bits > -math.inf]:
    bits, name = min(room, key=lambda x: x[0])
    parts.append(f'least headroom {name} ({bits:.1f} doublings to overflow)')
  return '; '.join(parts)


def _first(names: list[str], shown: int = 3) -> str:
  return ', '.join(names[:shown]) + (
    f' and {len(names) - shown} more' if len(names) > shown else ''
  )


def _pct(fraction: float) -> str:
  """A percentage with enough digits that a small non-zero fraction does not read as 0."""
  value = 100 * fraction
  return f'{value:.1f} %' if value >= 1 or value == 0 else f'{value:.2g} %'


class Recorder:
  """The trainer's side: when to measure, and where the numbers go."""

  def __init__(self, trainer, every: int, write_scalars=None, batch=None):
    self.trainer, self.every = trainer, int(every)
    self.batch = batch  # what the probe measures (None: it reads the first eval batch)
    self.write_scalars = write_scalars  # (prefix, {name: value}, step); None: no TensorBoard
    self.probe: Probe | None = None
    self.last: int | None = None

  def start(self, step: int) -> None:
    """The run (or resumed run) starts at `step`: the first log step measures."""
    self.last = None

  def due(self, step: int) -> bool:
    """At a log step: the first one of the run, then whether a multiple of `every` was passed
    since the last measurement (so any run with a log step shows the line at least once)."""
    if self.every <= 0:
      return False
    if self.last is None or step // self.every > self.last // self.every:
      self.last = step
      return True
    return False

  def record(self, step: int) -> dict:
    """Measures, writes TensorBoard scalars numerics/<layer>/<statistic> and
    numerics/gradient_{flushed,subnormal,zero,nonfinite}, returns the stats and the line."""
    if self.probe is None:
      self.probe = Probe(self.trainer, self.batch)
    try:
      stats, overall = self.probe.measure()
    except Exception as e:  # pylint: disable=broad-except  (diagnostics never end a run)
      self.every = 0
      line = (
        f'numerics at step {step}: the statistics probe failed ({type(e).__name__}: '
        f'{message_line(e, last=True)[:200]}); numerics.every is off for this run'
      )
      logging.warning(line)
      return {'stats': {}, 'line': line}
    scaler = self.trainer.loss_scaler
    scale = float(scaler.scale.numpy()) if scaler.mode != 'none' else None
    line = summary_line(step, stats, overall, scale=scale, dtypes=self.probe.low_precision)
    scalars = {
      f'{layer}/{k}': v
      for layer, values in stats.items()
      for k, v in values.items()
      if math.isfinite(v)
    }
    scalars.update({'gradient_' + k[len('grad_') :]: v for k, v in overall.items()})
    if self.write_scalars is not None:
      self.write_scalars('numerics', scalars, step)
    return {'stats': stats, 'overall': overall, 'line': line}


class NumericsLine:
  """The built-in action that logs the numerics line at the log steps `Recorder.due` picks."""

  def __init__(self, recorder: Recorder):
    self.recorder = recorder

  def __call__(self, event) -> None:
    if event.kind == 'log' and self.recorder.due(event.step):
      logging.info(self.recorder.record(event.step)['line'])
