"""Layer and variable paths: the one name every tool gives a layer or a variable.

A layer's path is its place in the model: the model's name, then the name of each layer holding
it (`gpt2_causal_lm/gpt2_backbone/transformer_layer_1/feedforward_intermediate_dense`). Keras's
own `layer.path` is the name scope the layer was built in, which is not always that: a nested
functional model (a KerasHub backbone) builds its layers before it exists, so their Keras paths
miss its name and the outer model's (`transformer_layer_1/...`), and a layer without weights
(Dropout) is never built and has none. The numerics line and tags, the dtype audit, the forensic
replay, the precision advisor and `precision.float32_layers` name a layer by `walk` /
`layer_paths`, and a variable by `variable_name`.
"""

from __future__ import annotations

import re
from typing import Any

import keras


def walk(model) -> list[tuple[str, Any]]:
  """(path, layer) for every layer inside `model` but its InputLayers, depth first (a layer
  before the layers it holds), each once: a layer held in two places is named by the first."""
  found: list[tuple[str, Any]] = []
  seen = {id(model)}

  def visit(parent, prefix: str) -> None:
    # pylint: disable-next=protected-access  (Keras's own walk over a layer's direct children)
    for layer in parent._flatten_layers(include_self=False, recursive=False):
      if id(layer) not in seen and not isinstance(layer, keras.layers.InputLayer):
        seen.add(id(layer))
        found.append((f'{prefix}/{layer.name}', layer))
        visit(layer, f'{prefix}/{layer.name}')

  visit(model, model.name)
  return found


def layer_paths(model) -> dict[int, str]:
  """{id(layer): its path} for `model` and every layer inside it."""
  return {id(model): model.name, **{id(layer): path for path, layer in walk(model)}}


def variable_name(v) -> str:
  """A variable's Keras path (`tiny/d1/kernel`), for a Keras variable and for the tf.Variable
  behind it alike (whose TF name adds ':0'); a plain tf.Variable's name without that suffix."""
  return getattr(v, 'path', None) or re.sub(r':\d+$', '', v.name)
