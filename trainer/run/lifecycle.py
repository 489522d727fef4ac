"""A trained model's life after (and before) `train()`: evaluate, export, start from another run.

  python launch.py --config=... --workdir=runs/a --mode=eval     # the latest checkpoint, eval set
  python launch.py --config=... --workdir=runs/a --mode=export   # runs/a-export/{saved_model,
                                                                 #   model.keras}
  --config.train.init_from=runs/a   # a new run starts from runs/a's latest model weights

All three only read the run folder (`restore` below): nothing in it is written, no lock taken, so
they work on a read-only (archived) run and on a run another process is training. Export writes
into its own folder, `--export_dir` (default: the sibling `<workdir>-export`), never the run's.
"""

from __future__ import annotations

import inspect
import math
import os

import keras
import tensorflow as tf
from absl import logging

from trainer.insight import audit, hooks
from trainer.run import checkpoint_files, checkpoints, health
from trainer.run import workdir as workdir_lib
from trainer.errors import ConfigError, NonFiniteError, UserError


def restore(trainer, what: str = 'restore') -> int:
  """Restores the newest readable checkpoint of `trainer.workdir` without writing anything;
  returns the global step. UserError naming `what` when the run has no checkpoint."""
  return _restore(trainer, what)[0]


def _restore(trainer, what: str) -> tuple[int, str]:
  """`restore`, and the path of the checkpoint it read."""
  if not checkpoint_files.find(trainer.runner.workdir.checkpoint_dir):
    raise UserError(
      f'{what}: no checkpoint in {trainer.runner.workdir.checkpoint_dir}; train '
      'first (or check --workdir)'
    )
  path = trainer.runner.workdir.restore_read_only()
  return int(trainer.global_step.numpy()), str(path)


def evaluate_checkpoint(trainer, what: str = '--mode=eval') -> dict[str, float]:
  """Restores the workdir's latest checkpoint (read-only) and runs one pass over the eval set;
  says which checkpoint it read and whether it is the last healthy one (trainer/run/health.py).
  NonFiniteError (exit status 3) when the eval loss is not finite, naming the last healthy
  checkpoint."""
  step, path = _restore(trainer, what)
  record = trainer.runner.workdir.healthy_record()
  name = os.path.basename(path)
  which = (
    'the last healthy one'
    if record and record['checkpoint'] == name
    else f'not the last healthy one ({health.describe(record)})'
  )
  metrics = trainer.evaluate()
  logging.info(
    'eval of %s at step %d (%s, %s): %s',
    trainer.workdir,
    step,
    name,
    which,
    ', '.join(f'{k} {v:.4f}' for k, v in metrics.items()),
  )
  if not math.isfinite(metrics['loss']):
    raise NonFiniteError(
      f'{what}: {name} (step {step}, {which}) gives eval loss {metrics["loss"]}: the '
      'model does not compute finite outputs'
    )
  return metrics


EVALUATOR = 'evaluator'  # in the run folder: the side-car's ckpt-N.json; tensorboard/evaluator


def evaluate_continuously(trainer, idle_seconds: float) -> dict[str, float]:
  """The evaluator side-car (TF_CONFIG task type 'evaluator'; Orbit's
  Controller.evaluate_continuously is the model): evaluates each new checkpoint the chief writes,
  once each and in order (tf.train.checkpoints_iterator yields the newest at each look, so one
  that falls behind skips to the newest), as `evaluate_checkpoint` would. It writes none of the
  run's files, only a record per checkpoint (<workdir>/evaluator/ckpt-N.json) and TensorBoard
  events (<workdir>/tensorboard/evaluator, eval/<metric>). Ends after the checkpoint of the run's
  last step, or after `idle_seconds` with no new checkpoint; returns the last metrics."""
  workdir = trainer.runner.workdir
  folder = os.path.join(workdir.path, EVALUATOR)
  writer, metrics = None, {}
  for path in tf.train.checkpoints_iterator(
    workdir.checkpoint_dir, min_interval_secs=1, timeout=idle_seconds
  ):
    name, step = os.path.basename(path), checkpoint_files.step_of(path)
    record = os.path.join(folder, f'{name}.json')
    if not os.path.exists(record):  # evaluated by an earlier side-car of this run: not again
      try:
        checkpoints.restore(workdir.items, path)
      except (tf.errors.NotFoundError, checkpoints.Mismatch) as e:  # rotated away meanwhile
        logging.warning('evaluator: %s could not be read (%s); waiting for the next', path, e)
        continue
      metrics = trainer.evaluate()
      logging.info(
        'evaluator: %s (step %d): %s',
        name,
        step,
        ', '.join(f'{k} {v:.4f}' for k, v in metrics.items()),
      )
      os.makedirs(folder, exist_ok=True)
      workdir_lib.write_json(record, {'checkpoint': name, 'step': step, 'metrics': metrics})
      writer = writer or tf.summary.create_file_writer(
        os.path.join(workdir.path, workdir_lib.TENSORBOARD, EVALUATOR)
      )
      with writer.as_default(step=step):
        for key, value in metrics.items():
          tf.summary.scalar(f'eval/{key}', value)
      writer.flush()
    if step >= trainer.total_steps:
      break
  return metrics


