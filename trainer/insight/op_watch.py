"""What a function did op by op, for the forensic replay (trainer/insight/forensics.py).

`watched(run)` runs `run()` eagerly with an op callback (the hook of
`tf.debugging.enable_check_numerics`) and returns its result and every op it executed, in order:
type, whether its float outputs were finite and their largest |value| (a Cast's input too).
`culprit(ops, ops32)` takes the ops of a low-precision and of a float32 run of the same code and
returns the op to blame and its float32 value: the first op not finite whose float32 counterpart
(by its place among the ops of its type) was finite, a range problem; failing that, the first
non-finite op (a mask's intended -inf is non-finite in float32 too, so it is passed over while a
real overflow follows). For a Cast the value is its input (a cast down that overflowed). A
`tf.function` called inside reaches the callback as one op of its own name: never the culprit;
when nothing else is, `failing_op(run)` names the first non-finite op from check_numerics' error.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import re

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import op_def_registry  # pylint: disable=no-name-in-module


@dataclasses.dataclass
class Op:
  """One op run eagerly: its type, whether its float outputs were finite, the largest |value|
  of its float outputs and, for a Cast, of its input (nan: none), and whether it is a traced
  function rather than an op."""

  type: str
  finite: bool
  max_out: float
  max_in: float
  function: bool = False


def _largest(tensors) -> tuple[bool, float]:
  """(every float element finite, the largest |element| that is not NaN) of eager tensors. In
  NumPy: a TF op here would call the op callback again. float64 stays float64 (a value past
  float32's range is not an overflow there)."""
  finite, largest = True, math.nan
  for t in tensors:
    if t is None or not t.dtype.is_floating or t.shape.num_elements() == 0:
      continue
    values = np.asarray(t.numpy()).astype(np.float64 if t.dtype == tf.float64 else np.float32)
    finite = finite and bool(np.isfinite(values).all())
    top = np.nanmax(np.abs(values)) if not np.isnan(values).all() else math.nan
    if not math.isnan(top):
      largest = float(top) if math.isnan(largest) else max(largest, float(top))
  return finite, largest


def watched(run):
  """`run()`'s result and the ops it ran eagerly, in order (TF's op callbacks)."""
  from tensorflow.python.framework import op_callbacks  # pylint: disable=import-outside-toplevel

  ops: list[Op] = []

  def seen(op_type, inputs, attrs, outputs, op_name=None, graph=None):  # pylint: disable=W0613
    if graph is None:  # executed, not traced into a graph
      name = op_type.decode() if isinstance(op_type, bytes) else str(op_type)
      finite, top = _largest(outputs)
      given = _largest(inputs)[1] if name == 'Cast' else math.nan
      ops.append(Op(name, finite, top, given, op_def_registry.get(name) is None))

  op_callbacks.add_op_callback(seen)
  try:
    return run(), ops
  finally:
    op_callbacks.remove_op_callback(seen)


def _value32(op: Op, index: int, ops, ops32) -> float | None:
  """How large `op`'s output (the index-th of its type) is in float32: a Cast's input, or its
  float32 counterpart's output (inf when that is not finite either); None without a reliable
  match (the two runs ran different numbers of ops of the type)."""
  if op.type == 'Cast':
    return op.max_in if not math.isnan(op.max_in) else None
  same = [o for o in ops32 if o.type == op.type]
  if len(same) != sum(o.type == op.type for o in ops):
    return None
  match = same[index]
  return match.max_out if match.finite and not math.isnan(match.max_out) else math.inf


def culprit(ops: list[Op], ops32: list[Op]) -> tuple[str, float | None] | None:
  """(the op type to blame, its float32 value or None), or None when no op (but maybe a traced
  function) was non-finite; see the module docstring."""
  seen: collections.Counter = collections.Counter()
  first = None
  for op in ops:
    index = seen[op.type]
    seen[op.type] += 1
    if op.finite or op.function:
      continue
    value = _value32(op, index, ops, ops32)
    if value is not None and math.isfinite(value):
      return op.type, value  # finite in float32: the low dtype's range
    first = first or (op.type, value)
  return first


_OP = re.compile(r'op "?([A-Za-z0-9_]+)"?')


@contextlib.contextmanager
def _check_numerics():
  tf.debugging.enable_check_numerics()
  try:
    yield
  finally:
    tf.debugging.disable_check_numerics()


def failing_op(run) -> str:
  """Runs `run()` with check_numerics on; the type of the first op whose output was non-finite
  ('' when none was caught, or when the error names only a traced function)."""
  try:
    with _check_numerics():
      run()
  except (tf.errors.InvalidArgumentError, tf.errors.OpError) as e:
    message = str(e)
    names = (
      re.findall(r'eagerly-executing op "([^"]+)"', message)
      + re.findall(r'op "([^"]+)"', message)
      + _OP.findall(message)
    )
    return next((n for n in names if op_def_registry.get(n) is not None), '')
  return ''
