"""Restoring the newest readable checkpoint in a `tf.train.CheckpointManager`'s folder.

Writes are already atomic in TensorFlow: `Checkpoint.write` puts the data and index files in a
temporary folder and renames them into place, and the manager rewrites its `checkpoint` state file
with an atomic rename after that; a process killed mid-save leaves the previous checkpoint named
in the state file and loadable (tests/test_reliability_checkpoints.py kills one mid-save). What can
still happen is a damaged file (a full disk, a bad copy): then the newest checkpoint that reads
is restored, with a warning naming the ones skipped.

The state file `checkpoints/checkpoint` only names the checkpoints; the `ckpt-N.index` files are
what exists. When the state file is missing, empty or garbled while ckpt-N files are on disk, the
candidates are those files, newest N first, with a warning: never a silent restart from step 0
over existing checkpoints. (`repair_state` then rewrites the state file, so that a
CheckpointManager opened for training knows them and rotates them.)

Nothing here writes, except `repair_state`: restoring works on a read-only run folder.

A save that cannot write (disk full, quota,
file-size limit) is a UserError naming the checkpoint and the reason; its partial files are
removed and the previous checkpoint stays the newest one in the state file (`save`).
"""
from __future__ import annotations

import glob
import os
import re
import shutil

import tensorflow as tf
from absl import logging
from tensorflow.core.protobuf import trackable_object_graph_pb2

from trainer.errors import UserError

# Checkpoint items added after checkpoints were first written: a checkpoint without them still
# restores (they keep their initial values). Any other missing item is a mismatch.
LATER_ITEMS = ('consecutive_skips', 'actions')


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
      if name != 'actions':  # an action added on resume starts fresh; a removed one's is left
        status.assert_existing_objects_matched()
      status.expect_partial()  # the other items are restored by their own Checkpoint
    except (AssertionError, ValueError) as e:
      # Other variables (AssertionError) or shapes (ValueError) than the item's; any other
      # ValueError is a damaged file.
      if isinstance(e, ValueError) and 'incompatible tensor with shape' not in str(e):
        raise
      first = (str(e).strip().splitlines() or [''])[0]
      raise Mismatch(f'its {name!r} does not match this run\'s ({first[:160]})', name) from e


def restore_newest_readable(items: dict, directory: str) -> str | None:
  """Restores the newest checkpoint in `directory` that loads and matches `items` ({name:
  trackable}); returns its path, or None when the folder holds none. Raises UserError when
  there are some and none loads."""
  candidates = find(directory, warn=True)
  failures = []  # (path, reason, the exception)
  for path in candidates:
    try:
      restore(items, path)
    # A damaged file surfaces as OpError (DataLoss, NotFound), IndexError, ValueError, a
    # protobuf DecodeError ...; a structure mismatch as Mismatch.
    except Exception as e:  # pylint: disable=broad-except
      lines = str(e).strip().splitlines()
      reason = f'{type(e).__name__}: {lines[0][:200] if lines else ""}'.rstrip(': ')
      what = 'does not match this run' if isinstance(e, Mismatch) else 'is unreadable'
      logging.warning('checkpoint %s %s (%s); trying the previous one', path, what, reason)
      failures.append((path, reason, e))
      continue
    if failures:
      logging.warning('restored %s instead of the newer unreadable %s', path,
                      ', '.join(p for p, _, _ in failures))
    return path
  if failures:
    names = ', '.join(os.path.basename(p) for p, _, _ in failures)
    if all(isinstance(e, Mismatch) for _, _, e in failures):
      item = failures[0][2].item
      what = {'model': "another model than the one build_model() makes now (its layers or "
                       "their sizes changed since this run began): resume with the model as it "
                       "was",
              'optimizer': 'another optimizer state than config.optimizer builds now (its '
                           'name or kind changed since this run began): resume with the '
                           'optimizer as it was'}
      hint = 'they hold ' + what.get(
          item, f"other {item or 'state'} than this run builds now (a checkpoint_items() entry "
          'changed since this run began): resume with it as it was')
    else:
      hint = 'were they written by another model or config?'
    raise UserError(f'no checkpoint in {directory} can be restored (tried {names}; '
                    f'newest: {failures[0][1]}); {hint}. Use a new --workdir, or delete that '
                    'folder to start over.')
  return None


STATE_FILE = 'checkpoint'


