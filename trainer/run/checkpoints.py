"""Restoring the newest readable checkpoint in a `tf.train.CheckpointManager`'s folder.

TensorFlow's writes are atomic (`Checkpoint.write` renames its files into place, then the manager
renames its new `checkpoint` state file): a process killed mid-save leaves the previous
checkpoint named and loadable (tests/run/test_reliability_checkpoints.py). A damaged file (a full
disk, a bad copy) can still happen: the newest checkpoint that reads is restored, with a warning
naming the ones skipped. The candidates, newest first: `checkpoint_files.find`.

A restored checkpoint's variables (`variables`: Keras and plain tf.Variables, the loss scaler's,
the actions' state) must be finite. For training, a non-finite one is skipped with a warning and
the previous one restored; read-only (eval, export, diagnose) it is a one-line error.

Restoring writes nothing: it works on a read-only run folder. A save that cannot write (disk
full, quota, file-size limit) is a UserError naming the checkpoint and the reason; its partial
files are removed and the previous checkpoint stays the newest one in the state file (`save`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil

import keras
import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.core.protobuf import trackable_object_graph_pb2

from trainer.errors import UserError, message_line
from trainer.nn.paths import variable_name
from trainer.run.checkpoint_files import find
from trainer.step.eager_then_compiled import EagerThenCompiled
from trainer.step.loss_scale import all_finite

# Checkpoint items added after checkpoints were first written: a checkpoint without them still
# restores (they keep their initial values). Any other missing item is a mismatch.
LATER_ITEMS = ('consecutive_skips', 'actions', 'lr_factor')


class Mismatch(AssertionError):
  """A checkpoint that reads fine but holds other state than `items`; `item` names the
  checkpoint item at fault (None: items are missing)."""

  def __init__(self, message: str, item: str | None = None):
    super().__init__(message)
    self.item = item


def restore(items: dict, path: str) -> None:
  """Restores `items` ({name: trackable}, as saved by tf.train.Checkpoint(**items)) from
  `path`; raises Mismatch naming what does not match."""
  graph = trackable_object_graph_pb2.TrackableObjectGraph()
  graph.ParseFromString(tf.train.load_checkpoint(path).get_tensor('_CHECKPOINTABLE_OBJECT_GRAPH'))
  present = {child.local_name for child in graph.nodes[0].children}  # the root's items
  missing = [k for k in items if k not in present and k not in LATER_ITEMS]
  if missing:
    raise Mismatch(f'the checkpoint has no {", ".join(missing)}')
  # One item at a time, so a mismatch names the item (the model, the optimizer, ...).
  for name, item in items.items():
    if name not in present:
      continue
    try:
      status = tf.train.Checkpoint(**{name: item}).restore(path)
      status.expect_partial()  # the other items are restored by their own Checkpoint
      if name != 'actions':  # an action added on resume starts fresh; a removed one's is left
        status.assert_existing_objects_matched()
    except (AssertionError, ValueError) as e:
      _partial(e)
      # Other variables (AssertionError) or shapes (ValueError) than the item's; any other
      # ValueError is a damaged file.
      if isinstance(e, ValueError) and 'incompatible tensor with shape' not in str(e):
        raise
      first = message_line(e)
      raise Mismatch(f"its {name!r} does not match this run's ({first[:160]})", name) from e


def _partial(e: BaseException) -> None:
  """A restore that failed half-way leaves TF's restore coordinator in the traceback, to log a
  'Value in checkpoint could not be found' line per variable when collected (at exit, after the
  one-line error): each frame's coordinator is marked partial, as status.expect_partial() does."""
  tb = e.__traceback__
  while tb is not None:
    for value in tb.tb_frame.f_locals.values():
      getattr(getattr(value, '_deleter', None), 'set_expect_partial', lambda _: None)(True)
    tb = tb.tb_next


