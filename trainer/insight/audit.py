"""A dtype audit of a built Keras model: what each layer computes in, stores and outputs.

`audit(model)` returns one `Row` per layer (nested models and the layers a layer holds, such as
attention's projections and softmax, are walked; a row counts every variable inside its layer)
and the `Hazard`s found:
  * low-precision logits: a float16/bfloat16 model output reaches the loss (whose softmax and
    log would run in float16: overflow, or bfloat16: 8-bit precision);
  * low-precision softmax: a layer applying softmax computes in float16/bfloat16;
  * low-precision variables: a layer stores float16/bfloat16 weights, so the optimizer's updates
    are rounded away (use a mixed_* policy: float32 variables, low-precision compute);
  * float token ids: an Embedding gets float16/bfloat16 ids (a subclassed model casts its float
    inputs to the compute dtype), so ids above 256 (bfloat16) or 2048 (float16) become others;
  * not autocast: under a mixed policy a layer outputs float32 although its compute dtype is low
    precision (it creates or reads weights Keras cannot autocast, e.g. a raw tf.Variable, or has
    `autocast=False` on its weights), so it silently computes in float32.
`markdown(...)` renders the table and the hazards; `python launch.py --config=... --audit` prints
it and writes it to <workdir>/audit.md.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple

import keras
import tensorflow as tf
from absl import logging

from trainer.insight import files, hooks

LOW = ('float16', 'bfloat16')


class Row(NamedTuple):
  name: str
  cls: str
  compute_dtype: str
  variable_dtype: str  # the dtypes of the layer's own variables, '-' when it has none
  output_dtype: str  # '?' when the model is not symbolic (a subclassed model)
  params: int


class Hazard(NamedTuple):
  layer: str
  kind: str
  message: str


def _children(layer) -> list:
  """The layers directly inside `layer`: a model's `layers`; for any other layer the sublayers
  Keras tracks as its attributes (MultiHeadAttention's query/key/value/softmax, a custom
  layer's Dense), which `layers` does not list."""
  if isinstance(layer, keras.Model) or getattr(layer, 'layers', None):
    return list(layer.layers)
  return list(getattr(layer, '_layers', None) or [])  # pylint: disable=protected-access


def _layers(model, prefix=''):
  """(path, layer) for every layer inside `model`, depth first, each once."""
  seen = set()

  def walk(parent, prefix):
    for layer in _children(parent):
      if id(layer) in seen:
        continue
      seen.add(id(layer))
      yield prefix + layer.name, layer
      yield from walk(layer, prefix + layer.name + '/')

  yield from walk(model, prefix)


def _dtypes(structure) -> list[str]:
  """The dtypes of a structure's tensors (None and other non-tensor leaves left out)."""
  return [
    keras.backend.standardize_dtype(t.dtype)
    for t in keras.tree.flatten(structure)
    if hasattr(t, 'dtype')
  ]


def _output_dtype(layer, seen) -> str:
  outputs = seen.get(id(layer))
  if outputs is None:
    try:
      outputs = layer.output
    except (AttributeError, ValueError):
      return '?'
  return ','.join(sorted(set(_dtypes(outputs)))) or '?'


def _input_dtype(layer, inputs) -> str | None:
  """The dtype of the layer's first input: as recorded in `inputs`, or Keras's symbolic one."""
  try:
    found = _dtypes(inputs[id(layer)] if id(layer) in inputs else layer.input)
  except (AttributeError, ValueError):
    return None
  return found[0] if found else None


def _own_variables(layer):
  nested = {id(v) for sub in _children(layer) for v in sub.weights}
  return [v for v in layer.weights if id(v) not in nested]


def _all_variables(layer):
  """The layer's variables and those of the layers inside it, each once."""
  return list({id(v): v for v in layer.weights}.values())


def _applies_softmax(layer) -> bool:
  if isinstance(layer, keras.layers.Softmax):
    return True
  activation = getattr(layer, 'activation', None)
  return activation is keras.activations.softmax or getattr(activation, '__name__', '') == 'softmax'


def audit(
  model: keras.Model, policy: str | None = None, run=None
) -> tuple[list[Row], list[Hazard]]:
  """Rows for every layer of a built model and the hazards found. `policy`: the global policy
  name the model was built under (default: the current global policy). A subclassed model
  records no layer outputs: `run`, a callable running its forward pass (compute_loss on a
  batch), is then called once to see every layer's output dtype and the model's."""
  policy = policy or keras.mixed_precision.global_policy().name
  mixed = policy.startswith('mixed_')
  rows, hazards = [], []
  seen: dict = {}  # id(layer): outputs of its first call in `run`
  inputs: dict = {}  # id(layer): the first argument of that call
  layers = dict(_layers(model))
  # Keras records the outputs of a functional model's own layers, not those of the layers
  # nested in them (attention's softmax) nor any of a subclassed model's: `run` sees them.
  if run is not None and (
    not getattr(model, 'outputs', None) or any(_output_dtype(l, {}) == '?' for l in layers.values())
  ):
    try:
      with hooks.recording(model, None, include_self=True) as calls:
        run()
    except Exception as e:  # pylint: disable=broad-except  (the audit never ends a run)
      # Keras wraps a layer's error: 'Exception encountered when calling X.call().', the
      # message in bold (ANSI codes), then the arguments.
      lines = [re.sub(r'\x1b\[[0-9;]*m', '', l).strip() for l in str(e).splitlines()]
      logging.warning(
        "dtype audit: the forward pass of %s failed (%s: %s); its layers' output "
        'dtypes are not checked',
        model.name,
        type(e).__name__,
        next((l for l in lines if l and not l.startswith('Exception encountered')), '')[:200],
      )
      calls = []
    for c in calls:
      seen.setdefault(id(c.layer), c.outputs)
      inputs.setdefault(id(c.layer), (c.args or tuple(c.kwargs.values()) or (None,))[0])
  for name, layer in layers.items():
    # A row counts every variable inside the layer (a container such as MultiHeadAttention
    # holds none of its own); the hazards below look at its own, as each nested layer has a row.
    held = _all_variables(layer)
    compute = layer.compute_dtype if layer.dtype_policy is not None else '?'
    output = _output_dtype(layer, seen)
    rows.append(
      Row(
        name,
        type(layer).__name__,
        compute,
        ','.join(sorted({keras.backend.standardize_dtype(v.dtype) for v in held})) or '-',
        output,
        int(sum(int(v.numpy().size) for v in held)),
      )
    )
    if isinstance(layer, keras.Model):
      continue
    variables = _own_variables(layer)
    var_dtypes = sorted({keras.backend.standardize_dtype(v.dtype) for v in variables})
    low_vars = [v.path for v in variables if keras.backend.standardize_dtype(v.dtype) in LOW]
    if low_vars:
      hazards.append(
        Hazard(
          name,
          'low-precision variables',
          f'{len(low_vars)} variable(s) stored in '
          f'{",".join(d for d in var_dtypes if d in LOW)} ({low_vars[0]}, ...): '
          'the optimizer updates are rounded away; give the layer a mixed_* '
          'policy (float32 variables) instead of dtype float16/bfloat16',
        )
      )
    # An Embedding does not autocast its ids, but a subclassed model casts its float inputs to
    # the compute dtype before its layers see them: float ids reach the lookup rounded.
    ids = _input_dtype(layer, inputs) or 'int32'
    exact = {'bfloat16': 256, 'float16': 2048}.get(ids, 2**24)  # the integers the dtype holds
    if isinstance(layer, keras.layers.Embedding) and ids in LOW and layer.input_dim > exact + 1:
      hazards.append(
        Hazard(
          name,
          'float token ids',
          f'it looks up {ids} ids (the model cast '
          f'its float inputs to {ids}): ids above {exact} of its '
          f'{layer.input_dim} turn into other ids (257 -> 256 in bfloat16); '
          'feed integer ids (tf.int32)',
        )
      )
    # A softmax layer the recorded forward pass never called computes nothing (attention without
    # dropout computes its softmax in float32 in Keras's dot_product_attention instead).
    if _applies_softmax(layer) and compute in LOW and (not seen or id(layer) in seen):
      maker = layers.get(name.rpartition('/')[0])
      hazards.append(Hazard(name, 'low-precision softmax', _softmax_fix(maker, compute)))
    # A functional model's InputLayer outputs what it is fed (float32): nothing it computes.
    if (
      mixed
      and compute in LOW
      and output == 'float32'
      and not isinstance(layer, keras.layers.InputLayer)
    ):
      hazards.append(
        Hazard(
          name,
          'not autocast',
          f'compute dtype is {compute} but the output is float32: the layer '
          'computes in float32 (weights Keras cannot autocast, e.g. '
          'add_weight(autocast=False) or a raw tf.Variable, or an explicit '
          'cast); cast inputs and weights to self.compute_dtype in call (see '
          'trainer/nn/layers.py), or give the layer dtype="float32" if intended',
        )
      )
  outputs = getattr(model, 'outputs', None) or [
    t for t in keras.tree.flatten(seen.get(id(model), [])) if hasattr(t, 'dtype')
  ]
  for i, out in enumerate(outputs):
    dtype = keras.backend.standardize_dtype(out.dtype)
    if dtype in LOW:  # named by the layer that makes the output, when Keras records it
      maker = getattr(
        getattr(getattr(out, '_keras_history', None), 'operation', None), 'name', None
      ) or next(
        (
          name
          for name, layer in _layers(model)
          if any(t is out for t in keras.tree.flatten(seen.get(id(layer), [])))
        ),
        None,
      )
      hazards.append(
        Hazard(
          maker or f'output {i}',
          'low-precision logits',
          f'the model outputs {dtype}, so the loss (softmax, log) computes in '
          f'{dtype}; give the last layer dtype="float32"',
        )
      )
  return rows, hazards


def _softmax_fix(maker, compute: str) -> str:
  """The fix for a low-precision softmax layer. One that another layer (not a model) makes for
  itself, as attention makes its softmax, gets that layer's policy object; Keras gives it no
  path, so config.precision.float32_layers naming the outer layer does not reach it (measured,
  Keras 3.15: MultiHeadAttention's softmax stayed bfloat16), a float32 dtype on that layer does."""
  if maker is None or isinstance(maker, keras.Model):
    return f'softmax computed in {compute}; give this layer dtype="float32"'
  return (
    f'softmax computed in {compute} inside layer {maker.name}, which makes it itself; give '
    f'{maker.name} dtype="float32" (config.precision.float32_layers does not reach a '
    'softmax Keras gives no path)'
  )


def markdown(model: keras.Model, policy: str, rows: list[Row], hazards: list[Hazard]) -> str:
  lines = [
    f'# dtype audit: {model.name} under {policy}',
    '',
    '| layer | class | compute dtype | variable dtype | output dtype | parameters |',
    '| --- | --- | --- | --- | --- | ---: |',
  ]
  for r in rows:
    lines.append(
      f'| {r.name} | {r.cls} | {r.compute_dtype} | {r.variable_dtype} | '
      f'{r.output_dtype} | {r.params:,} |'
    )
  lines += ['', f'{len(rows)} layers, {model.count_params():,} parameters.', '']
  if hazards:
    lines.append(f'## {len(hazards)} hazard(s)')
    lines.append('')
    lines += [f'- **{h.layer}** ({h.kind}): {h.message}' for h in hazards]
  else:
    lines.append(
      'No hazards: variables are float32, logits and softmax are float32, every '
      'layer computes in its policy dtype.'
    )
  return '\n'.join(lines) + '\n'


def report(trainer) -> str:
  """The audit of a Trainer's model as markdown, also written to <workdir>/audit.md."""
  rows, hazards = audit(trainer.model, trainer.policy, forward(trainer))
  text = markdown(trainer.model, trainer.policy, rows, hazards)
  path = os.path.join(trainer.workdir, 'audit.md')
  files.folder(os.path.dirname(trainer.workdir), trainer.workdir, '--audit')
  files.write(path, text, '--audit')  # never through a link
  return text


def forward(trainer):
  """The forward pass `audit` runs for a subclassed model: compute_loss on the first example of
  the first eval batch (dtypes do not depend on the batch; the recording keeps every layer's
  outputs), on all of it when the loss fails on one example; under the strategy's scope."""
  from trainer.data import checks

  def run():
    batch = checks.first_eval_batch(trainer.datasets)
    with trainer.strategy.scope():
      try:
        trainer.compute_loss(tf.nest.map_structure(lambda t: t[:1], batch), training=False)
      except Exception:  # pylint: disable=broad-except  (e.g. a reshape by the batch size)
        trainer.compute_loss(batch, training=False)

  return run


def check_at_start(
  model: keras.Model,
  policy: str,
  allow_low_precision_variables: bool,
  bfloat16_masters: bool = False,
  run=None,
) -> None:
  """The hazards, when training starts: one warning line each; low-precision variables are a
  ConfigError unless config.precision.allow_low_precision_variables (then a warning), and
  expected (not reported) with config.precision.master_weights bfloat16_*."""
  from trainer.errors import ConfigError

  _, hazards = audit(model, policy, run)
  if bfloat16_masters:  # the optimizer rounds them stochastically or Kahan-compensates them
    hazards = [h for h in hazards if h.kind != 'low-precision variables']
  for h in hazards:
    if h.kind == 'low-precision variables' and not allow_low_precision_variables:
      raise ConfigError(
        f'build_model: layer {h.layer} ({h.kind}): {h.message}; or set '
        'config.precision.allow_low_precision_variables=True to train it anyway'
      )
  for h in hazards:
    logging.warning('precision hazard in layer %s (%s): %s', h.layer, h.kind, h.message)
