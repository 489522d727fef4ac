"""The precision advisor: which layers should stay float32 under a mixed policy, measured.

`advise(trainer_class, config, workdir, steps=N)` builds the model twice, in the config's policy
(the target) and in float32, with the same initial weights, and runs N calibration steps on the
same training batches, eagerly, every layer's call hooked (trainer/insight/forensics.py). The
float32 model's gradients update it and its weights are copied into the target, so both see the
same weights at each step (the comparison measures precision, not two diverging runs). Per layer
(nested ones included) it records: the largest |output| and |input| of the float32 run and their
headroom to the target dtype's largest finite value in powers of two (negative: does not fit);
the fraction of the target's outputs that are non-finite; the target output's relative error
against float32 (L2 norm of the difference over that of the float32 output, averaged over the
steps); and gradient underflow as the numerics probe defines it (trainer/insight/numerics.py:
flushed at the loss scale the run starts with, subnormal, zero in float32 too) and non-finite
gradients. These are the whole batch's mean loss's gradients: with several replicas or gradient
accumulation a step's own sum fewer examples and underflow more (`numerics.every` measures one
replica's share).

A layer is suggested for `precision.float32_layers` when its float32 output or input comes
within `HEADROOM_BITS` powers of two of the dtype's maximum (an input must fit too: a float32
layer's large output is cast down again by the low-precision layer that consumes it), or when it
made a non-finite output from finite inputs where float32 stayed finite: a value inside it
overflowed (an exp in a hand-written softmax) although its output fits. Output error and
underflow are reported, not acted on: the remedy for underflow is the loss scale. A layer with
non-finite outputs or gradients never "fits": when headroom names no layer but something was
non-finite, the advice says so instead of suggesting nothing. Layers are named by their path in
the model (trainer/nn/paths.py); the table marks every layer so condemned, and the suggestion
leaves out those inside another (`Advice.suggested`). `launch.py --advise` prints the
report and writes <workdir>/advice.md; with `--advise_validate_steps=N` it then trains N steps
as configured and N with the suggestion (`validate`) and prints each run's skipped steps and
flushed gradient fraction.
"""

from __future__ import annotations

import dataclasses
import math
import os

import keras
import ml_collections
import tensorflow as tf

from trainer.errors import message_line
from trainer.insight import files, forensics
from trainer.nn import paths

HEADROOM_BITS = 2  # keep values at least 2**HEADROOM_BITS below the dtype's maximum
LOW = ('float16', 'bfloat16')


@dataclasses.dataclass
class LayerStats:
  name: str
  cls: str
  compute_dtype: str
  max_out: float = 0.0  # float32 run
  max_in: float = 0.0
  nonfinite: int = 0  # target outputs
  overflowed: int = 0  # calls whose target output was non-finite from finite inputs, float32's not
  outputs: int = 0
  rel_error_sum: float = 0.0
  rel_error_n: int = 0
  grad_flushed: int = 0  # zero in the target, non-zero in float32
  grad_subnormal: int = 0  # target: non-zero, below the smallest normal
  grad_zero32: int = 0  # float32: exactly zero
  grad_total: int = 0
  grad_nonfinite: int = 0  # target: non-finite gradient elements (underflow is moot then)

  def headroom(self, value: float) -> float:
    limit = _finfo(self.compute_dtype)[0]
    return math.log2(limit / value) if limit is not None and value > 0 else math.inf

  @property
  def rel_error(self) -> float:
    return self.rel_error_sum / self.rel_error_n if self.rel_error_n else math.nan


def _finfo(dtype: str):
  """(largest finite, smallest normal) of a float dtype name; (None, None) otherwise."""
  try:
    info = tf.experimental.numpy.finfo(dtype)
    return float(info.max), float(info.tiny)
  except (TypeError, ValueError):
    return None, None


