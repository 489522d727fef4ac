"""How the scripts the tests run in a process of their own (tests/*_runs.py, *_run.py) end once
their results are written and closed: at once, with os._exit, as launch.py's `exit_now` does.

A normal exit tears TensorFlow's objects down, which is slow, and destroying a tf.data iterator
read with autotuning on can wait out the autotuning thread's sleep, which can miss its
cancellation in TensorFlow 2.21 (trainer/data/autotune.py: the Trainer's pipelines now
run without it; a script's own Keras `fit` pipelines may not). Seen at the end of
tests/distribute_runs.py with the 2 cores busy (as in CI, three xdist workers), before the
Trainer dropped the thread: long waits between results.json and the end of the process, every
stack in `~RootDataset::Iterator`. The multi-worker scripts are left out: their runtimes
shut down with the cluster at exit.
"""

from __future__ import annotations

import os
import sys


def exit_now() -> None:
  """Ends the process with code 0: flushes the output streams, releases workdir locks (os._exit
  skips the atexit handler that would), skips the interpreter's finalization."""
  from trainer.run import lock

  lock.release_all()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)
