"""The forensic folder of a replayed step, `<workdir>/forensics/step-N/`: batch.npz (the batch),
weights/ (a tf.train.Checkpoint of the model: the pre-step weights), meta.json (step, loss
scale, policy, whether the compiled step skipped it, the config) and the report (report.txt,
report.json). trainer/insight/forensics.py writes and replays it. Every write refuses to follow
a symlink out of the run folder (trainer/insight/files.py); a damaged folder is one line."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import tempfile

import keras
import numpy as np
import tensorflow as tf

from trainer.errors import UserError, message_line
from trainer.insight import files


def _encode(structure, arrays):
  if isinstance(structure, dict):
    return {'dict': {k: _encode(v, arrays) for k, v in structure.items()}}
  if isinstance(structure, (list, tuple)):
    return {
      'tuple' if isinstance(structure, tuple) else 'list': [_encode(v, arrays) for v in structure]
    }
  arrays[f'leaf_{len(arrays)}'] = np.asarray(structure)
  return {'leaf': f'leaf_{len(arrays) - 1}'}


def _decode(spec, arrays):
  if 'dict' in spec:
    return {k: _decode(v, arrays) for k, v in spec['dict'].items()}
  if 'tuple' in spec:
    return tuple(_decode(v, arrays) for v in spec['tuple'])
  if 'list' in spec:
    return [_decode(v, arrays) for v in spec['list']]
  return arrays[spec['leaf']]


def folder_for(workdir: str, step: int) -> str:
  return os.path.join(workdir, 'forensics', f'step-{step}')


def run_of(folder: str) -> str:
  """The run folder of a forensic folder <run>/forensics/step-N."""
  return os.path.dirname(os.path.dirname(os.path.abspath(folder)))


def save(
  folder: str,
  *,
  model: keras.Model,
  batch,
  loss_scale: float,
  step: int,
  config=None,
  policy: str = '',
  report=None,
  run: str | None = None,
) -> str:
  """Writes a forensic folder: batch.npz, weights/ (tf.train.Checkpoint of `model`, the
  pre-step weights), meta.json and, given a report, report.txt and report.json. Never through
  a symlink out of `run` (default: `run_of(folder)`): a refusal or a failed write is one
  UserError line."""
  run = run or run_of(folder)
  files.folder(run, folder, 'forensics')
  arrays: dict = {}
  spec = _encode(tf.nest.map_structure(lambda t: np.asarray(t), batch), arrays)
  buffer = io.BytesIO()
  np.savez(buffer, **arrays)
  files.write(os.path.join(folder, 'batch.npz'), buffer.getvalue(), 'forensics')
  _write_weights(run, folder, model)
  meta = {
    'step': int(step),
    'loss_scale': float(loss_scale),
    'policy': policy,
    'batch_structure': spec,
    'skipped': bool(getattr(report, 'skipped', False)),
    'config': config.to_dict() if hasattr(config, 'to_dict') else config,
  }
  files.write(
    os.path.join(folder, 'meta.json'),
    json.dumps(meta, indent=2, sort_keys=True, default=str),
    'forensics',
  )
  if report is not None:
    write_report(folder, report, run=run)
  return folder


def _write_weights(run: str, folder: str, model: keras.Model) -> None:
  """weights/ checkpoint, written into a fresh temporary folder (nothing planted in it) and
  renamed into place."""
  target = os.path.join(folder, 'weights')
  if os.path.islink(target):
    files.folder(run, target, 'forensics')  # raises: a symlink
  try:
    tmp = tempfile.mkdtemp(prefix='.weights-', dir=folder)
    try:
      tf.train.Checkpoint(model=model).write(os.path.join(tmp, 'ckpt'))
      if os.path.isdir(target):
        shutil.rmtree(target)  # an earlier record of this step (rmtree follows no link)
      elif os.path.lexists(target):
        os.remove(target)
      os.rename(tmp, target)
    finally:
      if os.path.isdir(tmp):
        shutil.rmtree(tmp, ignore_errors=True)
  except (OSError, tf.errors.OpError) as e:
    reason = getattr(e, 'strerror', None) or type(e).__name__
    raise UserError(
      f'forensics: cannot write {target} ({reason}); pass --workdir=<a folder you can write>'
    ) from None


def write_report(folder: str, report, run: str | None = None) -> None:
  files.folder(run or run_of(folder), folder, 'forensics')
  files.write(os.path.join(folder, 'report.txt'), report.line() + '\n', 'forensics')
  files.write(
    os.path.join(folder, 'report.json'),
    json.dumps(report.to_json(), indent=2, sort_keys=True, allow_nan=False),
    'forensics',
  )


@dataclasses.dataclass
class Forensics:
  folder: str
  step: int
  loss_scale: float
  policy: str
  config: dict | None
  batch: object
  skipped: bool = False  # the compiled step skipped it (else: saved by --mode=diagnose)

  def restore_weights(self, model: keras.Model) -> None:
    """Loads the saved pre-step weights into `model` (built the same way)."""
    try:
      tf.train.Checkpoint(model=model).read(
        os.path.join(self.folder, 'weights', 'ckpt')
      ).assert_existing_objects_matched()
    except (AssertionError, ValueError, tf.errors.OpError) as e:
      first = message_line(e)
      raise UserError(
        f'--forensics={self.folder}: its weights do not fit the model built from '
        f'the config ({type(e).__name__}: {first[:200]}); pass the --config of '
        'the run that wrote the folder'
      ) from None


def load(folder: str) -> Forensics:
  """Reads a forensic folder; a damaged one (meta.json or batch.npz missing, not what `save`
  wrote, a folder where a file should be ...) is one UserError line naming it."""
  meta_path = os.path.join(folder, 'meta.json')
  if not os.path.isfile(meta_path):
    raise UserError(
      f'--forensics={folder}: no meta.json there; pass a folder written by a '
      'skipped step, such as <workdir>/forensics/step-N'
    )
  try:
    with open(meta_path) as f:
      meta = json.load(f)
    if not isinstance(meta, dict):
      raise ValueError(f'meta.json holds a JSON {type(meta).__name__}, not an object')
    with np.load(os.path.join(folder, 'batch.npz'), allow_pickle=False) as arrays:
      batch = _decode(meta['batch_structure'], {k: arrays[k] for k in arrays.files})
    config = meta.get('config')
    if config is not None and not isinstance(config, dict):
      raise ValueError(f'its config is a JSON {type(config).__name__}, not an object')
    return Forensics(
      folder,
      int(meta['step']),
      float(meta['loss_scale']),
      str(meta.get('policy', '')),
      config,
      batch,
      bool(meta.get('skipped', False)),
    )
  except Exception as e:  # pylint: disable=broad-except  (any damage: one line)
    first = message_line(e)[:200]
    raise UserError(
      f'--forensics={folder} is damaged ({type(e).__name__}: {first}); it is not '
      'a folder a skipped step wrote: record it again with --mode=diagnose '
      '--workdir=<the run>'
    ) from None