@dataclasses.dataclass
class Advice:
  policy: str
  steps: int
  loss_scale: float
  layers: list[LayerStats]
  condemned: list[str]  # the layers (paths) the numbers put in float32
  scale_mode: str = 'dynamic'  # the LossScaler's: 'dynamic', 'static' or 'none'

  @property
  def nonfinite_layers(self) -> list[str]:
    """The layers whose target outputs or weight gradients had a non-finite element."""
    return [s.name for s in self.layers if s.nonfinite or s.grad_nonfinite]

  @property
  def suggested(self) -> list[str]:
    """The condemned layers not inside another one: a float32_layers entry reaches the layers
    inside it, and Keras refuses two entries of which one holds the other."""
    return [
      p for p in self.condemned if not any(p.startswith(outer + '/') for outer in self.condemned)
    ]

  @property
  def suggested_value(self) -> str:
    return ','.join(self.suggested)

  def markdown(self) -> str:
    lines = [
      f'# precision advice: {self.policy}, {self.steps} calibration steps, loss scale '
      f'{self.loss_scale:g}',
      '',
      '| layer | class | compute | max abs out (f32) | headroom out | max abs in (f32) | '
      'headroom in | non-finite out | rel. error vs f32 | grad flushed | grad subnormal | '
      'grad zero (f32) |',
      '| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |',
    ]

    def pct(a, b):
      if not b:
        return '-'
      return '< 0.1 %' if 0 < 100.0 * a / b < 0.05 else f'{100.0 * a / b:.1f} %'

    for s in self.layers:
      underflow = (
        f'non-finite ({pct(s.grad_nonfinite, s.grad_total)}) | -'
        if s.grad_nonfinite
        else f'{pct(s.grad_flushed, s.grad_total)} | {pct(s.grad_subnormal, s.grad_total)}'
      )
      lines.append(
        f'| {s.name}{" **float32**" if s.name in self.condemned else ""} | {s.cls} | '
        f'{s.compute_dtype} | {s.max_out:.3g} | {_bits(s.headroom(s.max_out))} | '
        f'{s.max_in:.3g} | {_bits(s.headroom(s.max_in))} | {pct(s.nonfinite, s.outputs)} | '
        f'{s.rel_error:.2g} | {underflow} | '
        f'{pct(s.grad_zero32, s.grad_total)} |'
      )
    lines.append('')
    lines.append(
      f'Headroom: powers of two between the largest |value| of the float32 run and '
      f"the compute dtype's largest finite value (negative: out of range); a layer "
      f'within {HEADROOM_BITS} is marked float32 (the suggestion leaves out those inside '
      'another marked layer: an entry reaches them). Gradients are the weight '
      'gradients at the loss scale above: flushed = zero in the compute dtype, '
      'non-zero but below its smallest normal in float32 (lost to range); zero (f32) '
      '= zero in float32 too.'
    )
    lines.append('')
    # Non-finite from finite inputs while the float32 output fits the dtype: inside the layer.
    inside = [s.name for s in self.layers if s.overflowed and s.headroom(s.max_out) >= 0]
    if inside:
      lines.append(
        f'Overflowed inside: {", ".join(inside)} (a non-finite output from finite '
        'inputs, where float32 stayed finite: a value inside the layer went past the '
        'range although its output fits; --mode=diagnose names the op).'
      )
      lines.append('')
    if self.suggested:
      lines.append(
        f"Suggested: `precision.float32_layers = '{self.suggested_value}'` "
        f'(`--config.precision.float32_layers={self.suggested_value}`)'
      )
    elif not self.policy.startswith('mixed_'):
      lines.append(f'Nothing to advise: the policy {self.policy} computes in float32.')
    elif self.nonfinite_layers:
      names, n = ', '.join(self.nonfinite_layers[:3]), len(self.nonfinite_layers)
      forward = any(s.nonfinite for s in self.layers)
      lines.append(
        f'Suggested: nothing by headroom, but not every layer fits {self.policy}: '
        f'{n} layer{"s" if n != 1 else ""} had non-finite outputs or gradients '
        f'(first: {names}) at loss scale {self.loss_scale:g}. '
        + (
          'Some outputs were non-finite, a forward problem: replay a skipped step '
          '(--mode=diagnose) to name the layer and op.'
          if forward
          else 'Only gradients were non-finite, a backward overflow: '
          + {
            'static': 'lower precision.loss_scale (static), or ',
            'none': 'the loss is not scaled, so they overflow by themselves: ',
          }.get(self.scale_mode, 'lower precision.initial_scale, or ')
          + 'replay a skipped step (--mode=diagnose) to name the layer.'
        )
      )
    else:
      lines.append(f"Suggested: `precision.float32_layers = ''` (every layer fits {self.policy}).")
    return '\n'.join(lines) + '\n'


def _bits(value: float) -> str:
  return 'inf' if math.isinf(value) else f'{value:+.1f}'


