"""What a function did op by op, for the forensic replay (trainer/insight/forensics.py).

`watched(run)` runs `run()` eagerly with an op callback (the hook
`tf.debugging.enable_check_numerics` uses) and returns its result and every op it executed, in
order: the op's type, whether its float outputs were finite, and the largest |value| of its float
outputs and inputs as float32. `first_nonfinite(ops)` is the first op whose output was not finite;
`value_float32` finds how large that op's output is in float32: the same op of a float32 run of
the same code (matched by its place among the ops of its type), or a Cast's own input (a cast
down that overflowed). Ops inside a `tf.function` are not executed one by one, so they are not
seen; `failing_op(run)` then names the first non-finite op from check_numerics' error message.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import re

import numpy as np
import tensorflow as tf


@dataclasses.dataclass
class Op:
  """One op run eagerly: its type, whether its float outputs were finite, and the largest
  |value| of its float outputs and of its float inputs, as float32 (nan: none)."""
  type: str
  finite: bool
  max_out: float
  max_in: float


def _largest(tensors) -> tuple[bool, float]:
  """(every float element finite, the largest |element| that is not NaN) of eager tensors. In
  NumPy: a TF op here would call the op callback again."""
  finite, largest = True, math.nan
  for t in tensors:
    if t is None or not t.dtype.is_floating or t.shape.num_elements() == 0:
      continue
    values = np.abs(np.asarray(t.numpy()).astype(np.float32))
    finite = finite and bool(np.isfinite(values).all())
    values = values[~np.isnan(values)]
    if values.size:
      largest = float(values.max()) if math.isnan(largest) else max(largest, float(values.max()))
  return finite, largest


def watched(run):
  """`run()`'s result and the ops it ran eagerly, in order (TF's op callbacks; the ops of a
  tf.function inside it are not seen one by one)."""
  from tensorflow.python.framework import op_callbacks  # pylint: disable=import-outside-toplevel
  ops: list[Op] = []

  def seen(op_type, inputs, attrs, outputs, op_name=None, graph=None):  # pylint: disable=unused-argument
    if graph is None:  # executed, not traced into a graph
      finite, top = _largest(outputs)
      name = op_type.decode() if isinstance(op_type, bytes) else str(op_type)
      ops.append(Op(name, finite, top, _largest(inputs)[1]))

  op_callbacks.add_op_callback(seen)
  try:
    return run(), ops
  finally:
    op_callbacks.remove_op_callback(seen)


def first_nonfinite(ops: list[Op]) -> tuple[Op, int] | None:
  """The first op with a non-finite output, and how many ops of its type ran before it."""
  before: collections.Counter = collections.Counter()
  for op in ops:
    if not op.finite:
      return op, before[op.type]
    before[op.type] += 1
  return None


def value_float32(first: tuple[Op, int] | None, ops, ops32) -> float | None:
  """How large the first non-finite op's output is in float32: a Cast's input (a cast down that
  overflowed); otherwise the op of the float32 run at the same place among the ops of its type,
  when that run ran as many of them (else None: no reliable match)."""
  if first is None:
    return None
  op, index = first
  if op.type == 'Cast':
    return op.max_in if not math.isnan(op.max_in) else None
  same = [o for o in ops32 if o.type == op.type]
  if len(same) != sum(o.type == op.type for o in ops) or math.isnan(same[index].max_out):
    return None
  return same[index].max_out


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
