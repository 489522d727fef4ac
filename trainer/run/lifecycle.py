"""A trained model's life after (and before) `train()`: evaluate, export, start from another run.

  python launch.py --config=... --workdir=runs/a --mode=eval     # the latest checkpoint, eval set
  python launch.py --config=... --workdir=runs/a --mode=export   # runs/a-export/{saved_model,
                                                                 #   model.keras}
  --config.train.init_from=runs/a   # a new run starts from runs/a's latest model weights

All three only read the run folder (`restore` below): no file in it is written or changed, no
lock is taken, so they work on a read-only (archived) run and on a run another process is
training. Export writes into its own folder, `--export_dir` (default: `<workdir>-export`, a
sibling of the run folder), never into the run folder.
"""
from __future__ import annotations

import os

import tensorflow as tf
from absl import logging

from trainer.run import checkpoints
from trainer.run import workdir as workdir_lib
from trainer.errors import ConfigError, UserError


def restore(trainer, what: str = 'restore') -> int:
  """Restores the newest readable checkpoint of `trainer.workdir` without writing anything;
  returns the global step. UserError naming `what` when the run has no checkpoint."""
  if not checkpoints.find(trainer.runner.workdir.checkpoint_dir):
    raise UserError(f'{what}: no checkpoint in {trainer.runner.workdir.checkpoint_dir}; train '
                    'first (or check --workdir)')
  trainer.runner.workdir.restore_read_only()
  return int(trainer.global_step.numpy())


def evaluate_checkpoint(trainer) -> dict[str, float]:
  """Restores the workdir's latest checkpoint (read-only) and runs one pass over the eval set."""
  step = restore(trainer, '--mode=eval')
  metrics = trainer.evaluate()
  logging.info('eval of %s at step %d: %s', trainer.workdir, step,
               ', '.join(f'{k} {v:.4f}' for k, v in metrics.items()))
  return metrics


def default_export_dir(workdir: str) -> str:
  """`<workdir>-export`: next to the run folder, which export never writes into."""
  return os.path.abspath(workdir).rstrip(os.sep) + '-export'


def export(trainer, folder: str | None = None) -> dict[str, str]:
  """Writes the latest checkpoint's model as a SavedModel (signature `serve`) and a `.keras`
  file into `folder` (default `default_export_dir`); returns their paths. Both compute in the
  training policy."""
  step = restore(trainer, '--mode=export')
  folder = (workdir_lib.local_path(folder, '--export_dir') if folder
            else default_export_dir(trainer.workdir))
  os.makedirs(folder, exist_ok=True)
  paths = {'saved_model': os.path.join(folder, 'saved_model'),
           'keras': os.path.join(folder, 'model.keras')}
  trainer.model.export(paths['saved_model'], format='tf_saved_model', verbose=False)
  trainer.model.save(paths['keras'])
  logging.info('exported step %d to %s', step, folder)
  return paths


def init_from(trainer, source: str) -> str:
  """Loads the model weights (not the optimizer, step or loss scale) of `source`'s latest
  checkpoint into `trainer.model`; `source` is a workdir or a checkpoint path."""
  path = source
  if os.path.isdir(source):
    found = checkpoints.find(os.path.join(source, 'checkpoints'))  # read-only, state file or not
    if not found:
      raise ConfigError(f'config.train.init_from={source!r}: no checkpoint in '
                        f'{os.path.join(source, "checkpoints")}')
    path = found[0]
  elif not tf.io.gfile.glob(path + '.index'):
    raise ConfigError(f'config.train.init_from={source!r} is neither a workdir nor a '
                      'checkpoint path (prefix of a .index file)')
  try:
    status = tf.train.Checkpoint(model=trainer.model).restore(path)
    status.expect_partial().assert_existing_objects_matched()
  except AssertionError as e:
    raise ConfigError(f'config.train.init_from={source!r}: its model does not match this one '
                      f'({str(e).splitlines()[0][:200]})') from None
  # A damaged file surfaces as OpError (DataLoss, NotFound), ValueError, a protobuf
  # DecodeError ... (as in checkpoints.restore_newest_readable).
  except Exception as e:  # pylint: disable=broad-except
    lines = str(e).strip().splitlines()
    raise ConfigError(f'config.train.init_from={source!r}: {path} is unreadable '
                      f'({type(e).__name__}: {lines[0][:200] if lines else ""}); point it at '
                      'an intact checkpoint') from None
  bad = checkpoints.nonfinite(checkpoints.variables({'model': trainer.model}))
  if bad:
    raise ConfigError(f'config.train.init_from={source!r}: {path} holds non-finite weights '
                      f'({checkpoints.describe_nonfinite(bad)}); point it at a finite '
                      'checkpoint (an earlier ckpt-N of that run)')
  logging.info('initialized the model from %s', path)
  return path
