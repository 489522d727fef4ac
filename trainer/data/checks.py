"""The data contract: build_datasets()'s result checked from its element specs (no data read),
and the first eval batch, read once, that the hook checks (trainer/step/contract.py), the
numerics probe and the audit run on. A violation raises UserError: one line naming the hook,
what it returned and the fix, before the workdir is opened."""

from __future__ import annotations

import contextlib

import tensorflow as tf
from absl import logging

from trainer.errors import ConfigError, UserError


def shape_text(shape) -> str:
  """'[128, ?, 10]'."""
  return '[' + ', '.join('?' if d is None else str(d) for d in tf.TensorShape(shape)) + ']'


# The batching each set needs (train: a fixed size, as the loss is divided by it).
_BATCH = {
  'train': '.batch(config.train.batch_size, drop_remainder=True)',
  'eval': '.batch(config.train.batch_size)',
}


def _spec_summary(spec) -> str:
  return ', '.join(
    f'{s.dtype.name} {shape_text(s.shape)}'
    for s in tf.nest.flatten(spec)
    if isinstance(s, tf.TensorSpec)
  ) or str(spec)


def check_datasets(datasets, batch_size: int | None = None, eval_max_batches: int = 0) -> None:
  """Structure checks on build_datasets()'s result, from element_specs (no data is read).
  With `batch_size` (config.train.batch_size), the train batches' size is checked against it;
  with `eval_max_batches` (config.train.eval_max_batches > 0), an eval set tf.data knows to be
  longer is refused."""
  fields = ('train', 'eval', 'train_examples')
  if not all(hasattr(datasets, f) for f in fields):
    raise UserError(
      f'build_datasets returned {type(datasets).__name__}; return '
      'trainer.Datasets(train=..., eval=..., train_examples=...)'
    )
  for name in ('train', 'eval'):
    ds = getattr(datasets, name)
    if not isinstance(ds, tf.data.Dataset):
      raise UserError(
        f'build_datasets returned Datasets.{name} of type {type(ds).__name__}; '
        'it must be a tf.data.Dataset (tf.data.Dataset.from_tensor_slices(...)'
        '.batch(...))'
      )
    specs = [s for s in tf.nest.flatten(ds.element_spec) if isinstance(s, tf.TensorSpec)]
    # Every batched component has a leading batch axis; a rank-0 component (a single label)
    # means the dataset yields single examples.
    if any(s.shape.rank == 0 for s in specs):
      raise UserError(
        f'build_datasets returned an unbatched Datasets.{name}: its elements are '
        f'single examples ({_spec_summary(ds.element_spec)}); add {_BATCH[name]}'
      )
  # A set whose elements are, in every component, the other's batches without their batch axis
  # is unbatched: sequences [T] against batches [B, T]. Not a multi-crop or two-view set (only
  # the images have the extra axis: [B, 10, H, W, C] against [B, H, W, C], labels [B] both), nor
  # train batches of unknown size against eval crops with per-crop labels. Checked before the
  # batch size, which would take T for it.
  train = tf.nest.flatten(datasets.train.element_spec)
  eval_ = tf.nest.flatten(datasets.eval.element_spec)
  pairs = [
    (t.shape, e.shape)
    for t, e in zip(train, eval_)
    if isinstance(t, tf.TensorSpec)
    and isinstance(e, tf.TensorSpec)
    and t.shape.rank is not None
    and e.shape.rank is not None
  ]
  if pairs and len(train) == len(eval_):
    for short, other, unbatched in (
      (
        'eval',
        'train',
        all(e.rank + 1 == t.rank and e.is_compatible_with(t[1:]) for t, e in pairs),
      ),
      (
        'train',
        'eval',
        all(
          t.rank + 1 == e.rank and t.is_compatible_with(e[1:]) and t[0] is not None
          for t, e in pairs
        ),
      ),
    ):
      if unbatched:
        raise UserError(
          f'build_datasets returned an unbatched Datasets.{short}: its elements '
          f'({_spec_summary(getattr(datasets, short).element_spec)}) have one '
          f'axis fewer than the {other} batches '
          f'({_spec_summary(getattr(datasets, other).element_spec)}); add {_BATCH[short]} '
          f'to the {short} dataset'
        )
  _check_eval_ends(datasets.eval, eval_max_batches)
  if batch_size:
    _check_train_batch(datasets.train, batch_size)


