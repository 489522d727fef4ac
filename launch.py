"""Trains a model from a config file.

  python launch.py --config=configs/mnist.py [--workdir=runs/x] [--config.train.batch_size=256]

Without --workdir a new folder under ./runs/ is made; pass the same --workdir again to resume.
--advise suggests layers to keep in float32; --mode=diagnose replays a non-finite step (see
docs/guides/numerics.md).
Exit statuses (docs/guides/troubleshooting.md#exit-statuses), each failure one `error:` line:
  0    done (or stopped by SIGTERM or Ctrl-C with a checkpoint saved; the same command resumes)
  1    a bug: an unexpected exception, with its traceback
  2    bad input: a mistake in the command, config, data or model code (trainer.errors.UserError)
  3    the run failed numerically: it collapsed, diverged, ended at chance or is not finite, or
       --mode=eval of a checkpoint whose eval loss is not finite (trainer.errors.TrainingFailed)
  130  a second Ctrl-C: stopped at once, nothing saved
A mistake is one line naming the culprit; --traceback (or TRAINER_TRACEBACK=1) prints the
Python traceback before it.
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import difflib
import gc
import importlib
import importlib.util
import os
import re
import sys
import tempfile
import traceback
import warnings

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Path to a config file in configs/.')
_WORKDIR = flags.DEFINE_string(
  'workdir',
  None,
  'Folder for checkpoints, TensorBoard events and '
  'config.json (default: a new folder under ./runs/).',
)
_MODE = flags.DEFINE_enum(
  'mode',
  'train',
  ['train', 'eval', 'export', 'diagnose'],
  'train (or resume); eval: evaluate the latest checkpoint of --workdir; '
  'export: write it as a SavedModel and a .keras file to --export_dir '
  '(eval and export only read --workdir); diagnose: replay the forensic '
  "folder --forensics (or, without it, the next batch of --workdir's "
  'latest checkpoint, saved as a forensic folder) and print where the '
  'step became non-finite.',
)
_EXPORT_DIR = flags.DEFINE_string(
  'export_dir',
  None,
  '--mode=export: the folder to write (default: <workdir>-export, next to the run folder).',
)
_AUDIT = flags.DEFINE_bool(
  'audit',
  False,
  "Build the model, print a table of every layer's "
  'dtypes and parameters with precision hazards, write it to '
  '<workdir>/audit.md, and exit without training.',
)
_FORENSICS = flags.DEFINE_string(
  'forensics',
  None,
  'With --mode=diagnose: a forensic folder '
  '(<workdir>/forensics/step-N); its saved config is used unless '
  '--config is given.',
)
_ADVISE = flags.DEFINE_bool(
  'advise',
  False,
  'Run --advise_steps calibration steps in float32 '
  "and in the config's policy, print per-layer range, error and "
  'gradient underflow with a suggested precision.float32_layers, write '
  'it to <workdir>/advice.md, and exit without training.',
)
_ADVISE_STEPS = flags.DEFINE_integer(
  'advise_steps', 10, 'Calibration steps of --advise.', lower_bound=1
)
_ADVISE_VALIDATE = flags.DEFINE_integer(
  'advise_validate_steps',
  0,
  'With --advise: then train this many steps as configured and as '
  "many with the suggestion, and print each run's skipped steps and flushed gradient "
  'fraction; 0 = no validation.',
  lower_bound=0,
)
flags.DEFINE_integer(
  'workers',
  0,
  'Train with N worker processes on this host (loopback ports, a TF_CONFIG each); their lines '
  'are prefixed with [worker i]; see docs/guides/distribution.md.',
  lower_bound=0,
)
flags.DEFINE_string(
  'cluster',
  None,
  'host1:port,host2:port,...: this process is worker --task_index of that cluster (worker 0 '
  'is the chief); builds TF_CONFIG. A TF_CONFIG already set is used as it is.',
)
flags.DEFINE_integer('task_index', None, "With --cluster: this worker's position in it.")
flags.DEFINE_float(
  'worker_timeout',
  60.0,
  'Multi-worker: a worker unreachable this many seconds ends the others (exit code 3).',
  lower_bound=1.0,
)
flags.DEFINE_integer(
  'k8s_manifest',
  0,
  'Print a Kubernetes manifest (an Indexed Job and a headless Service) that runs this command '
  'on N pods, and exit.',
  lower_bound=0,
)
flags.DEFINE_string('k8s_image', 'mpt-trainer:latest', 'With --k8s_manifest: the image.')
flags.DEFINE_string(
  'k8s_claim', 'mpt-runs', 'With --k8s_manifest: the shared volume claim mounted at /runs.'
)
flags.register_multi_flags_validator(
  ['config', 'mode', 'forensics'],
  lambda f: f['config'] is not None or (f['mode'] == 'diagnose' and bool(f['forensics'])),
  message='--config is required (only --mode=diagnose --forensics=DIR may leave it out)',
)
_TRACEBACK = flags.DEFINE_bool(
  'traceback',
  False,
  'On an error, print its Python traceback (with the exception it came from, e.g. the one a '
  'data mistake raised inside compute_loss) before the one line; also TRAINER_TRACEBACK=1.',
)
_TF_LOGS = flags.DEFINE_bool(
  'tf_logs', False, "Show TensorFlow's C++ start-up and info log lines (hidden by default)."
)


def _fail(message: str, status: int = 2) -> None:
  print(f'error: {message}', file=sys.stderr)
  try:
    config = _CONFIG.value  # None, or a file that failed to load: raises its error again
  except Exception:
    config = None
  exit_now(status, config)


def parse_flags(argv):
  """absl's parser, with config mistakes turned into one line naming the flag or key. The config
  is loaded and checked against the schema before TensorFlow is imported (trainer/config.py
  imports none), so a config mistake is reported within a second of the launch."""
  path = _config_path(argv)
  if path and not os.path.isfile(path.split(':', 1)[0]):  # before anything slow is imported
    _fail(f'--config={path}: no such file; pass a config file such as configs/mnist.py')
  quiet = not _tf_logs_requested(argv) and not any(a.startswith(('--help', '-?')) for a in argv[1:])
  if quiet:  # read once, when TensorFlow loads: a config file may import it
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  try:
    rest = flags.FLAGS(argv)
    config = _CONFIG.value  # config_flags defers a file's load error to the first access
  except flags.Error as e:
    if path and '--config is required' in str(e):  # the file was given: its get_config() gave None
      _fail(
        f'--config={path}: get_config() returned None; end it with `return config` (see '
        'configs/mnist.py)'
      )
    _fail((path and _file_error(path)) or _flag_error(str(e)))
  except Exception as e:  # ml_collections raises plain KeyError/AttributeError on bad overrides
    _fail(_config_error(argv, path, e))
  if config is not None:
    _check_schema(path, config)
  if quiet:
    quiet_tensorflow()
  return rest


def _check_schema(path, config) -> None:
  """Exits with the first schema mistake of `config`. An optimizer name a model registers when
  its module is imported is left to the Trainer's own check, after the model is imported."""
  from trainer import config as config_lib
  from trainer.errors import ConfigError

  if not isinstance(config, ml_collections.ConfigDict):
    _fail(
      f'--config={path}: get_config() returned a {type(config).__name__}, not an '
      'ml_collections.ConfigDict; wrap it: return ml_collections.ConfigDict({...})'
    )
  try:
    config_lib.validate(config)
  except ConfigError as e:
    if not str(e).startswith('config.optimizer.name='):
      _fail(str(e))


