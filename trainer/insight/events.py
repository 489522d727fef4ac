"""Reads the scalars a run wrote to TensorBoard: {tag: [(step, value), ...]} sorted by step."""

from __future__ import annotations

import collections
import glob
import os

import tensorflow as tf
from tensorboard.backend.event_processing import event_file_loader


def read_scalars(workdir: str) -> dict[str, list[tuple[int, float]]]:
  scalars: dict[str, dict[int, float]] = collections.defaultdict(dict)
  pattern = os.path.join(workdir, 'tensorboard', 'events.out.tfevents.*')
  for path in sorted(glob.glob(pattern)):
    for event in event_file_loader.EventFileLoader(path).Load():
      for value in event.summary.value:
        # tf.summary.scalar writes a tensor proto; the loader migrates simple_value too
        number = (
          float(tf.make_ndarray(value.tensor))
          if value.HasField('tensor')
          else float(value.simple_value)
        )
        scalars[value.tag][int(event.step)] = number  # a resumed run overwrites its steps
  return {tag: sorted(points.items()) for tag, points in scalars.items()}


def read_wall_times(workdir: str, tag: str) -> list[tuple[int, float]]:
  """[(step, wall time in seconds since the epoch)] of one scalar tag, sorted by step (the last
  write of a step wins, as in read_scalars)."""
  times = {}
  pattern = os.path.join(workdir, 'tensorboard', 'events.out.tfevents.*')
  for path in sorted(glob.glob(pattern)):
    for event in event_file_loader.EventFileLoader(path).Load():
      if any(value.tag == tag for value in event.summary.value):
        times[int(event.step)] = float(event.wall_time)
  return sorted(times.items())
