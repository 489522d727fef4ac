"""The hook contract, checked once before training on one eval batch (no cost per step).

`probe(batch, compute_loss)`, on the first eval batch (trainer/data/checks.py, which also checks
build_datasets()'s result), runs the eager forward pass the trainer needs anyway (it builds the
model and tells the metric names) and checks what compute_loss returned:

  compute_loss(batch, training=...) -> (loss, {name: value}): the loss floating-point with shape
      [B], every metric numeric with shape [B], B being the batch's leading dimension.

The other hooks' results and signatures are checked here too. A violation raises UserError (one
line: the hook, what it returned, the fix) before the workdir is opened, so a failed check
writes nothing. Caught here: shapes that only broadcast by accident (labels [B, 1] against
predictions [B] give a [B, B] metric), a batch mean in place of per-example values (shape []).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from trainer.data import hints
from trainer.data.checks import shape_text as _shape
from trainer.errors import UserError
from trainer.nn.paths import variable_name
from trainer.step.eval_step import LossFn


# Names of the step's own outputs and of the trainer's scalars: a metric cannot take them.
RESERVED = (
  'loss',
  'steps',
  'skipped',
  'nonfinite_loss',
  'learning_rate',
  'loss_scale',
  'skipped_steps',
  'nonfinite_loss_steps',
  'steps_per_sec',
)


def _describe(value: object) -> str:
  """'float32 [128, 10]' for a tensor-like, the type name otherwise."""
  if hasattr(value, 'shape') and hasattr(value, 'dtype'):
    dtype = tf.as_dtype(value.dtype).name
    return f'{dtype} {_shape(value.shape)}'
  return type(value).__name__


# How the trainer calls each hook: positional argument names, keyword arguments.
HOOK_CALLS = {
  'build_datasets': ((), {}),
  'build_model': ((), {}),
  'compute_loss': (('batch',), {'training': False}),
  'build_learning_rate': ((), {}),
  'build_optimizer': (('learning_rate',), {}),
  'build_metrics': ((), {}),
  'build_train_step': ((), {}),
  'checkpoint_items': ((), {}),
  'build_actions': ((), {}),
}
REQUIRED_HOOKS = ('build_datasets', 'build_model', 'compute_loss')


def _expected(name: str) -> str:
  args, kwargs = HOOK_CALLS[name]
  params = ['self', *args] + (['*', *kwargs] if kwargs else [])
  return f'def {name}({", ".join(params)}):'


def check_hooks(trainer: object, base: type) -> None:
  """Before any hook runs: the three required hooks are defined, and every hook the subclass
  overrides accepts the arguments the trainer passes (a wrong signature would otherwise fail
  later, with a traceback, some of them only at the first log line)."""
  cls = type(trainer)
  # A hook may also be an instance attribute set before super().__init__().
  inherited = lambda n: getattr(cls, n, None) is getattr(base, n) and n not in vars(trainer)
  missing = [n for n in REQUIRED_HOOKS if inherited(n)]
  if missing:
    raise UserError(
      f'{cls.__name__} does not define {", ".join(missing)}: a Trainer subclass '
      'defines '
      + ', '.join(f'`{_expected(n)}`' for n in missing)
      + ' (README: "Write your own model")'
    )
  for name, (args, kwargs) in HOOK_CALLS.items():
    if inherited(name):
      continue
    hook = getattr(trainer, name)
    try:
      signature = inspect.signature(hook)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
      continue
    try:
      signature.bind(*args, **kwargs)
    except TypeError as e:
      raise UserError(
        f'{cls.__name__}.{name}{signature} cannot be called as the trainer calls '
        f'it ({e}); define it as `{_expected(name)}`'
      ) from None


def check_model(model: object) -> None:
  """build_model()'s result is a Keras model whose name TensorFlow takes as a scope name."""
  if not isinstance(model, keras.Model):
    hint = ' (did you forget the return?)' if model is None else ''
    raise UserError(
      f'build_model returned {"None" if model is None else type(model).__name__}; '
      'return a keras.Model, e.g. keras.Sequential([keras.Input(shape), ...]) or '
      f'keras.Model(inputs, outputs){hint}'
    )
  if not re.fullmatch(r'[A-Za-z0-9.][A-Za-z0-9_.\\/>-]*', model.name):  # TF's root scope names
    raise UserError(
      f'build_model returned a model named {model.name!r} (Keras names it after its '
      f'class, {type(model).__name__}), which TensorFlow refuses as a name scope: '
      'evaluation and export would fail; give it a name that starts with a letter '
      "(in a subclass: super().__init__(name='net', **kwargs))"
    )
  _warn_fit_hooks(model)