# ml_collections' TypeError when a config file assigns a value of another type to a field.
_CAST = re.compile(r"of original type <class '(\w+)'> and cannot be casted to type <class '(\w+)'>")


def _file_error(path: str) -> str | None:
  """The error the config file's get_config() raises, in one line naming its line; a value of
  another type than the field holds (ml_collections' TypeError) names the key and the types.
  None when the file loads."""
  from trainer import config as config_lib

  file = path.split(':', 1)[0]
  try:
    config_lib.load_file(file)
    return None
  except Exception as e:
    frames = [
      f
      for f in traceback.extract_tb(e.__traceback__)
      if os.path.abspath(f.filename) == os.path.abspath(file)
    ]
    line = (frames[-1].line or '').strip() if frames else ''
    where = f'{file}, line {frames[-1].lineno}' if frames else file
    cast = _CAST.search(str(e))
    assignment = re.fullmatch(r'([\w.]+)\s*=\s*(.+?)\s*(#.*)?', line)
    if not (cast and assignment):
      return f'--config={path}: {type(e).__name__}: {e} ({where}: {line})'
    key, value = assignment.group(1), assignment.group(2)
    got, want = cast.groups()
    a_want, a_got = (('an ' if t[0] in 'aeiou' else 'a ') + t for t in (want, got))
    return f'{key} = {value} ({where}): {key} holds {a_want}, not {a_got}{_unquote(value, want)}'


