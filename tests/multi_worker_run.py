"""One worker of the two-process MultiWorkerMirroredStrategy test (tests/step/test_distribute.py).

  TF_CONFIG=... python tests/multi_worker_run.py WORKDIR OUT_DIR STEPS [SIGTERM_AT]

Trains MNIST for STEPS global steps (resuming from WORKDIR), then writes OUT_DIR/<task>.npz
with the final weights and OUT_DIR/<task>.json with the step it started from and ended at.
With SIGTERM_AT, worker 1 sends itself SIGTERM after the progress line of that step (a real
signal, handled like a scheduler's); every worker that stops records the Preempted it raised.
"""

from __future__ import annotations

import json
import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(workdir, out_dir, steps, sigterm_at=None):
  sys.path.insert(0, ROOT)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from distribute_runs import small_mnist

  small_mnist(4096, 1000)
  import numpy as np
  from configs import mnist
  from models.mnist_cnn import MnistCnnTrainer
  from trainer.run.preemption import Preempted

  c = mnist.get_config()
  c.data.dir = os.path.join(ROOT, '..', 'shared', 'data', 'mnist')
  c.distribute.strategy = 'multi_worker'
  c.train.batch_size = 32
  c.train.steps = int(steps)
  c.train.steps_per_loop = 2
  c.train.log_every = 2
  c.train.checkpoint_every = 2
  c.train.jit_compile = 'false'
  c.precision.policy = 'float32'
  if sigterm_at is not None:  # no scheduled save before the end: the preemption save is its own
    c.train.checkpoint_every = c.train.steps
  task = json.loads(os.environ['TF_CONFIG'])['task']
  name = f'{task["type"]}{task["index"]}'

  def preempt(event):  # a 'log' event after the progress line, as a preemption notice comes
    if (
      event.kind == 'log'
      and sigterm_at is not None
      and task['index'] == 1
      and event.step >= int(sigterm_at)
    ):
      os.kill(os.getpid(), signal.SIGTERM)

  class Trainer(MnistCnnTrainer):
    def build_actions(self):
      return [preempt]

  trainer = Trainer(c, workdir)
  start = trainer.runner.restore()
  try:
    metrics = trainer.train()
  except Preempted as e:
    with open(os.path.join(out_dir, f'{name}.json'), 'w') as f:
      json.dump(
        {
          'start': start,
          'preempted_at': e.step,
          'reason': e.signal_name,
          'checkpoint': e.checkpoint,
          'message': str(e),
        },
        f,
      )
    return
  dataset = trainer.strategy.experimental_distribute_dataset(trainer.datasets.eval)
  _, eval_count = trainer.runner.eval_loop.run(dataset)
  np.savez(os.path.join(out_dir, f'{name}.npz'), *trainer.model.get_weights())
  with open(os.path.join(out_dir, f'{name}.json'), 'w') as f:
    json.dump(
      {
        'start': start,
        'end': int(trainer.global_step.numpy()),
        'replicas': trainer.strategy.num_replicas_in_sync,
        'chief': trainer.runner.is_chief,
        'eval_count': float(eval_count),
        'scratch': trainer.runner.workdir.scratch,
        'eval': metrics,
      },
      f,
    )


if __name__ == '__main__':
  main(*sys.argv[1:])
