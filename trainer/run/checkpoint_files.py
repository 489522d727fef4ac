"""The ckpt-N files of a run's checkpoint folder, and the state file that names them.

The state file `checkpoints/checkpoint` only names the checkpoints; the `ckpt-N.index` files are
what exists. When the state file is missing, empty or garbled while ckpt-N files are on disk, the
candidates are those files, newest N first, with a warning: never a silent restart from step 0
over existing checkpoints (`repair_state` then rewrites the state file: training rotates them).

Checkpoint paths stay inside the run. Only ckpt-N files in the folder itself are read, listed or
deleted: a state file naming a checkpoint by an absolute path (a run copied with `cp -r` or moved
after TensorFlow or an older `repair_state` wrote one) or in another folder stands for the
checkpoint of the same name in this folder, or is ignored with a warning when this folder has
none. Before a CheckpointManager opens the folder for training, `own_state` rewrites such a state
file with relative names, so that rotation (max_to_keep) can only delete this folder's files; the
state file is always written with relative paths. Nothing else here writes.
"""

from __future__ import annotations

import os
import re

import tensorflow as tf
from absl import logging
from google.protobuf import text_format
from tensorflow.python.checkpoint import checkpoint_management

STATE_FILE = 'checkpoint'


def on_disk(directory: str) -> list[str]:
  """Prefixes of the ckpt-N checkpoints in `directory` that have an index file, newest N first."""
  found = []
  for name in tf.io.gfile.glob(os.path.join(directory, 'ckpt-*.index')):
    match = re.fullmatch(r'ckpt-(\d+)\.index', os.path.basename(name))
    if match:
      found.append((int(match.group(1)), name[: -len('.index')]))
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
  only those on disk when the state file is missing, empty or garbled (`warn`: say so). Every
  path is in `directory` (the module docstring: a name elsewhere stands for this folder's
  checkpoint of that name, or is left out)."""
  if not tf.io.gfile.isdir(directory):
    return []
  disk = on_disk(directory)
  problem = state_problem(directory)
  if problem is not None:
    if disk and warn:
      logging.warning(
        '%s is %s; using the checkpoints on disk, newest first: %s',
        os.path.join(directory, STATE_FILE),
        problem,
        ', '.join(os.path.basename(p) for p in disk),
      )
    return disk
  candidates, outside = _named(directory)
  if outside and warn:
    logging.warning(
      "%s names checkpoints outside this run (%s); only this folder's own checkpoints are used",
      os.path.join(directory, STATE_FILE),
      ', '.join(outside[:3]),
    )
  return candidates + [p for p in disk if p not in candidates]


def _named(directory: str) -> tuple[list[str], list[str]]:
  """(the state file's checkpoints as paths in `directory`, newest first; the names it holds
  that point elsewhere and have no checkpoint of that name here)."""
  state = tf.train.get_checkpoint_state(directory)
  named = list(reversed(state.all_model_checkpoint_paths))
  if state.model_checkpoint_path not in named:
    named.insert(0, state.model_checkpoint_path)
  here = os.path.normpath(directory)
  candidates, outside = [], []
  for path in named:
    own = os.path.join(here, os.path.basename(path))
    if os.path.normpath(os.path.dirname(path)) == here or tf.io.gfile.exists(own + '.index'):
      if own not in candidates:
        candidates.append(own)
    else:
      outside.append(path)
  return candidates, outside


def _write_state(directory: str, paths: list[str]) -> None:
  """Writes the state file naming `paths` (oldest first, all in `directory`) by relative name,
  the last as the newest; with their times the manager treats them as its own and rotates them
  (max_to_keep)."""
  times = [os.path.getmtime(p + '.index') for p in paths]
  checkpoint_management.update_checkpoint_state_internal(
    directory,
    paths[-1],
    all_model_checkpoint_paths=paths,
    save_relative_paths=True,
    all_model_checkpoint_timestamps=times,
    last_preserved_timestamp=min(times) - 1,
  )


def repair_state(directory: str, restored: str) -> None:
  """Rewrites a missing, empty or garbled state file to name `restored` (newest) and the older
  ckpt-N files on disk, so that rotation (max_to_keep) knows them; then `own_state`. A no-op
  when it is fine."""
  if state_problem(directory) is None:
    own_state(directory)
    return
  older = [p for p in reversed(on_disk(directory)) if step_of(p) < step_of(restored)]
  _write_state(directory, older + [restored])
  logging.warning(
    'rewrote %s naming %s',
    os.path.join(directory, STATE_FILE),
    ', '.join(os.path.basename(p) for p in older + [restored]),
  )


def own_state(directory: str, drop_foreign: bool = False) -> None:
  """Called before a CheckpointManager opens `directory` for writing. Removes the ckpt-N_temp
  folders a killed save left (nothing of this process writes yet), and rewrites a state file
  that names a checkpoint by an absolute path or in another folder (a copied or moved run) with
  the relative names of this folder's own checkpoints, so that the manager rotates (deletes) only
  this folder's files. When the folder has none of its own: `drop_foreign` removes the state
  file (the manager then starts afresh; best/ does), else it is left. A no-op when every name is
  relative already, or the state file is missing or garbled."""
  _remove_temp_folders(directory)
  if state_problem(directory) is not None:
    return
  state = checkpoint_management.CheckpointState()
  with tf.io.gfile.GFile(os.path.join(directory, STATE_FILE)) as f:
    text_format.Merge(f.read(), state)  # the names as written (get_checkpoint_state joins)
  names = [state.model_checkpoint_path, *state.all_model_checkpoint_paths]
  if not any(os.path.isabs(p) or os.path.dirname(p) for p in names):
    return  # bare relative names only: as the manager writes them
  candidates, outside = _named(directory)
  kept = [p for p in reversed(candidates) if tf.io.gfile.exists(p + '.index')]
  if not kept and drop_foreign:
    tf.io.gfile.remove(os.path.join(directory, STATE_FILE))
    logging.warning(
      'removed %s: it named only checkpoints outside this run (%s)',
      os.path.join(directory, STATE_FILE),
      ', '.join(outside or names),
    )
    return
  if not kept:
    return  # nothing of this folder's own to name; restore_for_training found none either
  _write_state(directory, kept)
  logging.warning(
    "rewrote %s with relative names of this folder's checkpoints (%s)%s",
    os.path.join(directory, STATE_FILE),
    ', '.join(os.path.basename(p) for p in kept),
    f'; dropped {", ".join(outside)} (outside this run)' if outside else '',
  )


_TEMP = re.compile(r'ckpt-\d+_temp')  # TensorFlow writes ckpt-N into ckpt-N_temp/, then renames


def _remove_temp_folders(directory: str) -> None:
  """Removes the ckpt-N_temp folders in `directory`: a save killed before its rename (an
  asynchronous one at a kill, a full disk) leaves one, and TensorFlow never removes it, even
  when a later save writes ckpt-N again."""
  if not tf.io.gfile.isdir(directory):
    return
  for name in tf.io.gfile.listdir(directory):
    name = name.rstrip('/')
    if _TEMP.fullmatch(name) and tf.io.gfile.isdir(os.path.join(directory, name)):
      tf.io.gfile.rmtree(os.path.join(directory, name))
      logging.warning('removed %s, left by an interrupted save', os.path.join(directory, name))


def step_of(path: str) -> int:
  """N of a ckpt-N checkpoint path (0 for a name without a number)."""
  match = re.search(r'-(\d+)$', path)
  return int(match.group(1)) if match else 0