def _observe(model, compute_loss, batch, scale):
  """One eager forward and backward pass with the layers hooked: the calls, the scaled weight
  gradients {id(variable): gradient}, and the unscaled gradients in model order."""
  with tf.GradientTape() as tape:  # one gradient call (a persistent tape fails on float8)
    with forensics.recording(model, tape) as calls:
      per_example, _ = compute_loss(batch, training=True)
    loss = tf.reduce_mean(tf.cast(per_example, tf.float32))
    if model.losses:
      loss += tf.add_n([tf.cast(l, tf.float32) for l in model.losses])
    scaled = loss * scale
  variables = model.trainable_variables
  # An embedding's gradient comes as IndexedSlices: dense here, for the element counts.
  grads = [None if g is None else tf.convert_to_tensor(g) for g in tape.gradient(scaled, variables)]
  del tape
  by_id = {id(v): g for v, g in zip(variables, grads)}
  unscaled = [None if g is None else tf.cast(g, tf.float32) / scale for g in grads]
  return calls, by_id, unscaled


def _float_outputs(call):
  return [t for t in tf.nest.flatten(call.outputs) if forensics.is_float(t)]


def advise(
  trainer_class, config: ml_collections.ConfigDict, workdir: str, *, steps: int = 10
) -> Advice:
  """Builds the config's model in its policy and in float32 and runs `steps` calibration steps
  (see the module docstring). The target is built first, so its layer names are the ones a
  training run of this config gets."""
  target = trainer_class(config, workdir)
  policy = target.policy
  reference_config = ml_collections.ConfigDict(config.to_dict())
  reference_config.precision.policy = 'float32'
  reference_config.precision.float32_layers = ''
  reference = trainer_class(reference_config, workdir)
  keras.mixed_precision.set_global_policy(policy)  # as the target's run would leave it
  reference.model.set_weights(target.model.get_weights())
  scale = float(target.loss_scaler.scale.numpy())

  stats: dict[int, LayerStats] = {}
  names = paths.layer_paths(target.model)  # the target is built first: a training run's names
  batches = iter(target.datasets.train)
  for _ in range(steps):
    batch = next(batches)
    calls_t, grads_t, _ = _observe(target.model, target.compute_loss, batch, scale)
    calls_r, grads_r, unscaled_r = _observe(reference.model, reference.compute_loss, batch, scale)
    layers_r = forensics.sublayers(reference.model)
    layers_t = forensics.sublayers(target.model)
    to_target = {id(r): t for r, t in zip(layers_r, layers_t)}
    overflowed: set[int] = set()  # layers non-finite from finite inputs in this pass
    for ct, cr in zip(calls_t, calls_r):
      layer = ct.layer
      s = stats.setdefault(
        id(layer),
        LayerStats(names.get(id(layer), layer.name), type(layer).__name__, layer.compute_dtype),
      )
      assert to_target.get(id(cr.layer)) is layer, 'the two builds called different layers'
      s.max_out = max(s.max_out, forensics.max_abs(cr.outputs))
      s.max_in = max(s.max_in, forensics.max_abs((cr.args, cr.kwargs)))
      if (
        forensics.nonfinite(ct.outputs)
        and not forensics.nonfinite((ct.args, ct.kwargs))
        and not forensics.nonfinite(cr.outputs)
      ):
        # A layer containing one that overflowed in this pass is not at fault itself (its calls
        # complete after those of the layers inside it).
        if not any(id(inner) in overflowed for inner in forensics.sublayers(layer)):
          s.overflowed += 1
        overflowed.add(id(layer))
      for yt, yr in zip(_float_outputs(ct), _float_outputs(cr)):
        yt32, yr32 = tf.cast(yt, tf.float32), tf.cast(yr, tf.float32)
        finite = tf.math.is_finite(yt32)
        s.nonfinite += int(tf.size(yt32) - tf.math.count_nonzero(finite, dtype=tf.int32))
        s.outputs += int(tf.size(yt32))
        norm = float(tf.norm(yr32))
        if bool(tf.reduce_all(finite)) and norm > 0:
          s.rel_error_sum += float(tf.norm(yt32 - yr32)) / norm
          s.rel_error_n += 1
      if forensics.sublayers(layer):
        continue  # a container: its weights are counted with the layers inside it
      tiny = _finfo(s.compute_dtype)[1] or 0.0
      for vt, vr in zip(forensics.trainable(layer), forensics.trainable(cr.layer)):
        gt, gr = grads_t.get(id(vt)), grads_r.get(id(vr))
        if gt is None or gr is None:
          continue
        gt = tf.abs(tf.cast(gt, tf.float32))
        gr = tf.abs(tf.cast(gr, tf.float32))  # float32, at the same scale
        zero32 = tf.equal(gr, 0.0)
        lost = tf.logical_and(tf.logical_not(zero32), gr < tiny)  # zero there: range
        s.grad_flushed += int(tf.math.count_nonzero(tf.logical_and(tf.equal(gt, 0.0), lost)))
        s.grad_subnormal += int(tf.math.count_nonzero(tf.logical_and(gt > 0, gt < tiny)))
        s.grad_nonfinite += int(tf.size(gt)) - int(tf.math.count_nonzero(tf.math.is_finite(gt)))
        s.grad_zero32 += int(tf.math.count_nonzero(zero32))
        s.grad_total += int(tf.size(gt))
    reference.optimizer.apply_gradients(
      [(g, v) for g, v in zip(unscaled_r, reference.model.trainable_variables) if g is not None]
    )
    target.model.set_weights(reference.model.get_weights())

  layers = list(stats.values())
  condemned = [
    s.name
    for s in layers
    if s.compute_dtype in LOW
    and (min(s.headroom(s.max_out), s.headroom(s.max_in)) < HEADROOM_BITS or s.overflowed)
  ]
  return Advice(
    policy, steps, scale, layers, list(dict.fromkeys(condemned)), scale_mode=target.loss_scaler.mode
  )