def variables(items: dict) -> list[tf.Variable]:
  """Every variable a `tf.train.Checkpoint(**items)` saves, each once: the Keras variables of
  models and optimizers (their tf.Variable), plain tf.Variables (the global step, the loss
  scaler's, the actions' state) and those of any tf.Module in `items`."""
  seen, found = set(), []
  root = tf.train.Checkpoint(**items)  # held: the view keeps only a weak reference
  for obj in tf.train.TrackableView(root).descendants():
    v = obj.value if isinstance(obj, keras.Variable) else obj
    if isinstance(v, tf.Variable) and id(v) not in seen:
      seen.add(id(v))
      found.append(v)
  return found


def nonfinite(variables_: list) -> list[str]:
  """The names of the floating variables holding inf or NaN (one reduction on the device; the
  names are looked up only when one is not finite)."""
  floats = [v for v in variables_ if v.dtype.is_floating]
  if not floats or bool(_all_finite(floats)):
    return []
  return [variable_name(v) for v in floats if not np.isfinite(v.numpy()).all()]


# Eager for the first saves: compiling the check over every variable costs as much as dozens
# of eager checks (docs/references.md, "Start-up"), and many runs save fewer times.
_all_finite = EagerThenCompiled(
  lambda variables_: all_finite([v.read_value() for v in variables_]),
  eager_calls=50,
  eager_seconds=0.3,
  autograph=False,
)


def describe_nonfinite(bad: list[str]) -> str:
  return f'inf or NaN in {len(bad)} variable(s), first: {", ".join(bad[:3])}'


def restore_newest_readable(items: dict, directory: str, *, read_only: bool = False) -> str | None:
  """Restores the newest checkpoint in `directory` that loads, matches `items` ({name:
  trackable}) and holds only finite values; returns its path, or None when the folder holds
  none. Raises UserError when there are some and none loads. `read_only` (eval, export,
  diagnose): a non-finite checkpoint is a UserError instead of a fallback, and a checkpoint
  that disappears while it is read (a live run rotated it away) sends it back to the state
  file for the newer ones, a few times."""
  items_variables = variables(items)
  failures: list[tuple[str, str, Exception]] = []  # (path, reason, the exception)
  retried = set()  # checkpoints found gone once (read_only)
  for _ in range(5):
    gone = False
    for path in find(directory, warn=True):
      if any(p == path for p, _, _ in failures):
        continue
      try:
        restore(items, path)
      # A damaged file surfaces as OpError (DataLoss, NotFound), IndexError, ValueError, a
      # protobuf DecodeError ...; a structure mismatch as Mismatch.
      except Exception as e:  # pylint: disable=broad-except
        if (
          read_only
          and path not in retried
          and (not tf.io.gfile.exists(path + '.index') or path not in find(directory))
        ):
          retried.add(path)
          gone = True  # deleted by rotation while we read it: read the state file again
          logging.warning(
            'checkpoint %s was removed while it was read (the run is training); '
            'trying the newest one again',
            path,
          )
          break
        lines = str(e).strip().splitlines()
        reason = f'{type(e).__name__}: {lines[0][:200] if lines else ""}'.rstrip(': ')
        what = 'does not match this run' if isinstance(e, Mismatch) else 'is unreadable'
        logging.warning('checkpoint %s %s (%s); trying the previous one', path, what, reason)
        failures.append((path, reason, e))
        continue
      bad = nonfinite(items_variables)
      if bad:
        if read_only:
          raise UserError(
            f'checkpoint {path} holds a non-finite state ({describe_nonfinite(bad)})'
            '; it cannot be evaluated or exported. Training from this workdir '
            'falls back to the newest finite checkpoint; evaluate that one once '
            'a save has replaced this.'
          )
        logging.warning(
          'checkpoint %s holds a non-finite state (%s); trying the previous one',
          path,
          describe_nonfinite(bad),
        )
        failures.append((path, f'non-finite ({describe_nonfinite(bad)})', NonFinite()))
        continue
      if failures:
        logging.warning(
          'restored %s instead of the newer %s', path, ', '.join(p for p, _, _ in failures)
        )
      return path
    if not gone:
      break
  if failures:
    names = ', '.join(os.path.basename(p) for p, _, _ in failures)
    if all(isinstance(e, Mismatch) for _, _, e in failures):
      item = getattr(failures[0][2], 'item', None)
      held = {
        'model': 'another model than the one build_model() makes now (its layers or '
        'their sizes changed since this run began): resume with the model as it '
        'was',
        'optimizer': 'another optimizer state than config.optimizer builds now (its '
        'name or kind changed since this run began): resume with the '
        'optimizer as it was',
      }
      hint = 'they hold ' + held.get(
        str(item),
        f'other {item or "state"} than this run builds now (a checkpoint_items() '
        'entry changed since this run began): resume with it as it was',
      )
    elif all(isinstance(e, NonFinite) for _, _, e in failures):
      hint = 'every one holds a non-finite state'
    else:
      hint = 'were they written by another model or config?'
    # Read-only, the run may be live or archived: never advise deleting its files.
    todo = (
      'Check --workdir and --config.'
      if read_only
      else 'Use a new --workdir, or delete that folder to start over.'
    )
    raise UserError(
      f'no checkpoint in {directory} can be restored (tried {names}; '
      f'newest: {failures[0][1]}); {hint}. {todo}'
    )
  return None