# Keras fit()'s hooks on the model: the trainer's step never calls them (a Keras user's custom
# train_step ran never, without a word, and the run trained on compute_loss alone).
KERAS_FIT_HOOKS = ('train_step', 'test_step', 'compute_loss')


def _warn_fit_hooks(model: keras.Model) -> None:
  """One warning line naming the fit() hooks the model's class overrides."""
  cls = type(model)
  own = [n for n in KERAS_FIT_HOOKS if getattr(cls, n, None) is not getattr(keras.Model, n, None)]
  if own:
    logging.warning(
      "%s overrides %s, Keras fit()'s hook(s), which the trainer never calls: each step runs "
      'Trainer.compute_loss(batch, *, training) for the loss and TrainStep.compute_gradients '
      'for the gradients (docs/guides/custom-steps.md); move that logic there',
      cls.__name__,
      ', '.join(own),
    )


def check_metrics(metrics: object) -> None:
  """build_metrics()'s result is {name: keras metric}."""
  if not isinstance(metrics, Mapping):
    raise UserError(
      f'build_metrics returned {type(metrics).__name__}; return a dict '
      "{name: keras metric}, e.g. {'auc': keras.metrics.AUC(from_logits=True)}"
    )
  for name, metric in metrics.items():
    # Keras metrics, or anything with their three methods (duck-typed, as the loops use it).
    if not all(
      callable(getattr(metric, m, None)) for m in ('update_state', 'result', 'reset_state')
    ) or isinstance(metric, type):
      raise UserError(
        f'build_metrics returned {type(metric).__name__} for {name!r}; each value '
        'must be a keras.metrics.Metric instance (note the parentheses: '
        'keras.metrics.AUC())'
      )


def check_actions(actions: Iterable[object]) -> None:
  """Every action is a callable taking one Event."""
  for action in actions:
    name = getattr(action, '__name__', type(action).__name__)
    if not callable(action):
      raise UserError(
        f'build_actions returned {type(action).__name__}, not a callable; an '
        'action is a function taking one trainer.Event'
      )
    try:
      inspect.signature(action).bind(None)
    except ValueError:  # no signature to read (a builtin): not checked
      continue
    except TypeError as e:
      raise UserError(
        f'build_actions: action {name} cannot be called with one event ({e}); '
        f'define it as `def {name}(event):` (a trainer.Event)'
      ) from None


def _batch_size(batch: Any) -> int | None:
  sizes = {
    int(t.shape[0])
    for t in tf.nest.flatten(batch)
    if hasattr(t, 'shape') and t.shape.rank and t.shape[0] is not None
  }
  return sizes.pop() if len(sizes) == 1 else None


