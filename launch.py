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
flags.mark_flags_as_required(['config'])


def _fail(message: str) -> None:
  print(f'error: {message}', file=sys.stderr)
  sys.exit(2)


def parse_flags(argv):
  """absl's parser, with config mistakes turned into one line instead of a traceback."""
  try:
    rest = flags.FLAGS(argv)
    _CONFIG.value.get('model')  # config_flags defers a file's load error to the first access
    return rest
  except flags.Error as e:
    _fail(str(e).splitlines()[0])
  except Exception as e:  # ml_collections raises plain KeyError/AttributeError/... on overrides
    _fail(_explain(e, argv))


def _explain(error: Exception, argv) -> str:
  """One line naming the override or file behind an ml_collections error."""
  while error.args and isinstance(error.args[0], BaseException):
    error = error.args[0]  # ml_collections wraps the KeyError of a bad key in an AttributeError
  text = error.args[0] if error.args and isinstance(error.args[0], str) else str(error)
  # A bad key reads "'name'\nDid you mean ...?"; a bad file ends with its errno line.
  lines = [line.strip(' \'"') for line in text.splitlines() if line.strip(' \'"')]
  config_file = next((a.split('=', 1)[1] for a in argv[1:] if a.startswith('--config=')), '')
  if isinstance(error, KeyError) and lines:
    for flag in (a.split('=', 1)[0] for a in argv[1:] if a.startswith('--config.')):
      if lines[0] in flag.split('.'):
        return f'{flag}: unknown config key. {" ".join(lines[1:2])}'.strip()
  if isinstance(error, OSError):
    reason = text.strip().splitlines()[-1].strip()
    return f'--config={config_file}: cannot load the config file ({reason}).'
  if isinstance(error, AttributeError) and 'get_config' in text:
    return f'--config={config_file}: the file defines no get_config() function.'
  return f'{type(error).__name__}: {lines[0] if lines else repr(error)}'


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
  try:
    trainer_class = models.get_trainer_class(config.model)
    trainer = trainer_class(config, _WORKDIR.value or _default_workdir())
    metrics = trainer.train()
  except UserError as e:
    _fail(str(e))
  logging.info('workdir: %s', trainer.workdir)
  print('final eval: ' + ', '.join(f'{k} {v:.4f}' for k, v in metrics.items()))
  if 'accuracy' in metrics:
    print(f'accuracy: {metrics["accuracy"]:.4f}')


if __name__ == '__main__':
  app.run(main, flags_parser=parse_flags)