def _unquote(value: str, want: str) -> str:
  """'; write 3e-4 without quotes' when `value` is a quoted number the field's type reads."""
  try:
    text = ast.literal_eval(value)
    if isinstance(text, str) and want in ('int', 'float'):
      {'int': int, 'float': float}[want](text)
      return f'; write {text} without quotes'
  except (ValueError, SyntaxError):
    pass
  return ''


def _config_path(argv) -> str | None:
  for i, arg in enumerate(argv[1:], 1):
    if arg.startswith('--config='):
      return arg.split('=', 1)[1]
    if arg == '--config' and i + 1 < len(argv):
      return argv[i + 1]
  return None


# Python's and absl's words for an override of the wrong type, and what they mean to a user.
_WRONG_TYPE = (
  (
    r"\('Non-boolean argument to boolean flag', '([^']*)'\)",
    'is not a boolean (True or False)',
  ),
  (r"invalid literal for int\(\) with base 10: '([^']*)'", 'is not an integer'),
  (r"could not convert string to float: '([^']*)'", 'is not a number'),
)


def _flag_error(text: str) -> str:
  """absl's message, first line; for an exception inside get_config(), its last line too."""
  lines = [l.strip() for l in text.splitlines() if l.strip()]
  first = re.sub(r'^flags [^:]*: ', '', lines[0].removeprefix('flag '))
  if 'Error whilst parsing config file' in text and len(lines) > 1:
    return f'{first} {lines[-1]}'
  for pattern, meaning in _WRONG_TYPE:
    first = re.sub(pattern, lambda m: f'{m.group(1)!r} {meaning}', first)
  return first


def _config_error(argv, path, e: Exception) -> str:
  if isinstance(e, AttributeError) and 'get_config' in str(e):
    return (
      f'--config={path}: the file defines no get_config(); a config file returns its '
      'ml_collections.ConfigDict from get_config() (see configs/mnist.py)'
    )
  overrides = [a for a in argv[1:] if a.startswith('--config.')]
  returned = _returned_type(path) if path and overrides else None
  if returned == 'NoneType':  # an override found no config to set
    return (
      f'--config={path}: get_config() returned None; end it with `return config` (see '
      'configs/mnist.py)'
    )
  if returned not in (None, 'ConfigDict'):  # an override failed on a dict, list, ...
    return (
      f'--config={path}: get_config() returned a {returned}, not an '
      'ml_collections.ConfigDict; wrap it: return ml_collections.ConfigDict({...})'
    )
  if isinstance(e, (KeyError, AttributeError)) and overrides:
    known = _config_keys(path)
    names = [a.split('=', 1)[0].removeprefix('--config.') for a in overrides]
    # The first override naming no key of the config file; without the file's keys, the one
    # holding the name in the error ("'batch_sise'\nDid you mean ...").
    first_line = (str(e).splitlines() or [''])[0]
    missing = first_line.strip('"\'\\ ')
    culprit = next((o for o, n in zip(overrides, names) if known and n not in known), None) or next(
      (o for o, n in zip(overrides, names) if missing in n.split('.')), overrides[0]
    )
    key = culprit.split('=', 1)[0].removeprefix('--config.')
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.8) or _same_leaf(key, known)
    hint = (
      f'; did you mean {close[0]}?'
      if close
      else f'; see the keys in {path} (all of them: docs/reference/config.md)'
    )
    return f'{culprit}: the config has no key {key}{hint}'
  culprit = overrides[0] if len(overrides) == 1 else f'--config={path}'
  return f'{culprit}: {type(e).__name__}: {e}'


def _returned_type(path: str) -> str | None:
  """The type name of what the config file's get_config() returns (None when it cannot be
  loaded)."""
  from trainer import config as config_lib

  try:
    return type(config_lib.load_file(path.split(':', 1)[0])).__name__
  except Exception:  # only used to name the culprit better; the error is reported anyway
    return None