def check_outputs(batch: Any, outputs: Any, stateful: Collection[str] = ()) -> dict:
  """Checks compute_loss's result on `batch`; returns the metrics dict. Entries named in
  `stateful` (the Trainer's build_metrics()) are update_state arguments, not [B] values."""
  pair = isinstance(outputs, (tuple, list)) and len(outputs) == 2
  if pair and not isinstance(outputs[1], Mapping):
    raise UserError(
      f'compute_loss returned (loss, {_describe(outputs[1])}); the second item must '
      'be a dict {metric name: per-example value [B]}, e.g. '
      "`return loss, {'accuracy': correct}`, or `return loss, {}` for none"
    )
  if not pair:
    what = (
      f'a {type(outputs).__name__} of {len(outputs)}'
      if isinstance(outputs, (tuple, list))
      else _describe(outputs)
    )
    raise UserError(
      f'compute_loss returned {what}; return a pair (per-example loss [B], '
      '{metric name: per-example value [B]}), e.g. `return loss, {}` when there '
      'are no metrics'
    )
  loss, metrics = outputs
  b = _batch_size(batch)
  batch_shapes = ', '.join(_describe(t) for t in tf.nest.flatten(batch))
  labelish = [
    t
    for t in tf.nest.flatten(batch)
    if hasattr(t, 'shape') and t.shape.rank == 2 and t.shape[-1] == 1
  ]
  hint_11 = (
    f'; the batch holds a {_describe(labelish[0])} tensor: flatten labels to [B] '
    '(y.reshape(-1) or tf.squeeze(y, -1)) so they compare with predictions [B]'
    if labelish
    else '; a [B, 1] tensor compared with a [B] one broadcasts to [B, B]: flatten it to [B]'
  )

  def per_example(kind: str, value: Any, fix_scalar: str) -> None:
    if not hasattr(value, 'shape') or not hasattr(value, 'dtype'):
      raise UserError(
        f'compute_loss returned {kind} of type {type(value).__name__}; return a '
        'tensor with one value per example, shape [B]'
      )
    shape = tf.TensorShape(value.shape)
    got = _describe(value)
    if shape.rank == 0:
      raise UserError(
        f'compute_loss returned {kind} as a scalar ({got}) for a batch of {b} '
        f'({batch_shapes}); {fix_scalar}'
      )
    said = f'compute_loss returned {kind} of shape {_shape(shape)} ({got}) for a batch of {b}'
    if b is not None and shape.rank == 2 and shape[0] == b and shape[1] == b and b > 1:
      raise UserError(f'{said}: two shapes broadcast against each other{hint_11}')
    if shape.rank != 1:
      raise UserError(
        f'{said} ({batch_shapes}); it must be [B]: reduce the other axes per example (e.g. '
        'tf.reduce_mean(x, axis=-1)) or use a per-example loss such as '
        'keras.losses.sparse_categorical_crossentropy'
      )
    if b is not None and shape[0] is not None and shape[0] != b:
      raise UserError(f'{said} ({batch_shapes}); it must have one value per example, [{b}]')

  per_example(
    'the loss',
    loss,
    'return the per-example loss, shape [B] (drop the '
    'tf.reduce_mean: the trainer averages over the global batch)',
  )
  if not tf.as_dtype(loss.dtype).is_floating:
    raise UserError(
      f'compute_loss returned the loss as {_describe(loss)}; it must be '
      'floating-point (tf.cast(loss, tf.float32))'
    )
  for name in metrics:
    if name in RESERVED or (isinstance(name, str) and name.startswith('_')):
      raise UserError(
        f'compute_loss returned a metric named {name!r}, a name the trainer uses '
        f'for its own values ({", ".join(RESERVED)}; and names starting with _): '
        'it would replace them in the log and TensorBoard; rename the metric'
      )
  for name, value in metrics.items():
    if name in stateful:
      if not isinstance(value, (tuple, list)):
        raise UserError(
          f'compute_loss returned the stateful metric {name!r} as '
          f'{_describe(value)}; return the tuple of its update_state arguments, '
          f'e.g. {{{name!r}: (labels, predictions)}}'
        )
      continue
    if not isinstance(name, str):
      raise UserError(f'compute_loss returned a metric named {name!r}; metric names are strings')
    per_example(
      f'the metric {name!r}',
      value,
      'return one value per example, shape [B] (the '
      'trainer averages it; a batch mean would be divided by the batch again)',
    )
    dtype = tf.as_dtype(value.dtype)
    if not (dtype.is_floating or dtype.is_integer or dtype.is_bool):
      raise UserError(
        f'compute_loss returned the metric {name!r} as {_describe(value)}; '
        'metrics must be numbers (tf.cast(value, tf.float32))'
      )
  return dict(metrics)


