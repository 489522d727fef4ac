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
       --mode=eval or export of a checkpoint whose eval loss is not finite (TrainingFailed)
  75   a worker (multi_worker) stopped by SIGTERM or Ctrl-C before its last step, its
       checkpoint saved: preempted, restart it (one process exits 0 then)
  130  a second Ctrl-C: stopped at once, nothing saved
A mistake is one line naming the culprit; --traceback (or TRAINER_TRACEBACK=1) prints the
Python traceback before it.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
import traceback

import ml_collections
from absl import app, flags, logging
from ml_collections import config_flags

import trainer
from trainer import config as config_lib
from trainer.launch import config_errors, startup
from trainer.launch.startup import collector_paused, exit_now

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
_RACE = flags.DEFINE_integer(
  'race',
  0,
  'Does mixed precision pay for this config? Train it N steps under float32, mixed_bfloat16 and '
  'mixed_float16, XLA off and on, print steps/s, step memory and loss per setting and which to '
  'use, write it to <workdir>/race.md, and exit without training.',
  lower_bound=0,
)
flags.DEFINE_integer(
  'workers',
  0,
  'Train with N worker processes on this host (loopback ports, a TF_CONFIG each); '
  "one log shows worker 0's lines and each other line of any worker once; see "
  'docs/guides/distribution.md.',
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
flags.DEFINE_bool(
  'evaluator',
  False,
  'With --workers=N: also start an evaluator side-car that evaluates each checkpoint the chief '
  "writes; with --cluster (no --task_index): be that cluster's evaluator.",
)
_EVALUATOR_TIMEOUT = flags.DEFINE_float(
  'evaluator_timeout',
  3600.0,
  "TF_CONFIG's evaluator task: end after this many seconds without a new checkpoint (it ends "
  "after the run's last step's checkpoint anyway).",
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
flags.DEFINE_string('k8s_cpu', '', "With --k8s_manifest: each pod's CPU request (e.g. 4, 500m).")
flags.DEFINE_string('k8s_memory', '', "With --k8s_manifest: each pod's memory request (e.g. 16Gi).")
flags.DEFINE_integer(
  'k8s_gpus', 0, 'With --k8s_manifest: nvidia.com/gpu per pod (request and limit).', lower_bound=0
)
flags.DEFINE_string(
  'k8s_data_claim',
  '',
  'With --k8s_manifest: a volume claim holding the data, mounted read-only at /data (point '
  '--config.data.dir there).',
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
  """absl's parser, with config mistakes turned into one line naming the flag or key
  (trainer/launch/config_errors.py). The config is loaded and checked against the schema before
  TensorFlow is imported (trainer/config.py imports none), so a mistake does not wait for it."""
  path = config_errors.config_path(argv)
  if path and not os.path.isfile(path.split(':', 1)[0]):  # before anything slow is imported
    _fail(f'--config={path}: no such file; pass a config file such as configs/mnist.py')
  quiet = not startup.tf_logs_requested(argv) and not any(
    a.startswith(('--help', '-?')) for a in argv[1:]
  )
  if quiet:  # read once, when TensorFlow loads: a config file may import it
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '3')
  try:
    rest = flags.FLAGS(argv)
    config = _CONFIG.value  # config_flags defers a file's load error to the first access
  except flags.Error as e:
    if path and '--config is required' in str(e):  # the file was given: its get_config() gave None
      _fail(config_errors.returned_none(path))
    _fail((path and config_errors.file_error(path)) or config_errors.flag_error(str(e)))
  except Exception as e:  # ml_collections raises plain KeyError/AttributeError on bad overrides
    _fail(config_errors.override_error(argv, path, e))
  if config is not None:
    _check_schema(path, config)
  if quiet:
    startup.quiet_tensorflow()
  return rest


def _check_schema(path, config) -> None:
  """Exits with the first schema mistake of `config`. An optimizer name a model registers when
  its module is imported is left to the Trainer's own check, after the model is imported."""
  if not isinstance(config, ml_collections.ConfigDict):
    _fail(config_errors.not_a_config_dict(path, type(config).__name__))
  try:
    config_lib.validate(config)
  except trainer.ConfigError as e:
    if not str(e).startswith('config.optimizer.name='):
      _fail(str(e))


def _default_workdir() -> str:
  name = os.path.splitext(os.path.basename(flags.FLAGS['config'].config_filename))[0]
  return os.path.join('runs', f'{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}')


def main(argv):
  if len(argv) > 1:
    _fail(f'unexpected arguments {argv[1:]}; overrides look like --config.train.steps=100')
  if not _TF_LOGS.value:  # TensorFlow's own Python INFO lines (e.g. checkpoint sharding)
    logging.get_absl_handler().addFilter(startup.hide_tensorflow_info)
  with collector_paused():  # TensorFlow is imported (parse_flags); trainer.run here
    from trainer.launch import workers  # --workers, --cluster, --k8s_manifest: may exit here

  role = workers.dispatch(flags.FLAGS, sys.argv, _CONFIG.value, _default_workdir)  # collector on
  # Imported here so that --help and flag errors do not wait for TensorFlow.
  with collector_paused():
    startup.import_keras()
    import models
    from trainer.errors import UserError
    from trainer.run.preemption import EXIT_PREEMPTED, Preempted

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
      from trainer.launch import diagnose

      print(diagnose.run(models.get_trainer_class, config, _WORKDIR.value, _FORENSICS.value))
      return
    trainer_class = models.get_trainer_class(config.model)
    workdir = _WORKDIR.value or _default_workdir()
    if _ADVISE.value:
      from trainer.insight import advisor

      steps, validate = _ADVISE_STEPS.value, _ADVISE_VALIDATE.value
      print(advisor.report(trainer_class, config, workdir, steps=steps, validate_steps=validate))
      return
    if _RACE.value:
      from trainer.run import race

      print(race.report(trainer_class, config, workdir, steps=_RACE.value))
      return
    trainer = trainer_class(config, workdir)
    if _AUDIT.value:
      from trainer.insight import audit

      print(audit.report(trainer))
      exit_now(0, config)
    from trainer.run import lifecycle

    if _MODE.value == 'export':
      for kind, path in lifecycle.export(trainer, _EXPORT_DIR.value).items():
        print(f'{kind}: {path}')
      exit_now(0, config)
    if role == 'evaluator':
      metrics = lifecycle.evaluate_continuously(trainer, _EVALUATOR_TIMEOUT.value)
    elif _MODE.value == 'eval':
      metrics = lifecycle.evaluate_checkpoint(trainer)
    else:
      metrics = trainer.train()
  except UserError as e:  # 2: bad input; 3: the run failed numerically (TrainingFailed)
    if _TRACEBACK.value or os.environ.get('TRAINER_TRACEBACK', '') not in ('', '0'):
      traceback.print_exception(e)
    _fail('; '.join(filter(None, (str(e).rstrip('.'), _on_disk(trainer)))), e.exit_status)
  except Preempted as e:  # SIGTERM/SIGINT: a checkpoint was saved; not a failure
    print(str(e), file=sys.stderr)
    # A worker's 0 would tell its scheduler the run is done: 75 asks for a restart.
    exit_now(EXIT_PREEMPTED if config.distribute.strategy == 'multi_worker' else 0, config)
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


if __name__ == '__main__':
  trainer.launcher_defaults()  # oneDNN's kernels and XLA's compile cache, before TensorFlow loads
  gc.disable()  # while TensorFlow imports: collector_paused()
  app.run(main, flags_parser=parse_flags)