def _same_leaf(key: str, known: list[str]) -> list[str]:
  """The one known key with `key`'s last name in another section (train.learning_rate,
  learning_rate: optimizer.learning_rate), PyTorch's and Keras's `lr` read as learning_rate."""
  leaf = key.rsplit('.', 1)[-1]
  leaf = {'lr': 'learning_rate'}.get(leaf, leaf)
  same = [k for k in known if k.rsplit('.', 1)[-1] == leaf and k != key]
  return same if len(same) == 1 else []


def _config_keys(path: str) -> list[str]:
  """The dotted keys of the config file's get_config(), or [] when it cannot be loaded."""
  from trainer import config as config_lib

  try:
    return list(config_lib.flatten(config_lib.load_file(path.split(':', 1)[0])))
  except Exception:  # only used to name the culprit better; the error is reported anyway
    return []


def _diagnose(folder: str | None):
  """--mode=diagnose: rebuilds the trainer (from the folder's config unless --config is given),
  restores the folder's weights, replays its batch and prints the report's line. Without a
  folder: restores --workdir's latest checkpoint and records its next batch as a new folder."""
  import ml_collections
  import models
  from trainer.run import checkpoint_files
  from trainer.insight import forensics
  from trainer.run import lifecycle

  if not folder:
    trainer = models.get_trainer_class(_CONFIG.value.model)(_CONFIG.value, _WORKDIR.value)
    # Read-only, as eval and export (no lock, config record or event file); only the forensic
    # folder is written. No checkpoint: the initial weights (a model that overflows at once).
    if checkpoint_files.find(trainer.runner.workdir.checkpoint_dir):
      step = lifecycle.restore(trainer, '--mode=diagnose')
    else:
      logging.warning(
        '--mode=diagnose: no checkpoint in %s; replaying the first batch from the initial weights',
        trainer.runner.workdir.checkpoint_dir,
      )
      step = 0
    batch = next(iter(trainer.datasets.train.skip(step)))
    report = forensics.record(trainer, batch, step, skipped=False)  # no step skipped it
    print(
      f'step {step}, loss scale {float(trainer.loss_scaler.scale.numpy()):g}: '
      f'{report.line()}\nforensics: {forensics.folder_for(trainer.workdir, step)}'
    )
    return
  saved = forensics.load(folder)
  config = _CONFIG.value
  if config is None:
    if not saved.config:
      _fail(f"--forensics={folder}: meta.json holds no config; pass --config=<the run's config>")
    config = ml_collections.ConfigDict(saved.config)
  workdir = _WORKDIR.value or os.path.dirname(os.path.dirname(os.path.abspath(folder)))
  trainer = models.get_trainer_class(config.model)(config, workdir)
  report = forensics.replay_folder(trainer, folder)
  print(f'step {saved.step}, loss scale {saved.loss_scale:g}: {report.line()}')


def _default_workdir() -> str:
  name = os.path.splitext(os.path.basename(flags.FLAGS['config'].config_filename))[0]
  return os.path.join('runs', f'{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}')


