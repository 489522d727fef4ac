"""A dtype audit of a built Keras model: what each layer computes in, stores and outputs.

`audit(model)` returns one `Row` per layer (nested models and the layers a layer holds, such as
attention's projections and softmax, are walked; a row counts every variable inside its layer)
and the `Hazard`s found:
  * low-precision logits: a float16/bfloat16 model output reaches the loss, whose softmax and
    log ops (seen on the forward pass `run`, after compute_loss's own cast) run in float16
    (overflow) or bfloat16 (8-bit precision);
  * overflow: a layer computes inf or NaN from finite inputs at the current weights;
  * low-precision softmax: a layer applying softmax computes in float16/bfloat16;
  * low-precision variables: a layer stores float16/bfloat16 weights, so the optimizer's updates
    are rounded away (use a mixed_* policy: float32 variables, low-precision compute);
  * float token ids: an Embedding gets float16/bfloat16 ids (a subclassed model casts its float
    inputs to the compute dtype), so ids above 256 (bfloat16) or 2048 (float16) become others;
  * not autocast: under a mixed policy a layer outputs float32 although its compute dtype is low
    precision (it creates or reads weights Keras cannot autocast, e.g. a raw tf.Variable, or has
    `autocast=False` on its weights), so it silently computes in float32.
Rows and hazards name a layer by its path in the model (trainer/nn/paths.py). `markdown(...)`
renders the table and the hazards; `python launch.py --config=... --audit` prints
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
from trainer.insight.forensics import nonfinite
from trainer.nn import paths

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
  name the model was built under (default: the current global policy). `run`, a callable
  running the forward pass and the loss (compute_loss on a batch), is called once with every
  layer recorded: it shows the output dtypes Keras does not record (a subclassed model's, the
  layers nested in a layer), the first layer whose output overflows, and the dtype in which the
  loss's softmax and log ops receive the logits (after compute_loss's own cast)."""
  policy = policy or keras.mixed_precision.global_policy().name
  mixed = policy.startswith('mixed_')
  rows, hazards = [], []
  add = lambda layer, kind, message: hazards.append(Hazard(layer, kind, message))
  seen: dict = {}  # id(layer): outputs of its first call in `run`
  inputs: dict = {}  # id(layer): the first argument of that call
  layers = dict(paths.walk(model))
  calls, received = _recorded(model, run) if run is not None else ([], None)
  if overflow := _overflow(calls, layers):
    hazards.append(overflow)
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
      add(
        name,
        'low-precision variables',
        f'{len(low_vars)} variable(s) stored in '
        f'{",".join(d for d in var_dtypes if d in LOW)} ({low_vars[0]}, ...): '
        'the optimizer updates are rounded away; give the layer a mixed_* '
        'policy (float32 variables) instead of dtype float16/bfloat16',
      )
    # An Embedding does not autocast its ids, but a subclassed model casts its float inputs to
    # the compute dtype before its layers see them: float ids reach the lookup rounded.
    ids = _input_dtype(layer, inputs) or 'int32'
    exact = {'bfloat16': 256, 'float16': 2048}.get(ids, 2**24)  # the integers the dtype holds
    if isinstance(layer, keras.layers.Embedding) and ids in LOW and layer.input_dim > exact + 1:
      add(
        name,
        'float token ids',
        f'it looks up {ids} ids (the model cast '
        f'its float inputs to {ids}): ids above {exact} of its '
        f'{layer.input_dim} turn into other ids (257 -> 256 in bfloat16); '
        'feed integer ids (tf.int32)',
      )
    # A softmax layer the recorded forward pass never called computes nothing (attention without
    # dropout computes its softmax in float32 in Keras's dot_product_attention instead).
    if _applies_softmax(layer) and compute in LOW and (not seen or id(layer) in seen):
      maker = name.rpartition('/')[0]
      add(name, 'low-precision softmax', _softmax_fix(maker, layers.get(maker), compute))
    # A functional model's InputLayer outputs what it is fed (float32): nothing it computes.
    if (
      mixed
      and compute in LOW
      and output == 'float32'
      and not isinstance(layer, keras.layers.InputLayer)
    ):
      add(
        name,
        'not autocast',
        f'compute dtype is {compute} but the output is float32: the layer '
        'computes in float32 (weights Keras cannot autocast, e.g. '
        'add_weight(autocast=False) or a raw tf.Variable, or an explicit '
        'cast); cast inputs and weights to self.compute_dtype in call (see '
        'trainer/nn/layers.py), or give the layer dtype="float32" if intended',
      )
  outputs = getattr(model, 'outputs', None) or [
    t for t in keras.tree.flatten(seen.get(id(model), [])) if hasattr(t, 'dtype')
  ]
  for i, out in enumerate(outputs):
    dtype = keras.backend.standardize_dtype(out.dtype)
    # What the loss receives: the softmax and log ops after the model's call returned, in the
    # dtype compute_loss gave them (a cast to float32 there is the fix); without a recorded
    # pass, the model's output.
    low = ['softmax, log'] if received is None else sorted({o for o, d in received if d in LOW})
    if dtype in LOW and low:
      hazards.append(_logits_hazard(out, i, dtype, low, layers, seen))
  return rows, hazards