def on_disk(directory: str) -> list[str]:
  """Prefixes of the ckpt-N checkpoints in `directory` that have an index file, newest N first."""
  found = []
  for name in tf.io.gfile.glob(os.path.join(directory, 'ckpt-*.index')):
    match = re.fullmatch(r'ckpt-(\d+)\.index', os.path.basename(name))
    if match:
      found.append((int(match.group(1)), name[:-len('.index')]))
  return [path for _, path in sorted(found, reverse=True)]


def state_problem(directory: str) -> str | None:
  """'missing', 'empty' or 'unreadable (...)' when the state file cannot name the checkpoints;
  None when it is fine."""
  path = os.path.join(directory, STATE_FILE)
  if not tf.io.gfile.exists(path):
    return 'missing'
  try:
    if not tf.io.gfile.GFile(path, 'rb').read().strip():
      return 'empty'
    state = tf.train.get_checkpoint_state(directory)  # None when it does not parse
  except Exception as e:  # pylint: disable=broad-except  # a folder, unreadable, ...
    return f'unreadable ({type(e).__name__})'
  if state is None or not state.model_checkpoint_path:
    return 'unreadable (not a checkpoint state)'
  return None


def find(directory: str, warn: bool = False) -> list[str]:
  """The checkpoints to try, newest first: those the state file names, then any others on disk;
  only those on disk when the state file is missing, empty or garbled (`warn`: say so)."""
  if not tf.io.gfile.isdir(directory):
    return []
  disk = on_disk(directory)
  problem = state_problem(directory)
  if problem is not None:
    if disk and warn:
      logging.warning('%s is %s; using the checkpoints on disk, newest first: %s',
                      os.path.join(directory, STATE_FILE), problem,
                      ', '.join(os.path.basename(p) for p in disk))
    return disk
  state = tf.train.get_checkpoint_state(directory)
  candidates = list(reversed(state.all_model_checkpoint_paths))
  if state.model_checkpoint_path not in candidates:
    candidates.insert(0, state.model_checkpoint_path)
  named = {os.path.basename(p) for p in candidates}
  return candidates + [p for p in disk if os.path.basename(p) not in named]


def repair_state(directory: str, restored: str) -> None:
  """Rewrites a missing, empty or garbled state file to name `restored` (newest) and the older
  ckpt-N files on disk, so that rotation (max_to_keep) knows them. A no-op when it is fine."""
  if state_problem(directory) is None:
    return
  older = [p for p in reversed(on_disk(directory)) if step_of(p) < step_of(restored)]
  paths = older + [restored]
  # With their times the manager treats them as its own and rotates them (max_to_keep).
  times = [os.path.getmtime(p + '.index') for p in paths]
  tf.compat.v1.train.update_checkpoint_state(
      directory, restored, all_model_checkpoint_paths=paths,
      all_model_checkpoint_timestamps=times, last_preserved_timestamp=min(times) - 1)
  logging.warning('rewrote %s naming %s', os.path.join(directory, STATE_FILE),
                  ', '.join(os.path.basename(p) for p in older + [restored]))


def step_of(path: str) -> int:
  """N of a ckpt-N checkpoint path (0 for a name without a number)."""
  match = re.search(r'-(\d+)$', path)
  return int(match.group(1)) if match else 0


def save(manager: tf.train.CheckpointManager, step: int, *, resumed_from: bool = True) -> str:
  """`manager.save(checkpoint_number=step)`; a failed write raises UserError (one line: the
  checkpoint, the reason, the previous checkpoint that is still the newest, and, when
  `resumed_from`, that the same command resumes from it)."""
  try:
    return manager.save(checkpoint_number=step)
  except (tf.errors.OpError, OSError) as e:
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
    kept = (f'; {newest} is intact' + (' and is where the same command resumes'
                                       if resumed_from else '')) if newest else ''
    raise UserError(f'could not write checkpoint {prefix} at step {step} ({_reason(e)}); free '
                    f'disk space or raise the quota{kept}') from None


def _remove(path: str) -> None:
  try:
    os.remove(path)
  except OSError:
    pass


def _reason(e: Exception) -> str:
  """'No space left on device' from an OSError or from TF's '...; No space left on device
  [Op:SaveV2]'."""
  if isinstance(e, OSError) and e.strerror:
    return e.strerror
  text = ' '.join(str(e).split())
  text = re.sub(r'\s*\[Op:\w+\]\s*$', '', text)
  return text.rsplit('; ', 1)[-1][:200] or type(e).__name__
