"""Element-wise chains as one XLA kernel each, inside the trainer's compiled steps.

The exact GELU and its backward pass, written out in trainer/nn/layers.py, are chains of
TensorFlow ops (erfc, exp, products): about ten kernels, each a pass over the MLP's widest
activation. A function decorated with `kernel` is instead compiled by XLA into one fused loop
(`tf.function(jit_compile=True)`), while the matmuls around it stay TensorFlow's (oneDNN's
kernels, which at the Shakespeare shape beat XLA's: configs/shakespeare.py runs without XLA).
Timed both ways (docs/references.md, "nanoGPT's own script"), GELU's forward and backward ran
faster as one kernel; layer_norm's ran slower and masked_softmax's about the same, so those stay
TensorFlow's ops. Inside a step XLA compiles whole, a kernel is simply part of that computation.

Only while `kernels()` is active (the trainer's train and eval steps enter it while they trace);
elsewhere the same function runs as plain TensorFlow ops: eagerly (a kernel called eagerly
compiles once per new shape), in an
exported SavedModel (TensorFlow Serving runs XLA:CPU only when a flag allows it), and in a
user's own loop, which can enter `kernels()` inside its own tf.function. The two differ in
rounding only: over x in [-12, 12] the two float32 GELUs differ by at most 4e-6 relative (in the
far left tail), each is within 1.4e-5 of a float64 reference there, and the backward passes'
largest errors against that reference are TensorFlow's, range by range, to within 20 %.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

_ACTIVE = contextvars.ContextVar('trainer_fused_kernels', default=False)


@contextlib.contextmanager
def kernels() -> Iterator[None]:
  """Functions decorated with `kernel` run as XLA kernels while this is active (read when a
  tf.function traces: enter it inside the function being traced)."""
  token = _ACTIVE.set(True)
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def active() -> bool:
  """Whether `kernels()` is active here."""
  return _ACTIVE.get()


def kernel(fn: Callable) -> Callable:
  """`fn` compiled by XLA as one computation while `kernels()` is active, else `fn` itself.
  Its non-tensor arguments (a dtype, an epsilon) are part of the compiled function's signature."""
  compiled = tf.function(fn, jit_compile=True, autograph=False)

  @functools.wraps(fn)
  def call(*args: Any, **kwargs: Any) -> Any:
    return compiled(*args, **kwargs) if _ACTIVE.get() else fn(*args, **kwargs)

  call.compiled = compiled  # type: ignore[attr-defined]  # tests read its traces
  return call
