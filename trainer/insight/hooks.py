"""Hooks on a Keras model's layers for the forensic replay, the advisor and the numerics probe:
each layer's computation (`call`, or a float8/int8 layer's `quantized_call`) recorded, Keras
float8 layers run compiled (their gradient fails eagerly), layers switched to float32. A hook is
an instance attribute while its context is active; the previous one is put back after."""

from __future__ import annotations

import contextlib
import dataclasses

import keras
import tensorflow as tf


# The instance attributes through which a precision.float8 recipe computes a layer's GEMMs.
FLOAT8_ATTRIBUTES = ('call', 'float8_matmul')


def is_float(t) -> bool:
  return isinstance(t, (tf.Tensor, tf.Variable)) and t.dtype.is_floating


def float_leaves(structure):
  return [t for t in tf.nest.flatten(structure) if is_float(t)]


@dataclasses.dataclass
class Call:
  layer: keras.layers.Layer
  args: tuple
  kwargs: dict
  outputs: object


def sublayers(layer, include_self=False) -> list:
  """Every layer inside `layer` (nested ones too, depth first), without InputLayers."""
  # pylint: disable-next=protected-access
  return [
    l
    for l in layer._flatten_layers(include_self=include_self)
    if not isinstance(l, keras.layers.InputLayer)
  ]


def call_methods(layer) -> tuple[str, ...]:
  """The method a layer's `__call__` computes through: `call`, or for a quantized layer (float8,
  int8: `layer.quantization_mode` set) `quantized_call`, which Keras's `Layer.__call__` calls
  instead of `call` (a hook on `call` alone never sees a float8 layer)."""
  return ('quantized_call',) if getattr(layer, 'quantization_mode', None) else ('call',)


def trainable(layer) -> list:
  """A layer's trainable variables without Keras float8 scale and amax-history variables (their
  "gradients" are new values, not gradients)."""
  return [v for v in layer.trainable_variables if not getattr(v, 'overwrite_with_gradient', False)]


@contextlib.contextmanager
def hooked(layer, method: str, function):
  """`layer.<method>` is `function(original)` (an instance attribute) while active; the previous
  instance attribute, if any, is put back on exit."""
  had = method in layer.__dict__
  previous = layer.__dict__.get(method)
  object.__setattr__(layer, method, function(getattr(layer, method)))
  try:
    yield
  finally:
    if had:
      object.__setattr__(layer, method, previous)
    else:
      layer.__dict__.pop(method, None)


@contextlib.contextmanager
def quantized_calls_compiled(model):
  """Keras's float8 layers compute their gradients with a `tf.custom_gradient` that fails eagerly
  under a GradientTape (Keras 3.15: 'too many values to unpack', their grad returns the new scale
  and amax history as a third and fourth value); in a tf.function it works, as in the train step.
  While active, each quantized layer's `quantized_call` runs as a tf.function."""
  with contextlib.ExitStack() as stack:
    for layer in sublayers(model, include_self=True):
      if getattr(layer, 'quantization_mode', None):
        stack.enter_context(hooked(layer, 'quantized_call', tf.function))
    yield


@contextlib.contextmanager
def recording(model, tape, include_self=False):
  """Wraps every layer's `call` (`quantized_call` for a quantized layer; an instance attribute,
  removed on exit) to record its inputs and outputs in call-completion order, watching the
  inputs on `tape` (unless None). Quantized layers' calls run compiled
  (`quantized_calls_compiled`). `include_self`: the model's own call is recorded too."""
  calls = []

  def hook(layer):
    def wrap(original):
      def recorded(*args, **kwargs):
        for t in float_leaves((args, kwargs)) if tape is not None else ():
          tape.watch(t)
        outputs = original(*args, **kwargs)
        calls.append(Call(layer, args, kwargs, outputs))
        return outputs

      return recorded

    return wrap

  with contextlib.ExitStack() as stack:
    stack.enter_context(quantized_calls_compiled(model))
    for layer in sublayers(model, include_self):
      for method in call_methods(layer):
        stack.enter_context(hooked(layer, method, hook(layer)))
    yield calls


@contextlib.contextmanager
def float32(layer):
  """The layer and every layer inside it compute in float32, whatever their variables' dtype
  (float32 under a mixed policy; bfloat16 with precision.master_weights bfloat16_*), and without
  float8: Keras's float8 layers lose their quantized policy with the float32 one, a
  precision.float8 recipe's layers their float8 `call` or `float8_matmul` (instance attributes,
  trainer/nn/float8_layers.py), put back on exit."""
  layers = sublayers(layer, include_self=True)
  saved = [l._dtype_policy for l in layers]  # pylint: disable=protected-access
  float8 = [
    (l, name, l.__dict__.pop(name))
    for l in layers
    if getattr(l, 'float8_recipe', None)
    for name in FLOAT8_ATTRIBUTES
    if name in l.__dict__
  ]
  for l in layers:
    l._dtype_policy = _float32_compute(l)  # pylint: disable=protected-access
  try:
    yield
  finally:
    for l, policy in zip(layers, saved):
      l._dtype_policy = policy  # pylint: disable=protected-access
    for l, name, value in float8:
      object.__setattr__(l, name, value)


def _float32_compute(layer) -> keras.DTypePolicy:
  """Policy 'float32', with the layer's variable dtype when it stores 16-bit variables: Keras
  casts a layer's variables to its compute dtype only when the policy's two dtypes differ, so
  under a plain 'float32' policy a bfloat16 variable met float32 inputs uncast (the numerics
  probe's reference pass failed with bfloat16 master weights: 'Conv2D ... has type bfloat16
  that does not match type float32')."""
  policy = keras.DTypePolicy('float32')
  stored = {keras.backend.standardize_dtype(v.dtype) for v in layer.weights} & {
    'bfloat16',
    'float16',
  }
  if stored:
    policy._variable_dtype = stored.pop()  # pylint: disable=protected-access
  return policy


def to_float32(structure):
  return tf.nest.map_structure(lambda t: tf.cast(t, tf.float32) if is_float(t) else t, structure)