def _check_eval_ends(eval_set, max_batches: int = 0) -> None:
  """An eval is one pass over Datasets.eval: a set tf.data knows to be infinite (a `.repeat()`)
  would make every eval, the final one included, run for ever; one known to be longer than
  `max_batches` (> 0, config.train.eval_max_batches) is refused too. A set of unknown length (a
  filter, a generator) is checked against that bound as it is read (EvalLoop.run); a long eval
  prints its progress (Runner.evaluate)."""
  cardinality = int(eval_set.cardinality())
  if cardinality == tf.data.INFINITE_CARDINALITY:
    raise UserError(
      'build_datasets returned an infinite Datasets.eval (its cardinality is INFINITE: a '
      '.repeat()): an eval is one pass over it and would never end; drop the .repeat() '
      'from the eval dataset (only Datasets.train may repeat)'
    )
  if max_batches > 0 and cardinality > max_batches:
    raise ConfigError(
      f'build_datasets returned a Datasets.eval of {cardinality} batches, more than '
      f'config.train.eval_max_batches={max_batches}: raise the bound (0 = none) or take fewer '
      'eval batches (.take(n))'
    )


def _check_train_batch(train, batch_size: int) -> None:
  """The trainer divides the summed loss by config.train.batch_size: train batches of another
  size silently rescale the loss (and so the learning rate); an error. Batches of unknown size
  (no drop_remainder=True) end each pass with a smaller one: a warning."""
  specs = [
    s for s in tf.nest.flatten(train.element_spec) if isinstance(s, tf.TensorSpec) and s.shape.rank
  ]
  sizes = {s.shape[0] for s in specs}
  if not sizes:
    return
  got = _spec_summary(train.element_spec)
  if None in sizes:
    logging.warning(
      'build_datasets returned Datasets.train with batches of unknown size (%s): '
      'unless the data is repeated before .batch(), the last batch of each pass '
      'is smaller, its examples weigh less (the loss is divided by '
      'config.train.batch_size=%d) and it may not split over the replicas; use '
      '.batch(config.train.batch_size, drop_remainder=True), which also makes the '
      'size known',
      got,
      batch_size,
    )
  elif batch_size not in sizes:
    size = ' or '.join(str(n) for n in sorted(sizes))
    raise UserError(
      f'build_datasets returned Datasets.train with leading dimension {size} '
      f'({got}), not config.train.batch_size={batch_size} (unbatched, or batched '
      'by another size): the trainer divides the loss by '
      'config.train.batch_size, so the loss and the learning rate would be off; '
      'batch with .batch(config.train.batch_size, drop_remainder=True)'
    )


_FIRST_BATCH = '_trainer_first_batch'  # an attribute of the eval dataset


def first_eval_batch(datasets):
  """The first batch of `datasets.eval` (checked by check_datasets), which the checks below
  run on; an error when the eval set is empty. Read once per eval dataset: later calls return
  the same batch."""
  # The batch is kept on the dataset with the iterator that read it: dropping an iterator that
  # read part of a `.cache()` while a consumer after it (a prefetch, a parallel map) still reads
  # can finalize the cache with what was read so far (TF's memory cache takes its cancelled
  # upstream's end of input for the true end), truncating every later evaluation (seen with
  # `batch().map().cache().prefetch()` on a loaded machine: 4 or 5 of 6 images). A live iterator
  # never ends; the first full evaluation completes the cache. Both go with the dataset (a cycle
  # the garbage collector frees).
  kept = getattr(datasets.eval, _FIRST_BATCH, None)
  if kept is not None:
    return kept[0]
  iterator = iter(datasets.eval)
  batch = next(iterator, None)
  if batch is None:
    raise UserError(
      'build_datasets returned an empty Datasets.eval (it yields no batch: an empty '
      'source, a filter, or drop_remainder=True on fewer examples than a batch; '
      f'{_spec_summary(datasets.eval.element_spec)}): the eval set needs at least '
      'one example'
    )
  # A dataset that takes no attributes: nothing kept.
  with contextlib.suppress(AttributeError, TypeError):
    setattr(datasets.eval, _FIRST_BATCH, (batch, iterator))
  return batch
