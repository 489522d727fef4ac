"""For tests/insight/test_forensics.py: the replay after a compiled step that used XLA on 2
replicas.

Logical devices must be configured before TensorFlow runs any op, hence a fresh process:
`python tests/forensics_mirrored_run.py WORKDIR`. It builds the overflow demo under
MirroredStrategy on 2 logical CPUs with jit_compile, runs 2 compiled steps (both skipped: the
forward pass overflows), records the first batch's forensics and prints, one per line: the
replica count, the skipped steps, the recorded report and the report replayed from the folder.
"""

from __future__ import annotations

import os
import sys

import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(workdir):
  cpu = tf.config.list_physical_devices('CPU')[0]
  tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
  import models
  from trainer import config as config_lib
  from trainer.insight import forensics

  config = config_lib.load_file(os.path.join(ROOT, 'configs', 'overflow_demo.py'))
  config.data.dir = os.path.join(ROOT, '..', 'shared', 'data', 'mnist')
  config.distribute.strategy = 'mirrored'
  config.distribute.devices = 'CPU:0,CPU:1'
  config.train.jit_compile = 'true'
  trainer = models.get_trainer_class('overflow_demo')(config, workdir)
  first_batch = next(iter(trainer.datasets.train))
  iterator = iter(trainer.strategy.experimental_distribute_dataset(trainer.datasets.train))
  trainer.runner._run_steps(iterator, 2)
  report = forensics.record(trainer, first_batch, 0)
  replayed = forensics.replay_folder(trainer, forensics.folder_for(workdir, 0))
  print(trainer.strategy.num_replicas_in_sync)
  print(int(trainer.train_step.skipped_steps.numpy()))
  print(report.line())
  print(replayed.line())


if __name__ == '__main__':
  main(sys.argv[1])
  from quick_exit import exit_now

  exit_now()  # the lines are printed; skip TensorFlow's teardown (tests/quick_exit.py)