def default_export_dir(workdir: str) -> str:
  """`<workdir>-export`: next to the run folder, which export never writes into."""
  return os.path.abspath(workdir).rstrip(os.sep) + '-export'


def export(trainer, folder: str | None = None) -> dict[str, str]:
  """Writes the latest checkpoint's model as a SavedModel (signature `serve`) and a `.keras`
  file into `folder` (default `default_export_dir`); returns their paths (model.keras left out,
  with a warning, when Keras cannot serialize the model's config). Both compute in the
  training policy. The checkpoint is evaluated first, and one whose eval loss is not finite is
  refused as --mode=eval refuses it (NonFiniteError): nothing is written."""
  evaluate_checkpoint(trainer, '--mode=export')
  step = int(trainer.global_step.numpy())
  folder = (
    workdir_lib.local_path(folder, '--export_dir')
    if folder
    else default_export_dir(trainer.workdir)
  )
  os.makedirs(folder, exist_ok=True)
  paths = {
    'saved_model': os.path.join(folder, 'saved_model'),
    'keras': os.path.join(folder, 'model.keras'),
  }
  inputs = serving_inputs(trainer)
  if inputs is None:  # Keras's own signature: the Input layers'
    trainer.model.export(paths['saved_model'], format='tf_saved_model', verbose=False)
  else:
    archive = keras.export.ExportArchive()  # what model.export does, with our signature
    # The endpoint brings its variables; tracking the layers keeps their other assets (lookup
    # tables). Not the model: Keras would trace its default signature, self(<one input>), which
    # fails for a model of several inputs (call(self, *xs)).
    for layer in trainer.model._flatten_layers(include_self=False, recursive=False):
      archive.track(layer)
    archive.add_endpoint(
      'serve',
      _serving_call(trainer.model, [k for k, _ in inputs]),
      [tf.nest.map_structure(_spec, v) for _, v in inputs],
    )
    archive.write_out(paths['saved_model'], verbose=False)
  try:
    trainer.model.save(paths['keras'])
    _check_reload(trainer.model)
  except (NotImplementedError, TypeError, ValueError) as e:  # a config Keras cannot serialize
    # (an OSError, a full disk say, is not the config's fault: it is raised as it is)
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    logging.warning(
      'model.keras was not written: %s: %s The SavedModel is complete. For '
      'model.keras, give %s a get_config() returning its __init__ arguments',
      type(e).__name__,
      ' '.join(lines[:3])[:300],
      type(trainer.model).__name__,
    )
    if os.path.exists(paths.pop('keras')):  # a partial file, or an older export's
      os.remove(os.path.join(folder, 'model.keras'))
  logging.info('exported step %d to %s', step, folder)
  return paths


def serving_inputs(trainer) -> list | None:
  """The SavedModel's inputs, [(keyword, tensor)], for a subclassed model; None (Keras's own
  signature, with its dtypes) for a model with Input layers (Functional, Sequential). For a
  subclassed model Keras knows only the first call's shapes and gives every input the policy's
  compute dtype: bfloat16 images, and bfloat16 token ids no integer input binds to. Here
  compute_loss runs once (on the first example of the first eval batch, as the audit's forward
  pass) and the tensors the model's `call` receives are the inputs, in its order; keyword None
  for one passed positionally, else its parameter's name (a `mask=`, a keyword-only input).
  `training` is not an input. None when compute_loss does not call the model."""
  model = trainer.model
  if getattr(model, 'inputs', None):
    return None
  with hooks.recording(model, None, include_self=True) as calls:
    audit.forward(trainer)()
  first = next((c for c in calls if c.layer is model), None)
  if first is None:
    return None
  signature = inspect.signature(model.call)
  bound = signature.bind_partial(*first.args, **first.kwargs).arguments
  inputs: list = []
  for i, (name, parameter) in enumerate(signature.parameters.items()):
    value = bound.get(name)
    if parameter.kind is parameter.VAR_POSITIONAL:
      inputs += [(None, v) for v in value or () if _is_tensors(v)]
    elif parameter.kind is parameter.VAR_KEYWORD:
      inputs += [(k, v) for k, v in (value or {}).items() if _is_tensors(v)]
    elif name != 'training' and value is not None and _is_tensors(value):
      inputs.append(
        (None if i == 0 or parameter.kind is parameter.POSITIONAL_ONLY else name, value)
      )
  return inputs or None


