"""The hook contract, checked once before training on one eval batch (no cost per step).

`probe(datasets, compute_loss)` runs the eager forward pass the trainer needs anyway (it builds
the model and tells the metric names) and checks what the user's hooks returned:

  build_datasets() -> Datasets whose `train` and `eval` are batched tf.data.Datasets;
  compute_loss(batch, training=...) -> (loss, {name: value}): the loss floating-point with shape
      [B], every metric numeric with shape [B], B being the batch's leading dimension.

A violation raises UserError: one line naming the hook, what it returned (shapes, dtypes) and
the fix. The check runs before the workdir is opened, so a failed check writes nothing. Shapes
that only broadcast by accident (labels [B, 1] against predictions [B] give a [B, B] metric)
and a batch mean returned in place of per-example values (shape []) are caught here; an
unbatched eval set is caught from its element_spec before the model sees it (the model would
fail deep inside a kernel).
"""
from __future__ import annotations

from collections.abc import Mapping

import tensorflow as tf

from trainer.errors import UserError


def _describe(value) -> str:
  """'float32 [128, 10]' for a tensor-like, the type name otherwise."""
  if hasattr(value, 'shape') and hasattr(value, 'dtype'):
    dtype = tf.as_dtype(value.dtype).name
    return f'{dtype} {_shape(value.shape)}'
  return type(value).__name__


def _shape(shape) -> str:
  return '[' + ', '.join('?' if d is None else str(d) for d in tf.TensorShape(shape)) + ']'


def _spec_summary(spec) -> str:
  return ', '.join(f'{s.dtype.name} {_shape(s.shape)}' for s in tf.nest.flatten(spec)
                   if isinstance(s, tf.TensorSpec)) or str(spec)


def check_datasets(datasets) -> None:
  """Structure checks on build_datasets()'s result, from element_specs (no data is read)."""
  fields = ('train', 'eval', 'train_examples')
  if not all(hasattr(datasets, f) for f in fields):
    raise UserError(f'build_datasets returned {type(datasets).__name__}; return '
                    'trainer.Datasets(train=..., eval=..., train_examples=...)')
  for name in ('train', 'eval'):
    ds = getattr(datasets, name)
    if not isinstance(ds, tf.data.Dataset):
      raise UserError(f'build_datasets returned Datasets.{name} of type {type(ds).__name__}; '
                      'it must be a tf.data.Dataset (tf.data.Dataset.from_tensor_slices(...)'
                      '.batch(...))')
    specs = [s for s in tf.nest.flatten(ds.element_spec) if isinstance(s, tf.TensorSpec)]
    # Every batched component has a leading batch axis; a rank-0 component (a single label)
    # means the dataset yields single examples.
    if any(s.shape.rank == 0 for s in specs):
      batch = ('.batch(config.train.batch_size, drop_remainder=True)' if name == 'train'
               else '.batch(config.train.batch_size)')
      raise UserError(f'build_datasets returned an unbatched Datasets.{name}: its elements are '
                      f'single examples ({_spec_summary(ds.element_spec)}); add {batch}')
  train = tf.nest.flatten(datasets.train.element_spec)
  eval_ = tf.nest.flatten(datasets.eval.element_spec)
  if len(train) == len(eval_):
    for t, e in zip(train, eval_):
      if (isinstance(t, tf.TensorSpec) and isinstance(e, tf.TensorSpec)
          and t.shape.rank is not None and e.shape.rank is not None
          and e.shape.rank + 1 == t.shape.rank):
        raise UserError('build_datasets returned an unbatched Datasets.eval: its elements '
                        f'({_spec_summary(datasets.eval.element_spec)}) have one axis fewer '
                        f'than the train batches ({_spec_summary(datasets.train.element_spec)}); '
                        'add .batch(config.train.batch_size) to the eval dataset')


def _batch_size(batch) -> int | None:
  sizes = {int(t.shape[0]) for t in tf.nest.flatten(batch)
           if hasattr(t, 'shape') and t.shape.rank and t.shape[0] is not None}
  return sizes.pop() if len(sizes) == 1 else None


