"""Autograph for the user's code only, inside the framework's compiled functions.

The framework's compiled functions (the train and eval loops, the numerics probe, the
checkpoint's finite check) are traced with `autograph=False`: its own code states its control
flow (tf.cond, tf.while_loop), and converting it (parsing and rewriting the source of every
method the step calls) was most of the step's tracing time, once per process.

What a user writes (a Trainer's `compute_loss`, the hooks a custom TrainStep overrides, a custom
metric's `update_state`) may use Python control flow on tensors, as in any tf.function, so the
framework calls it through `converted`: autograph converts it recursively, as tf.function would,
and calls it as it is when it cannot (its source unavailable, say), as tf.function does. Keras's
own code is never converted (autograph's own rule for the keras module).

`xla_per_replica` compiles the per-replica part of such a function (the code that calls the
user's) with XLA under `train.jit_compile`, train step and eval loop alike; `xla_errors` turns
XLA's refusal of an op in the user's code into one UserError line.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import tensorflow as tf

from trainer import compile_cache
from trainer.errors import UserError

_PACKAGE = 'trainer'
F = TypeVar('F', bound=Callable)


def is_framework(fn: Callable) -> bool:
  """Whether `fn` (a function or bound method) is defined in the framework's package."""
  module = getattr(getattr(fn, '__func__', fn), '__module__', None) or ''
  return module == _PACKAGE or module.startswith(_PACKAGE + '.')


def converted(fn: F) -> F:
  """`fn` to call inside a compiled function: the framework's own functions as they are, any
  other (the user's) converted by autograph as `tf.function` converts what it traces, recursively
  (a function the user marked tf.autograph.experimental.do_not_convert stays unconverted)."""
  if is_framework(fn):
    return fn
  return tf.__internal__.autograph.tf_convert(fn, _enabled())


def _enabled() -> Any:
  """The autograph context `tf.function` traces in when its autograph is on. Inside the
  framework's functions (autograph=False) the current context says "disabled", which would leave
  the user's code unconverted too; the context's class is reached through the exported
  `control_status_ctx` rather than TensorFlow's internal module."""
  current = tf.__internal__.autograph.control_status_ctx()
  return type(current)(status=type(current.status).ENABLED)


def xla_per_replica(fn: Callable, jit_compile: bool) -> Callable:
  """`fn` (a per-replica function of one argument, for `strategy.run`: the train step's
  gradients, the eval's losses) compiled as one XLA function when `jit_compile`, else `fn`.
  Returned as a plain function: given a tf.function, MirroredStrategy.run lifts it into one XLA
  cluster over all replicas unless every device is a GPU, and that fails on other devices (a
  replica's variables read from another device)."""
  if not jit_compile:
    return fn
  compiled = tf.function(fn, jit_compile=True, autograph=False)
  return lambda arg: compiled(arg)  # pylint: disable=unnecessary-lambda


# XLA's refusal of an op it has no kernel for; what the op is created by, when a user would not
# know it by its name.
_UNSUPPORTED = re.compile(
  r'Detected unsupported operations when trying to compile graph \S+ on \S+: (\w+)'
)
_MADE_BY = {
  'PyFunc': 'tf.numpy_function',
  'EagerPyFunc': 'tf.py_function',
  'StringFormat': 'tf.print',
  'PrintV2': 'tf.print',
}
# A frame of the op's creation stack, as TensorFlow prints it ('File "path", line N, in name').
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_NOT_USER = re.compile(r'(^|/)(tensorflow|keras|trainer|absl)/|/threading\.py$|/concurrent/')


def xla_refusal(error: BaseException) -> str | None:
  """`error`'s op that XLA cannot compile and the user's line that created it ('PyFunc
  (tf.numpy_function), created at model.py:12 in compute_loss'), when `error` is that refusal;
  else None."""
  text = str(error)
  if (match := _UNSUPPORTED.search(text)) is None:
    return None
  op = match.group(1)
  said = f'{op} ({_MADE_BY[op]})' if op in _MADE_BY else op
  frames = [f for f in _FRAME.findall(text[match.end() :]) if not _NOT_USER.search(f[0])]
  if frames:
    path, line, name = frames[-1]
    said += f', created at {path.rsplit("/", 1)[-1]}:{line} in {name}'
  return said


@contextlib.contextmanager
def xla_errors(what: str) -> Iterator[None]:
  """Around a call of a function `xla_per_replica` compiled (`what`: 'the train step',
  'the eval'): XLA's refusal of an op in the user's code (TensorFlow's error of 20-40 lines)
  becomes one UserError line naming the op, the user's line and config.train.jit_compile, and an
  error of XLA's compile cache (its folder unwritable, full, or holding a file it cannot read:
  TensorFlow fails the compilation then, trainer/compile_cache.py) one naming the folder; the
  original is its __cause__ (launch.py --traceback prints it)."""
  try:
    yield
  except tf.errors.OpError as e:
    if isinstance(e, tf.errors.InvalidArgumentError) and (refused := xla_refusal(e)):
      raise UserError(
        f'config.train.jit_compile: XLA cannot compile {what}: it holds {refused}, an op XLA '
        f'has no kernel for; take it out of the code {what} runs, or turn XLA off '
        '(--config.train.jit_compile=false)'
      ) from e
    if (folder := compile_cache.directory()) and folder in str(e):
      said = next(x.strip() for x in str(e).splitlines() if folder in x)[:300]
      raise UserError(
        f'XLA compile cache {folder}: compiling {what} failed there ({type(e).__name__}: '
        f'{said}); make it a writable folder with free space, or turn the cache off '
        f'({compile_cache.ENV}={compile_cache.FLAG}=)'
      ) from e
    raise
