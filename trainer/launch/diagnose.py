"""launch.py --mode=diagnose: replay one batch and name where it first went non-finite.

With --forensics=<workdir>/forensics/step-N: rebuilds the trainer (from the folder's config
unless --config is given), restores the folder's weights, replays its batch and prints the
report's line. With --workdir alone: restores the run's latest checkpoint (or keeps the initial
weights, for a model that overflows at once) and records its next batch as a new folder.
Read-only, as eval and export (no lock, config record or event file); only the forensic folder
is written (docs/guides/numerics.md).
"""

from __future__ import annotations

import os

import ml_collections
from absl import logging

from trainer.errors import UserError
from trainer.insight import forensics
from trainer.run import checkpoint_files, lifecycle


def run(trainer_class_for, config, workdir: str | None, folder: str | None) -> str:
  """The report's line; `trainer_class_for(model_name)` gives the Trainer subclass."""
  if not folder:
    trainer = trainer_class_for(config.model)(config, workdir)
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
    return (
      f'step {step}, loss scale {float(trainer.loss_scaler.scale.numpy()):g}: '
      f'{report.line()}\nforensics: {forensics.folder_for(trainer.workdir, step)}'
    )
  saved = forensics.load(folder)
  if config is None:
    if not saved.config:
      raise UserError(
        f"--forensics={folder}: meta.json holds no config; pass --config=<the run's config>"
      )
    config = ml_collections.ConfigDict(saved.config)
  workdir = workdir or os.path.dirname(os.path.dirname(os.path.abspath(folder)))
  trainer = trainer_class_for(config.model)(config, workdir)
  report = forensics.replay_folder(trainer, folder)
  return f'step {saved.step}, loss scale {saved.loss_scale:g}: {report.line()}'