# The ops through which a loss turns logits into log-probabilities.
LOSS_OPS = frozenset(
  {
    'Softmax',
    'LogSoftmax',
    'SoftmaxCrossEntropyWithLogits',
    'SparseSoftmaxCrossEntropyWithLogits',
    'Log',
    'Log1p',
  }
)


def _recorded(model, run) -> tuple[list, list | None]:
  """Runs `run` with every layer's call recorded (the model's own too): the calls, and (type,
  input dtype) of each LOSS_OPS op run after the model's call returned (None when the pass
  failed: a warning says so)."""
  from tensorflow.python.framework import op_callbacks  # pylint: disable=import-outside-toplevel

  received: list[tuple[str, str]] = []

  def seen(op_type, inputs, attrs, outputs, op_name=None, graph=None):  # pylint: disable=W0613
    name = op_type.decode() if isinstance(op_type, bytes) else str(op_type)
    if graph is None and name in LOSS_OPS and any(c.layer is model for c in calls):
      received.append((name, keras.backend.standardize_dtype(inputs[0].dtype)))

  op_callbacks.add_op_callback(seen)
  try:
    with hooks.recording(model, None, include_self=True) as calls:
      run()
    return calls, received
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
    return [], None
  finally:
    op_callbacks.remove_op_callback(seen)


def _overflow(calls, layers: dict) -> Hazard | None:
  """The first recorded call whose output is not finite from finite inputs (a call is recorded
  when it returns, so the innermost layer comes first), named by its path."""
  names = {id(layer): name for name, layer in layers.items()}
  for c in calls:
    if any(tf.is_symbolic_tensor(t) for t in hooks.float_leaves(c.outputs)):
      continue  # traced while a layer was built: no values
    if nonfinite(c.outputs) and not nonfinite((c.args, c.kwargs)):
      path = names.get(id(c.layer), c.layer.name)
      return Hazard(
        path,
        'overflow',
        f'it computes inf or NaN from finite inputs in {c.layer.compute_dtype} at these '
        'weights, so every step through it is skipped; keep it in float32 '
        f'(config.precision.float32_layers={path}) or check its initialization '
        '(--mode=diagnose names the op)',
      )
  return None


def _logits_hazard(out, index: int, dtype: str, ops: list[str], layers: dict, seen) -> Hazard:
  """The low-precision logits hazard for model output `out`, named by the layer making it; its
  fix fits that layer: a tied output embedding (Keras's ReversibleEmbedding, also the input
  embedding) cannot take dtype="float32" for its projection alone."""
  maker = getattr(getattr(out, '_keras_history', None), 'operation', None) or next(
    (
      layer
      for layer in layers.values()
      if any(t is out for t in keras.tree.flatten(seen.get(id(layer), [])))
    ),
    None,
  )
  name = next((n for n, layer in layers.items() if layer is maker), None)
  cast = 'cast the logits to float32 in compute_loss before the loss (tf.cast(logits, tf.float32))'
  if isinstance(maker, getattr(keras.layers, 'ReversibleEmbedding', ())):
    fix = (
      f'{cast}, or set reverse_dtype="float32" on {name}: it is the input embedding too, and '
      'that attribute moves only its output projection to float32'
    )
  else:
    fix = f'{cast}, or give the last layer dtype="float32"'
  return Hazard(
    name or f'output {index}',
    'low-precision logits',
    f'the model outputs {dtype} and the loss computes {", ".join(ops)} on it in {dtype}; {fix}',
  )


def _softmax_fix(path: str, maker, compute: str) -> str:
  """The fix for a low-precision softmax layer. One that another layer (not a model) makes for
  itself, as attention makes its softmax, is reached through that layer: a float32 dtype on
  it, or its path in config.precision.float32_layers (trainer/step/precision.py gives the
  layers inside a named one the float32 policy; Keras's own policy map did not reach a
  softmax it gives no path: MultiHeadAttention's stayed bfloat16, Keras 3.15)."""
  if maker is None or isinstance(maker, keras.Model):
    return f'softmax computed in {compute}; give this layer dtype="float32"'
  return (
    f'softmax computed in {compute} inside layer {path}, which makes it itself; give '
    f'{path} dtype="float32" or name it in config.precision.float32_layers'
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
    lines += [f'## {len(hazards)} hazard(s)', '']
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


def overflow(trainer) -> str | None:
  """'layer <path> ...': the first layer of the trainer's model whose output overflows on the
  audit's forward pass (`forward`), None when none does. The hook check's non-finite loss
  warning names it (trainer/step/contract.py)."""
  _, hazards = audit(trainer.model, trainer.policy, forward(trainer))
  found = next((h for h in hazards if h.kind == 'overflow'), None)
  return f'layer {found.layer} overflows: {found.message}' if found else None


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
