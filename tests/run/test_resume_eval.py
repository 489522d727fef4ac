"""An eval cut by Ctrl-C is redone by the resumed run.

The checkpoint of an eval step is written before its eval (nothing trained is lost when the eval
fails or hangs), so a run stopped during the eval at step N resumes from ckpt-N. It used to train
on from there: step N's eval results never existed. The run folder now records each completed
eval (checkpoints/evaluated.json) and a resumed run evaluates its restored step first when that
step was due an eval the record does not hold."""

import os
import signal
import time

import pytest

from models.mnist_mlp import MnistMlpTrainer
from tiny import TinyTrainer, tiny_config
from trainer.insight.events import read_scalars
from trainer.run.preemption import Preempted


class SmallEvalMlp(MnistMlpTrainer):
  """The MNIST MLP with an eval set of 4 batches (128 test images): a short eval."""

  def build_datasets(self):
    datasets = super().build_datasets()
    return datasets._replace(eval=datasets.eval.take(4))


def mlp_config(mnist_dir):
  return tiny_config(
    **{
      'data.dir': mnist_dir,
      'train.steps': 20,
      'train.checkpoint_every': 10,
      'train.eval_every': 10,
    }
  )


def cut_next_eval(trainer, how: str) -> None:
  """Ends the trainer's next eval as Ctrl-C does: 'raise' raises KeyboardInterrupt in it (Python
  with no watcher); 'signal' sends this process SIGINT, which the run's watcher turns into a stop
  between eval batches (launch.py), then runs the eval, which stops at its first batch."""
  loop = trainer.runner.eval_loop
  original = loop.evaluate

  def evaluate(dataset, *, stop=None, **kwargs):
    loop.evaluate = original  # once
    if how == 'raise':
      raise KeyboardInterrupt
    os.kill(os.getpid(), signal.SIGINT)
    deadline = time.monotonic() + 60
    while not stop() and time.monotonic() < deadline:  # the handler runs in the main thread
      time.sleep(0.01)
    return original(dataset, stop=stop, **kwargs)

  loop.evaluate = evaluate


def eval_steps(workdir) -> list[int]:
  return [step for step, _ in read_scalars(str(workdir)).get('eval/loss', [])]


# The SIGINT case trains the MLP twice more: slow; the raised case stays quick.
@pytest.mark.parametrize(
  'how, raised',
  [('raise', KeyboardInterrupt), pytest.param('signal', Preempted, marks=pytest.mark.slow)],
)
def test_an_eval_cut_by_ctrl_c_is_redone_on_resume(mnist_dir, tmp_path, caplog, how, raised):
  workdir = tmp_path / 'w'
  first = SmallEvalMlp(mlp_config(mnist_dir), str(workdir))
  cut_next_eval(first, how)  # the eval at step 10, after ckpt-10 is saved
  with pytest.raises(raised):
    first.train()
  assert os.path.exists(workdir / 'checkpoints' / 'ckpt-10.index')
  assert eval_steps(workdir) == []
  with caplog.at_level('INFO'):
    metrics = SmallEvalMlp(mlp_config(mnist_dir), str(workdir)).train()
  assert eval_steps(workdir) == [10, 20]  # before: [20], step 10's eval never happened
  said = [r.getMessage() for r in caplog.records]
  assert any('no completed eval at step 10' in m for m in said), said
  assert any(m.startswith('eval at step 10: loss') for m in said), said
  assert 0 <= metrics['accuracy'] <= 1


def test_a_completed_eval_is_not_redone_on_resume(tmp_path):
  seen = []

  class Watched(TinyTrainer):
    def build_actions(self):
      return [lambda e: seen.append(e.step) if e.kind == 'eval' else None]

  keys = {'train.eval_every': 5}
  Watched(tiny_config(**keys, **{'train.steps': 10}), str(tmp_path / 'w')).train()
  assert seen == [5, 10]
  Watched(tiny_config(**keys, **{'train.steps': 20}), str(tmp_path / 'w')).train()
  assert seen == [5, 10, 15, 20]  # step 10, the restored step, was evaluated already


def test_a_new_run_forgets_the_evals_of_checkpoints_that_are_gone(tmp_path):
  """A run folder whose checkpoints were deleted starts again from step 0; the eval record of
  the old run (step 10) must not count for the new run's step 10."""
  workdir = tmp_path / 'w'
  TinyTrainer(tiny_config(**{'train.steps': 10}), str(workdir)).train()
  for name in os.listdir(workdir / 'checkpoints'):
    if name.startswith(('ckpt-', 'checkpoint')):
      os.remove(workdir / 'checkpoints' / name)
  trainer = TinyTrainer(tiny_config(**{'train.steps': 10}), str(workdir))
  trainer.runner.restore()
  assert trainer.runner.workdir.evaluated_step() is None