def main(argv):
  if len(argv) > 1:
    _fail(f'unexpected arguments {argv[1:]}; overrides look like --config.train.steps=100')
  if not _TF_LOGS.value:  # TensorFlow's own Python INFO lines (e.g. checkpoint sharding)
    logging.get_absl_handler().addFilter(_hide_tensorflow_info)
  with collector_paused():  # TensorFlow is imported (parse_flags); trainer.run here
    from trainer.launch import workers  # --workers, --cluster, --k8s_manifest: may exit here

  workers.dispatch(flags.FLAGS, sys.argv, _CONFIG.value, _default_workdir)  # collector on
  # Imported here so that --help and flag errors do not wait for TensorFlow.
  with collector_paused():
    import_keras()
    import models
    from trainer.errors import UserError
    from trainer.run.preemption import Preempted

  config = _CONFIG.value
  trainer = None
  if _MODE.value == 'diagnose':
    if not _FORENSICS.value and not _WORKDIR.value:
      _fail(
        '--mode=diagnose needs --forensics=<workdir>/forensics/step-N, or --workdir=<a run> '
        'to replay the next batch of its latest checkpoint'
      )
  elif _MODE.value != 'train' and not _WORKDIR.value:
    _fail(f'--mode={_MODE.value} needs --workdir=<the folder of a training run>')
  try:
    if _MODE.value == 'diagnose':
      _diagnose(_FORENSICS.value)
      return
    if _ADVISE.value:
      from trainer.insight import advisor

      print(
        advisor.report(
          models.get_trainer_class(config.model),
          config,
          _WORKDIR.value or _default_workdir(),
          steps=_ADVISE_STEPS.value,
          validate_steps=_ADVISE_VALIDATE.value,
        )
      )
      return
    trainer_class = models.get_trainer_class(config.model)
    trainer = trainer_class(config, _WORKDIR.value or _default_workdir())
    if _AUDIT.value:
      from trainer.insight import audit

      print(audit.report(trainer))
      exit_now(0, config)
    from trainer.run import lifecycle

    if _MODE.value == 'export':
      for kind, path in lifecycle.export(trainer, _EXPORT_DIR.value).items():
        print(f'{kind}: {path}')
      exit_now(0, config)
    if _MODE.value == 'eval':
      metrics = lifecycle.evaluate_checkpoint(trainer)
    else:
      metrics = trainer.train()
  except UserError as e:  # 2: bad input; 3: the run failed numerically (TrainingFailed)
    if _TRACEBACK.value or os.environ.get('TRAINER_TRACEBACK', '') not in ('', '0'):
      traceback.print_exception(e)
    _fail('; '.join(filter(None, (str(e).rstrip('.'), _on_disk(trainer)))), e.exit_status)
  except Preempted as e:  # SIGTERM/SIGINT: a checkpoint was saved; not a failure
    print(str(e), file=sys.stderr)
    exit_now(0, config)
  except Exception as e:  # a bug in the model's code, say: its traceback, then what is on disk
    # An error an absl exception handler wants goes to it (trainer/launch/peers.py: a lost worker
    # is one line and exit status 3, with the checkpoint on disk named).
    if not _on_disk(trainer) or any(h.wants(e) for h in app.EXCEPTION_HANDLERS):
      raise
    traceback.print_exc()
    print(f'error: the run failed; {_on_disk(trainer)}', file=sys.stderr)
    exit_now(1, config)
  logging.info(
    'workdir: %s%s', trainer.workdir, '; ' + _on_disk(trainer) if _on_disk(trainer) else ''
  )
  print('final eval: ' + ', '.join(f'{k} {v:.4f}' for k, v in metrics.items()))
  if 'accuracy' in metrics:
    print(f'accuracy: {metrics["accuracy"]:.4f}')
  exit_now(0, config)


def _on_disk(trainer) -> str:
  """What is on disk once training began (Runner.on_disk), else ''."""
  return trainer.runner.on_disk() if trainer is not None else ''


def _tf_logs_requested(argv) -> bool:
  """--tf_logs, read before absl parses the flags (the last spelling wins, as in absl)."""
  wanted = False
  for arg in argv[1:]:
    if arg in ('--tf_logs', '--tf_logs=true', '--tf_logs=True', '--tf_logs=1'):
      wanted = True
    elif arg in ('--notf_logs', '--tf_logs=false', '--tf_logs=False', '--tf_logs=0'):
      wanted = False
  return wanted


def quiet_tensorflow() -> None:
  """Imports TensorFlow without its C++ start-up lines. TF_CPP_MIN_LOG_LEVEL=3 (read once, at
  load) hides C++ info, warnings and errors such as `failed call to cuInit` on a CPU-only
  machine; the lines TensorFlow's shared libraries print while loading (oneDNN, CUDA drivers,
  each once per library) come before its logging is set up and ignore that level, so stderr is
  captured while importing, and every captured line that is not such a start-up line is passed
  on. Python-side warnings and errors (absl, exceptions) are unaffected, but one: TensorFlow's
  UserWarning about tf.data options in graph mode, which its own distributed-dataset reduce
  raises (a mirrored eval) and no user code can act on."""
  warnings.filterwarnings(
    'ignore', message='To make it possible to preserve tf.data options', category=UserWarning
  )
  if 'tensorflow' in sys.modules:
    return
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      import tensorflow  # noqa: F401  (imported here, while its start-up lines are captured)
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      lines = captured.read().decode(errors='replace').splitlines()
      kept = [l for l in lines if not _START_UP_LINE.match(l)]
      if kept:
        print('\n'.join(kept), file=sys.stderr)


