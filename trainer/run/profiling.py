"""`train.profile_steps='start,end'`: a TF profiler trace of those global steps for TensorBoard.

The trace covers whole compiled calls (`train.steps_per_loop` steps each), from the first call
that reaches `start` to the first that reaches `end`; it lands in <workdir>/tensorboard/plugins/
profile, the Profile tab of `tensorboard --logdir=<workdir>/tensorboard`.
"""

from __future__ import annotations

import tensorflow as tf
from absl import logging

from trainer.steps_text import profile_steps as parse


class StepProfiler:
  """Call `before(step)` ahead of each compiled call and `after(step)` after it."""

  def __init__(self, profile_steps: str, logdir: str):
    self.window = parse(profile_steps)
    self.logdir = logdir
    self.active = False
    self.done = False

  def before(self, step: int, next_step: int):
    """`next_step`: the global step once this call returns."""
    if self.window and not (self.active or self.done) and next_step > self.window[0]:
      logging.info('profiling from step %d into %s', step, self.logdir)
      tf.profiler.experimental.start(self.logdir)
      self.active = True

  def after(self, step: int):
    if self.active and self.window and step >= self.window[1]:
      self.stop()

  def stop(self):
    if self.active:
      tf.profiler.experimental.stop()
      logging.info('profile written to %s/plugins/profile', self.logdir)
      self.active, self.done = False, True
