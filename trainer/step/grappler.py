"""TensorFlow's graph optimizer (grappler) on the trainer's compiled loops, or not.

Grappler rewrites a function's graph once, at its first call (pruning, constant folding,
arithmetic and dependency rewrites, its remapper's fusions): on the train loop that is a pass over
thousands of nodes on one thread before the first step (its time at the nanoGPT shape:
docs/references.md, "Start-up: eager first, compiled later"). On a CPU the rewritten loop was not
faster per step (docs/results/grappler.md), so `config.train.grappler='auto'` leaves it off there;
with a GPU or TPU 'auto' keeps TensorFlow's default, on: its layout and fusion passes target those
devices' kernels, and this project has no GPU to measure them on.

The switch is per call, for this thread: `passes(False)` runs the calls inside it with this
thread's function call options saying "no grappler" (those `tf.experimental.function_executor_type`
sets the executor in), so a user's own tf.functions, called elsewhere, keep TensorFlow's defaults.
A function is optimized (or not) when its first call instantiates it under those options; the
loops make every call the same way.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

from tensorflow.core.protobuf import config_pb2
from tensorflow.python.eager import context


@contextlib.contextmanager
def passes(on: bool) -> Iterator[None]:
  """Calls of compiled functions inside run with grappler `on` (TensorFlow's default) or off."""
  if on:
    yield
    return
  ctx = context.context()
  saved = copy.copy(ctx.function_call_options)
  options = ctx.function_call_options
  config = config_pb2.ConfigProto.FromString(options.config_proto_serialized or b'')
  config.graph_options.rewrite_options.disable_meta_optimizer = True
  options.config_proto_serialized = config  # serialized deterministically: the same bytes each call
  try:
    yield
  finally:
    ctx.function_call_options = saved
