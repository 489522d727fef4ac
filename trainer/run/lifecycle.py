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

import inspect
import os

import keras
import tensorflow as tf
from absl import logging

from trainer.data import checks
from trainer.insight import hooks
from trainer.run import checkpoint_files, checkpoints
from trainer.run import workdir as workdir_lib
from trainer.errors import ConfigError, UserError


def restore(trainer, what: str = 'restore') -> int:
  """Restores the newest readable checkpoint of `trainer.workdir` without writing anything;
  returns the global step. UserError naming `what` when the run has no checkpoint."""
  if not checkpoint_files.find(trainer.runner.workdir.checkpoint_dir):
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
  trainer.model.export(paths['saved_model'], format='tf_saved_model', verbose=False,
                       input_signature=serving_signature(trainer))
  trainer.model.save(paths['keras'])
  _check_reload(trainer.model)
  logging.info('exported step %d to %s', step, folder)
  return paths


def serving_signature(trainer) -> list | None:
  """The SavedModel's input signature: None (Keras's own) for a model with Input layers
  (Functional, Sequential), whose dtypes it takes. For a subclassed model Keras knows only the
  shapes of the first call and gives every input the policy's compute dtype: bfloat16 images, and
  bfloat16 token ids that no integer input then binds to. Here compute_loss runs once on the
  first eval batch and the tensors the model's `call` receives give the signature: an integer
  input keeps its dtype, a float one is float32 (the model casts it to its compute dtype, as in
  training), the batch axis is None. None when compute_loss does not call the model."""
  model = trainer.model
  if getattr(model, 'inputs', None):
    return None
  seen: list = []

  def recorder(call):
    names = list(inspect.signature(call).parameters)

    def recording(*args, **kwargs):
      if not seen:  # the inputs, positional or keyword, in the order `call` declares them
        bound = dict(zip(names, args), **kwargs)
        seen.extend(bound[n] for n in names if n in bound and n not in ('training', 'mask')
                    and _is_tensors(bound[n]))
      return call(*args, **kwargs)
    return recording

  with hooks.hooked(model, 'call', recorder), trainer.strategy.scope():
    trainer.compute_loss(checks.first_eval_batch(trainer.datasets), training=False)
  return [tf.nest.map_structure(_spec, x) for x in seen] or None


def _check_reload(model) -> None:
  """A warning when model.keras will not load back: Keras recreates a subclassed model as
  `cls.from_config(model.get_config())`, which fails when __init__ takes no **kwargs (the config
  holds 'trainable' and 'dtype') or arguments get_config does not return. Building the object
  allocates no weights."""
  if getattr(model, 'inputs', None):
    return  # Functional and Sequential models reload from their config
  try:
    type(model).from_config(model.get_config())
  except Exception as e:  # pylint: disable=broad-except  (the user's __init__)
    logging.warning('model.keras will not load back: %s.from_config(get_config()) raised %s: %s. '
                    'The SavedModel is complete. For model.keras, give %s.__init__ **kwargs '
                    'passed to super().__init__, and a get_config() returning its own '
                    'arguments', type(model).__name__, type(e).__name__,
                    ([''] + [l for l in str(e).splitlines() if l.strip()])[-1][:300],
                    type(model).__name__)


def _is_tensors(x) -> bool:
  leaves = tf.nest.flatten(x)
  return bool(leaves) and all(hasattr(t, 'dtype') and hasattr(t, 'shape') for t in leaves)


def _spec(t) -> tf.TensorSpec:
  dtype = tf.as_dtype(keras.backend.standardize_dtype(t.dtype))
  shape = list(t.shape)
  return tf.TensorSpec([None] + shape[1:] if shape else [],
                       tf.float32 if dtype.is_floating else dtype)


def init_from(trainer, source: str) -> str:
  """Loads the model weights (not the optimizer, step or loss scale) of `source`'s latest
  checkpoint into `trainer.model`; `source` is a workdir or a checkpoint path."""
  path = source
  if os.path.isdir(source):
    found = checkpoint_files.find(os.path.join(source, 'checkpoints'))  # read-only
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
