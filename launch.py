"""Trains a model from a config file.

  python launch.py --config=configs/mnist.py [--workdir=runs/x] [--config.train.batch_size=256]

Without --workdir a new folder under ./runs/ is made; pass the same --workdir again to resume.
A mistake in the command or config is one line naming the culprit, exit code 2.
"""
from __future__ import annotations

import datetime
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Path to a config file in configs/.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Folder for checkpoints, TensorBoard events and '
                               "config.json (default: a new folder under ./runs/).")
_MODE = flags.DEFINE_enum('mode', 'train', ['train', 'eval', 'export'],
                          'train (or resume); eval: evaluate the latest checkpoint of --workdir; '
                          'export: write it as a SavedModel and a .keras file to '
                          '<workdir>/export.')
_AUDIT = flags.DEFINE_bool('audit', False, 'Build the model, print a table of every layer\'s '
                           'dtypes and parameters with precision hazards, write it to '
                           '<workdir>/audit.md, and exit without training.')
flags.mark_flags_as_required(['config'])


def _fail(message: str) -> None:
  print(f'error: {message}', file=sys.stderr)
  sys.exit(2)


def parse_flags(argv):
  """absl's parser, with config mistakes turned into one line instead of a traceback."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _fail(str(e).splitlines()[0])
  except Exception as e:  # ml_collections raises plain KeyError/ValueError/... on bad overrides
    flag = next((a for a in argv[1:] if a.startswith('--config')), '')
    _fail(f'{flag}: {type(e).__name__}: {e}'.strip(': '))


def _default_workdir() -> str:
  name = os.path.splitext(os.path.basename(flags.FLAGS['config'].config_filename))[0]
  return os.path.join('runs', f'{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}')


def main(argv):
  if len(argv) > 1:
    _fail(f'unexpected arguments {argv[1:]}; overrides look like --config.train.steps=100')
  # Imported here so that --help and flag errors do not wait for TensorFlow.
  import models
  from trainer.errors import UserError
  config = _CONFIG.value
  if _MODE.value != 'train' and not _WORKDIR.value:
    _fail(f'--mode={_MODE.value} needs --workdir=<the folder of a training run>')
  try:
    trainer_class = models.get_trainer_class(config.model)
    trainer = trainer_class(config, _WORKDIR.value or _default_workdir())
    if _AUDIT.value:
      from trainer import audit
      print(audit.report(trainer))
      return
    from trainer import lifecycle
    if _MODE.value == 'export':
      for kind, path in lifecycle.export(trainer).items():
        print(f'{kind}: {path}')
      return
    if _MODE.value == 'eval':
      metrics = lifecycle.evaluate_checkpoint(trainer)
    else:
      metrics = trainer.train()
  except UserError as e:
    _fail(str(e))
  logging.info('workdir: %s', trainer.workdir)
  print('final eval: ' + ', '.join(f'{k} {v:.4f}' for k, v in metrics.items()))
  if 'accuracy' in metrics:
    print(f'accuracy: {metrics["accuracy"]:.4f}')


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
