"""Reads the scalars a run wrote to TensorBoard: {tag: [(step, value), ...]} sorted by step."""
from __future__ import annotations

import collections
import glob
import os

import tensorflow as tf
from tensorboard.backend.event_processing import event_file_loader


def read_scalars(workdir: str) -> dict[str, list[tuple[int, float]]]:
  scalars = collections.defaultdict(dict)
  pattern = os.path.join(workdir, 'tensorboard', 'events.out.tfevents.*')
  for path in sorted(glob.glob(pattern)):
    for event in event_file_loader.EventFileLoader(path).Load():
      for value in event.summary.value:
        # tf.summary.scalar writes a tensor proto; the loader migrates simple_value too
        number = float(tf.make_ndarray(value.tensor)) if value.HasField('tensor') else \
            float(value.simple_value)
        scalars[value.tag][int(event.step)] = number  # a resumed run overwrites its steps
  return {tag: sorted(points.items()) for tag, points in scalars.items()}