def _called(
  compute_loss: LossFn, batch: Any, training: bool, what: str = 'the first eval batch'
) -> Any:
  """compute_loss(batch, training=training); an error in it (the user's code) that is one of
  the common data mistakes (trainer/data/hints.py) becomes a one-line UserError with the fix,
  the original its __cause__ (launch.py --traceback prints it); any other keeps its traceback
  and gains a line saying which call of the trainer's checks it was."""
  try:
    return compute_loss(batch, training=training)
  except Exception as e:
    shapes = ', '.join(_describe(t) for t in tf.nest.flatten(batch))
    if (fix := hints.hint(e)) is not None:
      raise UserError(
        f'compute_loss(batch, training={training}) on {what} ({shapes}): {fix}'
      ) from e
    e.add_note(
      f'(raised by compute_loss(batch, training={training}) on {what}, {shapes}, when '
      'the trainer checked its hooks: trainer/step/contract.py)'
    )
    raise


def probe(
  batch: Any,
  compute_loss: LossFn,
  stateful: Collection[str] = (),
  overflow: Callable[[], str | None] = lambda: None,
) -> dict:
  """Runs compute_loss eagerly on `batch` (the first eval batch; the call builds the model)
  and checks its result; returns the metrics dict. Call it under the strategy's scope.
  `overflow()`: the layer whose output overflows, in words (trainer/insight/audit.py), asked
  when the loss is not finite."""
  outputs = _called(compute_loss, batch, False)
  metrics = check_outputs(batch, outputs, stateful)
  _warn_nonfinite_loss(outputs[0], overflow)
  return metrics


def check_gradient(batch: Any, compute_loss: LossFn, model: keras.Model) -> None:
  """The default train step's loss has a gradient for at least one trainable variable of
  `model`: compute_loss(batch, training=True) as the step differentiates it (an eval path may
  use other weights, e.g. an average), on the first example of the first eval batch (on all of
  it when the loss fails on one example, e.g. a reshape by the batch size), the state the
  forward pass assigns (BatchNorm statistics) put back. Call it before float8 quantization
  (Keras's float8 layers' custom gradient fails under this eager tape). Checked under TF's
  default strategy only: a distributed variable has no handle outside a replica context."""
  variables = model.trainable_variables
  if not variables or tf.distribute.has_strategy():
    return
  from trainer.step.forward_state import forward_state_kept

  # One example: whether a gradient reaches a variable does not depend on the batch, and an eager
  # tape over the whole batch keeps every activation (it set the peak RSS: docs/guides/memory.md).
  first = tf.nest.map_structure(lambda t: t[:1], batch)
  try:
    with forward_state_kept(model), tf.GradientTape() as tape:
      loss = compute_loss(first, training=True)[0]
  except Exception:  # pylint: disable=broad-except  (the batch below raises it, with a note)
    with forward_state_kept(model), tf.GradientTape() as tape:
      loss = _called(compute_loss, batch, True)[0]
  if all(g is None for g in tape.gradient(tf.convert_to_tensor(loss), variables)):
    with forward_state_kept(model):  # the whole batch's loss, for the message
      loss = compute_loss(batch, training=True)[0]
    raise UserError(
      f'compute_loss returned a loss ({_describe(loss)}) that does not depend on '
      'any trainable variable of the model: no gradient reaches them; compute it '
      'from self.model(inputs, training=training) with TensorFlow ops (not NumPy '
      'or .numpy(), not through tf.stop_gradient)'
    )