def validate(
  trainer_class, config: ml_collections.ConfigDict, workdir: str, suggested: str, *, steps: int
) -> list[dict]:
  """Trains `steps` steps as configured and `steps` with precision.float32_layers=`suggested`
  (each from the same initial weights, in <workdir>/advise-validate/<run>/; no numerics,
  forensics, collapse guard or divergence stop), then measures each run's gradients with the
  numerics probe (trainer/insight/numerics.py) at its final weights and loss scale. Returns per
  run {'run', 'float32_layers', 'skipped', 'flushed', 'subnormal', 'error'}."""
  from trainer.insight import numerics  # pylint: disable=import-outside-toplevel

  runs = [('as configured', config.precision.float32_layers)]
  if suggested and suggested != config.precision.float32_layers:
    runs.append(('with the suggestion', suggested))
  results = []
  for name, layers in runs:
    c = ml_collections.ConfigDict(config.to_dict())
    c.precision.float32_layers = layers
    c.precision.max_consecutive_skips = 0
    c.train.steps = steps
    c.train.steps_per_loop = c.train.log_every = c.train.checkpoint_every = steps
    c.train.eval_every = 0
    c.numerics.every = c.numerics.forensics_first = c.numerics.forensics_every = 0
    c.numerics.divergence_stop = False
    trainer = trainer_class(c, os.path.join(workdir, 'advise-validate', name.replace(' ', '-')))
    error = ''
    try:
      trainer.train()
    except Exception as e:  # pylint: disable=broad-except  (a non-finite final eval, say)
      # The error's first clause (its advice, after '; ', is for a run of its own).
      first = message_line(e).split('; ')[0]
      error = f'{type(e).__name__}: {first[:200]}'
    _, overall = numerics.Probe(trainer).measure()
    results.append(
      {
        'run': name,
        'float32_layers': layers,
        'skipped': int(trainer.train_step.skipped_steps.numpy()),
        'flushed': overall['grad_flushed'],
        'subnormal': overall['grad_subnormal'],
        'nonfinite': overall['grad_nonfinite'],
        'error': error,
      }
    )
  return results


def validation_lines(results: list[dict], steps: int) -> list[str]:
  lines = [f'Validation: {steps} training steps each, gradients measured at the end:', '']
  for r in results:
    layers = f"float32_layers='{r['float32_layers']}'"
    lines.append(
      f'- {r["run"]} ({layers}): skipped {r["skipped"]} of {steps} steps; gradients '
      f'flushed to zero {100 * r["flushed"]:.3g} %, subnormal '
      f'{100 * r["subnormal"]:.3g} %, non-finite {100 * r["nonfinite"]:.3g} %'
      + (f'; ended with {r["error"]}' if r['error'] else '')
    )
  return lines


def report(trainer_class, config, workdir: str, *, steps: int = 10, validate_steps: int = 0) -> str:
  """`advise` as markdown, also written to <workdir>/advice.md; with `validate_steps`, the
  suggestion's validation (`validate`) appended."""
  advice = advise(trainer_class, config, workdir, steps=steps)
  text = advice.markdown()
  if validate_steps > 0:
    results = validate(trainer_class, config, workdir, advice.suggested_value, steps=validate_steps)
    text += '\n' + '\n'.join(validation_lines(results, validate_steps)) + '\n'
  files.folder(os.path.dirname(os.path.abspath(workdir)), workdir, '--advise')
  files.write(os.path.join(workdir, 'advice.md'), text, '--advise')  # never through a link
  return text