def check_outputs(batch, outputs, stateful=()) -> dict:
  """Checks compute_loss's result on `batch`; returns the metrics dict. Entries named in
  `stateful` (the Trainer's build_metrics()) are update_state arguments, not [B] values."""
  if not (isinstance(outputs, (tuple, list)) and len(outputs) == 2
          and isinstance(outputs[1], Mapping)):
    what = (f'a {type(outputs).__name__} of {len(outputs)}' if isinstance(outputs, (tuple, list))
            else _describe(outputs))
    raise UserError(f'compute_loss returned {what}; return a pair (per-example loss [B], '
                    '{metric name: per-example value [B]}), e.g. `return loss, {}` when there '
                    'are no metrics')
  loss, metrics = outputs
  b = _batch_size(batch)
  batch_shapes = ', '.join(_describe(t) for t in tf.nest.flatten(batch))
  labelish = [t for t in tf.nest.flatten(batch)
              if hasattr(t, 'shape') and t.shape.rank == 2 and t.shape[-1] == 1]
  hint_11 = (f'; the batch holds a {_describe(labelish[0])} tensor: flatten labels to [B] '
             '(y.reshape(-1) or tf.squeeze(y, -1)) so they compare with predictions [B]'
             if labelish else '; a [B, 1] tensor compared with a [B] one broadcasts to '
             '[B, B]: flatten it to [B]')

  def per_example(kind: str, value, fix_scalar: str):
    if not hasattr(value, 'shape') or not hasattr(value, 'dtype'):
      raise UserError(f'compute_loss returned {kind} of type {type(value).__name__}; return a '
                      'tensor with one value per example, shape [B]')
    shape = tf.TensorShape(value.shape)
    got = _describe(value)
    if shape.rank == 0:
      raise UserError(f'compute_loss returned {kind} as a scalar ({got}) for a batch of {b} '
                      f'({batch_shapes}); {fix_scalar}')
    if b is not None and shape.rank == 2 and shape[0] == b and shape[1] == b and b > 1:
      raise UserError(f'compute_loss returned {kind} of shape {_shape(shape)} ({got}) for a '
                      f'batch of {b}: two shapes broadcast against each other{hint_11}')
    if shape.rank != 1:
      raise UserError(f'compute_loss returned {kind} of shape {_shape(shape)} ({got}) for a '
                      f'batch of {b} ({batch_shapes}); it must be [B]: reduce the other axes '
                      'per example (e.g. tf.reduce_mean(x, axis=-1)) or use a per-example '
                      'loss such as keras.losses.sparse_categorical_crossentropy')
    if b is not None and shape[0] is not None and shape[0] != b:
      raise UserError(f'compute_loss returned {kind} of shape {_shape(shape)} ({got}) for a '
                      f'batch of {b} ({batch_shapes}); it must have one value per example, '
                      f'[{b}]')

  per_example('the loss', loss, 'return the per-example loss, shape [B] (drop the '
              'tf.reduce_mean: the trainer averages over the global batch)')
  if not tf.as_dtype(loss.dtype).is_floating:
    raise UserError(f'compute_loss returned the loss as {_describe(loss)}; it must be '
                    'floating-point (tf.cast(loss, tf.float32))')
  for name, value in metrics.items():
    if name in stateful:
      if not isinstance(value, (tuple, list)):
        raise UserError(f'compute_loss returned the stateful metric {name!r} as '
                        f'{_describe(value)}; return the tuple of its update_state arguments, '
                        f'e.g. {{{name!r}: (labels, predictions)}}')
      continue
    if not isinstance(name, str):
      raise UserError(f'compute_loss returned a metric named {name!r}; metric names are '
                      'strings')
    per_example(f'the metric {name!r}', value, 'return one value per example, shape [B] (the '
                'trainer averages it; a batch mean would be divided by the batch again)')
    dtype = tf.as_dtype(value.dtype)
    if not (dtype.is_floating or dtype.is_integer or dtype.is_bool):
      raise UserError(f'compute_loss returned the metric {name!r} as {_describe(value)}; '
                      'metrics must be numbers (tf.cast(value, tf.float32))')
  return dict(metrics)


def probe(datasets, compute_loss, stateful=()) -> dict:
  """Checks the datasets, runs compute_loss eagerly on the first eval batch (which builds the
  model) and checks its result; returns the metrics dict. Call it under the strategy's scope."""
  check_datasets(datasets)
  batch = next(iter(datasets.eval.take(1)), None)
  if batch is None:
    raise UserError('build_datasets: Datasets.eval yielded no batch (an empty eval set, or one '
                    'filtered or batched with drop_remainder=True down to nothing); give it at '
                    'least one example.')
  return check_outputs(batch, compute_loss(batch, training=False), stateful)