def _warn_nonfinite_loss(loss: Any, overflow: Callable[[], str | None]) -> None:
  """A loss already non-finite at the initial weights (log(0), a division by zero, an overflow
  in float16) makes every step a skipped one: one warning line before training starts, naming
  the layer whose output overflows (`overflow()`) when one does."""
  try:
    values = tf.reshape(tf.cast(loss, tf.float32), [-1]).numpy()
  except Exception:  # pylint: disable=broad-except  (not eager: nothing to say)
    return
  bad = int((~np.isfinite(values)).sum())
  if bad:
    kinds = ', '.join(sorted({str(v) for v in values[~np.isfinite(values)]}))
    logging.warning(
      'compute_loss returned a non-finite loss (%s) for %d of %d examples of the first eval '
      'batch, at the initial weights: %s',
      kinds,
      bad,
      values.size,
      overflow()
      or 'every step with such an example will be skipped; look for log(0), a division by '
      'zero or an overflow in the loss (a log of a probability: use from_logits=True losses, '
      'or clip it)',
    )


# Methods the step does not call, under names users expect: an override would never run (an
# EMA written in `apply_gradients` once counted 0 updates over 60 applied steps, without a word).
RETIRED_STEP_METHODS = {
  'apply_gradients': 'each update group is applied by apply_group(index, grads), under its own '
  'finite flag: override apply_group (super().apply_group(index, grads) applies the update)',
  'run': 'the compiled loop (trainer.step.loop.TrainLoop) runs the steps; override step(iterator) '
  'for what one step does',
  'read_outputs': 'the compiled loop (trainer.step.loop.TrainLoop) reads the outputs; a step '
  'returns its outputs from step(iterator)',
  'train_loop': 'the compiled loop is trainer.step.loop.TrainLoop; override step(iterator) for '
  'what one step does',
  # Never a TrainStep method: Keras's Model.train_step, the name a Keras user reaches for.
  'train_step': 'the step is step(iterator), around compute_gradients(batch) on each replica: '
  "override compute_gradients for your own forward and backward pass (Keras's train_step)",
}


def check_step_overrides(cls: type, base: type) -> None:
  """A TrainStep subclass `cls` defines none of the methods the step no longer calls
  (RETIRED_STEP_METHODS): one UserError line naming the method and the hook to override."""
  for name, hint in RETIRED_STEP_METHODS.items():
    owner = next((k for k in cls.__mro__ if name in vars(k)), None)
    if owner is not None and owner is not base and not issubclass(base, owner):
      raise UserError(f'{owner.__name__}.{name} is never called: {hint}')


def step_gradients(step: object, result: Any, variables: Sequence[tf.Variable]) -> tuple:
  """What a step's `compute_gradients` returned, checked while it is traced: (outputs, grads),
  a scalar 'loss', one gradient per variable of `variables` (self.variables, in its order) with
  the variable's shape. A violation is one UserError line naming the step class."""
  name = f'{type(step).__name__}.compute_gradients'
  if not isinstance(result, (tuple, list)) or len(result) != 2:
    raise UserError(
      f'{name} returned {type(result).__name__}; return (outputs, grads): a dict '
      'with the scalar loss and a gradient per variable of self.variables'
    )
  outputs, grads = result
  if not isinstance(outputs, Mapping) and isinstance(grads, Mapping):
    raise UserError(f'{name} returned (grads, outputs); return (outputs, grads)')
  loss = outputs.get('loss') if isinstance(outputs, Mapping) else None
  if loss is not None and getattr(loss, 'shape', None) is not None and loss.shape.rank:
    raise UserError(
      f"{name} returned 'loss' of shape {loss.shape}: return the loss averaged "
      'over the global batch, a scalar (self.share_loss(per_example_loss))'
    )
  grads = list(grads)
  if len(grads) != len(variables):
    raise UserError(
      f'{name} returned {len(grads)} gradients for {len(variables)} variables: '
      'return one per variable of self.variables, in its order (None for none)'
    )
  for g, v in zip(grads, variables):
    shape = getattr(g, 'shape', None) if not isinstance(g, tf.IndexedSlices) else None
    if shape is not None and shape.is_fully_defined() and shape != v.shape:
      raise UserError(
        f'{name} returned a gradient of shape {shape} for '
        f'{variable_name(v)} of shape '
        f'{tuple(v.shape)}: the gradients must follow self.variables, in its order'
      )
  return outputs, grads