class _OnFirstUse:
  """Stands for a module that is imported when one of its attributes is first read."""

  def __init__(self, name: str):
    self._name = name

  def __getattr__(self, attr: str):
    return getattr(importlib.import_module(self._name), attr)


@contextlib.contextmanager
def collector_paused():
  """Python's cycle collector off for the block (it is off from the launcher's start, too:
  `__main__` below), then back on with every object made so far frozen out of its later passes
  (`gc.freeze`): the modules, functions and classes of TensorFlow and Keras, which live as long
  as the process. While they imported, the collector ran about 900 times (0.5-0.7 s of a 3 s
  start at the nanoGPT shape), and its full passes during the step's tracing walked them all
  again. On between the two blocks: a supervisor of `--workers` runs there for the whole run."""
  gc.disable()
  try:
    yield
  finally:
    gc.freeze()
    gc.enable()


def import_keras() -> None:
  """Imports Keras without matplotlib. `import keras` loads keras.visualization, whose modules
  import matplotlib.pyplot and matplotlib.patches at module level for their plotting functions
  (each in a try/except ImportError): when matplotlib is installed that is a good part of a
  second of every launch, for functions training never calls. matplotlib is hidden while Keras
  loads, then each such module attribute Keras left at None (`plt`, `patches`) becomes a
  stand-in that imports the module on first use, so those functions still work. Nothing is
  done when Keras or matplotlib is already imported, or matplotlib is not installed."""
  if 'keras' in sys.modules or 'matplotlib' in sys.modules:
    return
  if importlib.util.find_spec('matplotlib') is None:
    import keras  # noqa: F401

    return
  # None in sys.modules: `import matplotlib...` raises ImportError while Keras loads.
  sys.modules['matplotlib'] = None  # type: ignore[assignment]
  try:
    import keras  # noqa: F401
  finally:
    del sys.modules['matplotlib']
  for name, module in list(sys.modules.items()):
    if not name.startswith('keras.') or module is None:
      continue
    for attr, real in (('plt', 'matplotlib.pyplot'), ('patches', 'matplotlib.patches')):
      if attr in vars(module) and vars(module)[attr] is None:
        setattr(module, attr, _OnFirstUse(real))


# absl's C++ lines before InitializeLog: "I0000 00:00:<time> <thread> <file>:<line>] ..." and
# the notice about them; the CPU-feature notice's second line.
_START_UP_LINE = re.compile(
  r'[IW]0000 00:00:|WARNING: All log messages before absl::'
  r'InitializeLog|To enable the following instructions:'
)


def _hide_tensorflow_info(record) -> bool:
  """absl handler filter: drops INFO records logged from TensorFlow's own Python files."""
  tf_module = sys.modules.get('tensorflow')
  if record.levelno >= 30 or tf_module is None or not getattr(tf_module, '__file__', None):
    return True
  return not record.pathname.startswith(os.path.dirname(tf_module.__file__) + os.sep)


def exit_now(code: int, config) -> None:
  """Ends the process once the results (or the error line) are out. Everything the run writes
  (checkpoints, TensorBoard events, config.json, exports) is written and flushed synchronously
  before this point. Once TensorFlow is loaded a normal interpreter exit spends 1-4 s in the
  interpreter's finalization (measured: TensorFlow's atexit handlers take under 1 ms and no
  thread but the main one is alive; the time goes to tearing down modules and
  garbage-collecting TensorFlow's and Keras's object graph), so this process exits at once;
  before TensorFlow is loaded a normal exit is as fast. Multi-worker and TPU runs exit
  normally: their runtimes shut down with the cluster at exit."""
  if 'tensorflow' not in sys.modules or (
    getattr(getattr(config, 'distribute', None), 'strategy', None) in ('multi_worker', 'tpu')
  ):
    sys.exit(code)
  from trainer.run import lock as workdir_lock

  workdir_lock.release_all()  # os._exit skips the atexit handler that would
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


if __name__ == '__main__':
  gc.disable()  # while TensorFlow imports: collector_paused()
  app.run(main, flags_parser=parse_flags)