class NonFinite(Exception):
  """A checkpoint that reads but holds inf or NaN (a failure kind of restore_newest_readable)."""


def save(
  manager: tf.train.CheckpointManager,
  step: int,
  *,
  resumed_from: bool = True,
  options: tf.train.CheckpointOptions | None = None,
) -> str:
  """`manager.save(checkpoint_number=step)`; a failed write raises UserError (one line: the
  checkpoint, the reason, the previous checkpoint that is still the newest, and, when
  `resumed_from`, that the same command resumes from it)."""
  try:
    return manager.save(checkpoint_number=step, options=options)
  except (tf.errors.OpError, OSError) as e:
    _failed(manager, step, e, resumed_from)
    raise  # (not reached: _failed raises)


def sync(checkpoint: tf.train.Checkpoint, manager: tf.train.CheckpointManager, step: int) -> None:
  """Waits for `checkpoint`'s background write of ckpt-<step> (async_checkpoint); a failed
  write is the one-line UserError of `save`."""
  try:
    checkpoint.sync()
  except (tf.errors.OpError, OSError) as e:
    _failed(manager, step, e, True)


def _failed(manager, step: int, e: Exception, resumed_from: bool) -> None:
  """Removes what the failed write of ckpt-<step> left and raises its UserError."""
  directory = manager.directory
  try:
    state = tf.train.get_checkpoint_state(directory)
  except Exception:  # pylint: disable=broad-except  (a garbled state file: name no checkpoint)
    state = None
  newest = state.model_checkpoint_path if state else None
  prefix = os.path.join(directory, f'ckpt-{step}')
  if newest != prefix:  # never listed: remove what the failed write left behind
    pattern = glob.escape(prefix)
    for path in glob.glob(pattern + '_temp*') + glob.glob(pattern + '.*'):
      if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
      else:
        _remove(path)
  kept = (
    (f'; {newest} is intact' + (' and is where the same command resumes' if resumed_from else ''))
    if newest
    else ''
  )
  raise UserError(
    f'could not write checkpoint {prefix} at step {step} ({_reason(e)}); free '
    f'disk space or raise the quota{kept}'
  ) from None


def remove(prefix: str) -> None:
  """Deletes the files of checkpoint `prefix` (ckpt-N.index, ckpt-N.data-*), nothing else."""
  pattern = glob.escape(prefix)
  for path in glob.glob(pattern + '.index') + glob.glob(pattern + '.data-*'):
    _remove(path)


def _remove(path: str) -> None:
  with contextlib.suppress(OSError):
    os.remove(path)


def _reason(e: Exception) -> str:
  """'No space left on device' from an OSError or from TF's '...; No space left on device
  [Op:SaveV2]'."""
  if isinstance(e, OSError) and e.strerror:
    return e.strerror
  text = ' '.join(str(e).split())
  text = re.sub(r'\s*\[Op:\w+\]\s*$', '', text)
  return text.rsplit('; ', 1)[-1][:200] or type(e).__name__
