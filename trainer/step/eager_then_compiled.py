"""`EagerThenCompiled`: a function the run calls rarely, run eagerly for its first calls and as
one compiled `tf.function` after them.

Tracing and optimizing a graph (grappler) costs about as much as running the function eagerly
several times. For a function the run calls rarely (the numerics probe; the checkpoint's finite
check over every variable) a short run, a test or a debugging session is faster never compiling
it, a long run, calling it hundreds of times, faster compiled. The length is not known in
advance, so calls run eagerly for at most `eager_calls` calls and `eager_seconds` seconds in all
(together about one compilation), compiled after: whatever the length, at most about twice the
better choice (the rent-or-buy rule: rent until the rent paid equals the price, then buy). The
count keeps a small function's choice deterministic; the seconds stop a large model, whose eager
calls are slow, from renting long. With a TPU every call is compiled: eager ops on a TPU are each
compiled on their own.

Both run the same ops on the same values; a compiled graph may fuse kernels (grappler's remapper,
oneDNN's fused matmuls), which in low precision can round an intermediate differently, so a
float16 or bfloat16 statistic can differ in its last bits between eager and compiled calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import tensorflow as tf
from absl import logging


class EagerThenCompiled:
  """`fn(*args)` eagerly while fewer than `eager_calls` calls have run eagerly and they took
  less than `eager_seconds` in total; after that `tf.function(fn, **function_options)`, traced
  once per input signature as any tf.function. Called while a graph is being traced, it is
  traced into that graph and not counted. An eager call that raises is repeated compiled, and
  every later call is compiled."""

  def __init__(
    self, fn: Callable, *, eager_calls: int, eager_seconds: float, **function_options: Any
  ) -> None:
    self.fn = fn
    self.eager_calls, self.eager_seconds = int(eager_calls), float(eager_seconds)
    self.compiled = tf.function(fn, **function_options)
    self.calls = 0  # eager-mode calls so far, both kinds
    self.seconds = 0.0  # spent in the eager ones

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    if not tf.executing_eagerly():
      return self.fn(*args, **kwargs)
    # Checked at the first call, not at construction: a TPU system starts after that.
    if self.calls == 0 and tf.config.list_logical_devices('TPU'):
      self.eager_calls = 0
    eager = self.eager_next
    self.calls += 1
    if eager:
      start = time.perf_counter()
      try:
        return self.fn(*args, **kwargs)
      except Exception as e:  # pylint: disable=broad-except
        # Some layers run only in a graph (Keras's float8 layers: their custom gradient unpacks
        # differently under eager execution): compiled from here on, as before this module.
        self.eager_calls = 0
        logging.debug(
          '%s failed eagerly (%s: %s); compiled from now on', self.fn, type(e).__name__, e
        )
      finally:
        self.seconds += time.perf_counter() - start
    return self.compiled(*args, **kwargs)

  @property
  def eager_next(self) -> bool:
    """Whether the next eager-mode call runs eagerly."""
    return self.calls < self.eager_calls and self.seconds < self.eager_seconds
