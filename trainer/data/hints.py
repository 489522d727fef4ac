"""One-line hints for the data mistakes that fail inside the user's compute_loss.

The hook check (trainer/step/contract.py) runs compute_loss once, eagerly, on the first eval
batch, where a new user's data mistakes fail deep inside Keras or TensorFlow (25-46 lines of
traceback, one of them every label of the batch). `hint(error)` recognises the five common ones
from the error's message and says the fix in one line: one-hot labels given to a sparse loss, a
model returning a dict, a label outside the classes, float labels compared with integer
predictions, images without a channel axis. Any other exception gets None: raised as it is.
"""

from __future__ import annotations

import re

_ONE_HOT = re.compile(
  r'must have rank \(ndim\) `target\.ndim - 1`\. Received: target\.shape=(\([^)]*\)), '
  r'output\.shape=(\([^)]*\))'
)
# A dict reaching a TensorFlow op, or a Keras loss that reads `.shape` first (the README's
# keras.losses.sparse_categorical_crossentropy(labels, logits) on a dict output).
_DICT = re.compile(
  r"with an unsupported type \(<class 'dict'>\) to a Tensor|'dict' object has no attribute "
  r"'(?:shape|dtype|ndim)'"
)
_LABEL = re.compile(
  r'Received a label value of (-?\d+) which is outside the valid range of \[0, (\d+)\)\.'
  r'\s+Label values: ([-\d ]+)'
)
# The same mistake under op determinism (tf.config.experimental.enable_op_determinism): the
# sparse cross-entropy's deterministic form gathers by label, and names one label only.
_GATHERED = re.compile(r'indices\[\d+\] = (-?\d+) is not in \[0, (\d+)\) \[Op:GatherV2\]')
_DTYPES = re.compile(
  r'cannot compute (\w+) as input #(\d+)\(zero-based\) was expected to be a (\w+) tensor '
  r'but is a (\w+) tensor'
)
_RANK = re.compile(
  r"of layer '(\w+)' is incompatible with the layer: expected (?:min_)?ndim=(\d+), "
  r'found ndim=(\d+)\. Full shape received: (\([^)]*\))'
)


def hint(error: BaseException) -> str | None:
  """The fix for `error` when it is one of the data mistakes above, else None."""
  text = str(error)
  for find, say in (
    (_ONE_HOT, _one_hot),
    (_DICT, _dict),
    (_LABEL, _label),
    (_GATHERED, _gathered),
    (_DTYPES, _dtypes),
    (_RANK, _rank),
  ):
    if (match := find.search(text)) is not None:
      return say(match, text)
  return None


def _one_hot(match, _) -> str:
  labels, logits = match.groups()
  return (
    f'the labels {labels} have the rank of the predictions {logits}: one-hot (or [B, 1]) '
    'labels given to a sparse loss, which takes class indices [B]; use '
    'keras.losses.categorical_crossentropy for one-hot labels, or give the sparse loss '
    'tf.argmax(labels, -1)'
  )


def _dict(_, text) -> str:
  keys = re.findall(r"'([^']+)': <tf\.Tensor", text)
  named = f' (keys {", ".join(repr(k) for k in keys)})' if keys else ''
  example = keys[0] if keys else 'logits'
  return (
    f'a dict{named} reached a TensorFlow op that takes a tensor: the model returns a dict; '
    f"take the output the loss needs, e.g. self.model(x, training=training)['{example}']"
  )


def _label(match, _) -> str:
  classes = int(match.group(2))
  values = [int(v) for v in match.group(3).split()]
  outside = sorted({v for v in values if not 0 <= v < classes})
  shown = ', '.join(map(str, outside[:5])) + (', ...' if len(outside) > 5 else '')
  fix = (
    'shift them to start at 0 (labels - 1)'
    if min(values) >= 1 and max(values) == classes
    else f'give the last layer {max(values) + 1} units'
  )
  return (
    f"labels outside the model's {classes} classes [0, {classes}): "
    f'{sum(not 0 <= v < classes for v in values)} of {len(values)} labels are {shown} '
    f"(the batch's labels run {min(values)}..{max(values)}); labels are class indices "
    f'0..{classes - 1}: {fix}'
  )


def _gathered(match, _) -> str:
  value, classes = int(match.group(1)), int(match.group(2))
  return (
    f"labels outside the model's {classes} classes [0, {classes}): a label is {value}; labels "
    f'are class indices 0..{classes - 1}: shift them to start at 0 (labels - 1) if they start '
    f'at 1, else give the last layer {max(value, classes - 1) + 1} units'
  )


def _dtypes(match, _) -> str:
  op, index, wanted, got = match.groups()
  return (
    f'tf.{_snake(op)} got {_a(wanted)} and {_a(got)} tensor (input #{index} is {got}): '
    f'float labels compared with integer predictions (or the reverse); cast one to the '
    f"other's dtype, e.g. tf.cast(labels, tf.int32), or make the labels integers in "
    'build_datasets'
  )


def _rank(match, _) -> str:
  layer, expected, found, shape = match.groups()
  missing = int(expected) - int(found)
  if missing == 1 and int(expected) >= 3:
    return (
      f'layer {layer!r} takes inputs of rank {expected} (batch, ..., channels) and got '
      f'{shape}: the images have no channel axis; add one in build_datasets, '
      'x[..., None] (tf.expand_dims(x, -1)), or keras.Input with the channel axis'
    )
  return (
    f'layer {layer!r} takes inputs of rank {expected} and got rank {found} {shape}: '
    'reshape the inputs in build_datasets to what the model expects'
  )


def _snake(name: str) -> str:
  """'Equal' -> 'equal', 'NotEqual' -> 'not_equal' (the Python op of a kernel's name)."""
  return re.sub(r'(?<!^)(?=[A-Z])', '_', name).lower()


def _a(word: str) -> str:
  return ('an ' if word[0] in 'aeiou' else 'a ') + word
