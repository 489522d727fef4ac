"""The forensic folder of a replayed step, `<workdir>/forensics/step-N/`: batch.npz (the batch),
weights/ (a tf.train.Checkpoint of the model: the pre-step weights), meta.json (step, loss
scale, policy, whether the compiled step skipped it, the config) and the report (report.txt,
report.json). trainer/insight/forensics.py writes and replays it."""
from __future__ import annotations

import dataclasses
import json
import os

import keras
import numpy as np
import tensorflow as tf

from trainer.errors import UserError

def _encode(structure, arrays):
  if isinstance(structure, dict):
    return {'dict': {k: _encode(v, arrays) for k, v in structure.items()}}
  if isinstance(structure, (list, tuple)):
    return {'tuple' if isinstance(structure, tuple) else 'list':
            [_encode(v, arrays) for v in structure]}
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


def save(folder: str, *, model: keras.Model, batch, loss_scale: float, step: int,
         config=None, policy: str = '', report=None) -> str:
  """Writes a forensic folder: batch.npz, weights/ (tf.train.Checkpoint of `model`, the
  pre-step weights), meta.json and, given a report, report.txt and report.json."""
  os.makedirs(folder, exist_ok=True)
  arrays: dict = {}
  spec = _encode(tf.nest.map_structure(lambda t: np.asarray(t), batch), arrays)
  np.savez(os.path.join(folder, 'batch.npz'), **arrays)
  tf.train.Checkpoint(model=model).write(os.path.join(folder, 'weights', 'ckpt'))
  meta = {'step': int(step), 'loss_scale': float(loss_scale), 'policy': policy,
          'batch_structure': spec, 'skipped': bool(getattr(report, 'skipped', False)),
          'config': config.to_dict() if hasattr(config, 'to_dict') else config}
  with open(os.path.join(folder, 'meta.json'), 'w') as f:
    json.dump(meta, f, indent=2, sort_keys=True, default=str)
  if report is not None:
    write_report(folder, report)
  return folder


def write_report(folder: str, report) -> None:
  with open(os.path.join(folder, 'report.txt'), 'w') as f:
    f.write(report.line() + '\n')
  with open(os.path.join(folder, 'report.json'), 'w') as f:
    json.dump(report.to_json(), f, indent=2, sort_keys=True)


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
          os.path.join(self.folder, 'weights', 'ckpt')).assert_existing_objects_matched()
    except (AssertionError, ValueError, tf.errors.OpError) as e:
      first = (str(e).strip().splitlines() or [''])[0]
      raise UserError(f'--forensics={self.folder}: its weights do not fit the model built from '
                      f'the config ({type(e).__name__}: {first[:200]}); pass the --config of '
                      'the run that wrote the folder') from None


def load(folder: str) -> Forensics:
  meta_path = os.path.join(folder, 'meta.json')
  if not os.path.isfile(meta_path):
    raise UserError(f'--forensics={folder}: no meta.json there; pass a folder written by a '
                    'skipped step, such as <workdir>/forensics/step-N')
  with open(meta_path) as f:
    meta = json.load(f)
  with np.load(os.path.join(folder, 'batch.npz')) as arrays:
    batch = _decode(meta['batch_structure'], {k: arrays[k] for k in arrays.files})
  return Forensics(folder, meta['step'], meta['loss_scale'], meta.get('policy', ''),
                   meta.get('config'), batch, bool(meta.get('skipped', False)))