def _serving_call(model, keywords: list):
  """The SavedModel's `serve(*args)`: the model called with args_i given positionally or by the
  keyword `keywords[i]` (None: positionally), with training=False when `call` takes it (its
  default may be missing or True), and None outputs (a cache slot) left out."""
  training = {'training': False} if 'training' in inspect.signature(model.call).parameters else {}

  def serve(*args):
    outputs = model(
      *[a for a, k in zip(args, keywords) if k is None],
      **{k: a for a, k in zip(args, keywords) if k is not None},
      **training,
    )
    return _without_none(outputs)

  return serve


def _without_none(structure):
  if isinstance(structure, dict):
    return {k: _without_none(v) for k, v in structure.items() if v is not None}
  if isinstance(structure, (list, tuple)):
    kept = [_without_none(v) for v in structure if v is not None]
    return (
      kept[0] if len(kept) == 1 else (list(kept) if isinstance(structure, list) else tuple(kept))
    )
  return structure


def _check_reload(model) -> None:
  """A warning when model.keras will not load back: Keras recreates a subclassed model as
  `cls(**model.get_config())`, which fails when __init__ takes no **kwargs (the config holds
  'trainable' and 'dtype') or needs an argument get_config does not return. Read from
  __init__'s signature: nothing is built (an __init__ may build its weights)."""
  cls = type(model)
  own = cls.from_config.__func__ is not keras.Model.from_config.__func__
  if getattr(model, 'inputs', None) or own:
    return  # a config Keras reloads itself, or the class's own from_config
  parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]
  try:
    config = model.get_config()
  except Exception as e:  # pylint: disable=broad-except  (the user's get_config)
    reason = f'get_config() raised {type(e).__name__}: {str(e)[:150]}'
  else:
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters)
    unknown = [] if takes_any else [k for k in config if k not in {p.name for p in parameters}]
    missing = [
      p.name
      for p in parameters
      if p.default is p.empty
      and p.name not in config
      and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if not unknown and not missing:
      return
    reason = (
      f'__init__ takes no {", ".join(unknown)} (no **kwargs)'
      if unknown
      else f'get_config() returns no {", ".join(missing)}, which __init__ needs'
    )
  logging.warning(
    'model.keras will not load back: %s.%s. The SavedModel is complete. For '
    'model.keras, give %s.__init__ **kwargs passed to super().__init__, and a '
    'get_config() returning its own arguments',
    cls.__name__,
    reason,
    cls.__name__,
  )


def _is_tensors(x) -> bool:
  leaves = tf.nest.flatten(x)
  return bool(leaves) and all(hasattr(t, 'dtype') and hasattr(t, 'shape') for t in leaves)


def _spec(t) -> tf.TensorSpec:
  dtype = tf.as_dtype(keras.backend.standardize_dtype(t.dtype))
  shape = list(t.shape)
  return tf.TensorSpec(
    [None] + shape[1:] if shape else [], tf.float32 if dtype.is_floating else dtype
  )


def init_from(trainer, source: str) -> str:
  """Loads the model weights (not the optimizer, step or loss scale) of `source`'s latest
  checkpoint into `trainer.model`; `source` is a workdir or a checkpoint path."""
  path = source
  if os.path.isdir(source):
    found = checkpoint_files.find(os.path.join(source, 'checkpoints'))  # read-only
    if not found:
      raise ConfigError(
        f'config.train.init_from={source!r}: no checkpoint in {os.path.join(source, "checkpoints")}'
      )
    path = found[0]
  elif not tf.io.gfile.glob(path + '.index'):
    raise ConfigError(
      f'config.train.init_from={source!r} is neither a workdir nor a '
      'checkpoint path (prefix of a .index file)'
    )
  try:
    status = tf.train.Checkpoint(model=trainer.model).restore(path)
    status.expect_partial().assert_existing_objects_matched()
  except AssertionError as e:
    raise ConfigError(
      f'config.train.init_from={source!r}: its model does not match this one '
      f'({(str(e).splitlines() or ["no detail"])[0][:200]})'
    ) from None
  # A damaged file surfaces as OpError (DataLoss, NotFound), ValueError, a protobuf
  # DecodeError ... (as in checkpoints.restore_newest_readable).
  except Exception as e:  # pylint: disable=broad-except
    lines = str(e).strip().splitlines()
    raise ConfigError(
      f'config.train.init_from={source!r}: {path} is unreadable '
      f'({type(e).__name__}: {lines[0][:200] if lines else ""}); point it at '
      'an intact checkpoint'
    ) from None
  bad = checkpoints.nonfinite(checkpoints.variables({'model': trainer.model}))
  if bad:
    raise ConfigError(
      f'config.train.init_from={source!r}: {path} holds non-finite weights '
      f'({checkpoints.describe_nonfinite(bad)}); point it at a finite '
      'checkpoint (an earlier ckpt-N of that run)'
    )
  logging.info('initialized the model from %s', path)
  return path
