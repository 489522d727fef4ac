"""Progress cadence (trainer/run/progress.py) with a fake clock, the live bar, and a resumed run's
first line and TensorBoard point."""

import io

from trainer.insight import events
from trainer.run import progress


class FakeClock:
  def __init__(self):
    self.now = 1000.0

  def __call__(self):
    return self.now


def test_first_call_then_log_every_then_every_30_seconds():
  clock = FakeClock()
  p = progress.Progress(total=10_000, log_every=1000, clock=clock, live=False)
  clock.now += 50  # the first call: tracing and compiling
  assert p.due(10)  # the first compiled call always logs
  clock.now += 5
  assert not p.due(20)
  clock.now += 24.9
  assert not p.due(30)  # 29.9 s since the last line
  clock.now += 0.2
  assert p.due(40)  # 30.1 s: a line although log_every is 960 steps away
  clock.now += 1
  assert p.due(1000)  # log_every
  clock.now += 1
  assert not p.due(1010)
  assert p.due(10_000)  # the last step


def test_a_resumed_run_logs_its_first_call():
  clock = FakeClock()
  p = progress.Progress(total=500, log_every=100, first_step=230, clock=clock, live=False)
  clock.now += 1
  assert p.due(240)
  assert not p.due(250)


def test_bar_on_a_terminal_only():
  clock = FakeClock()
  stream = io.StringIO()
  quiet = progress.Progress(total=100, log_every=50, clock=clock, stream=stream, live=False)
  quiet.draw(10)
  assert stream.getvalue() == ''
  live = progress.Progress(total=100, log_every=50, clock=clock, stream=stream, live=True)
  progress.line(
    step=0,
    total=100,
    metrics={'loss': 0.5},
    learning_rate=1e-3,
    scale=128.0,
    skipped=0,
    steps_per_sec=0.0,
  )
  clock.now += 4
  live.draw(20)
  text = stream.getvalue()
  assert text.startswith('\r[') and '20/100' in text and 'loss 0.5000 (at step 0)' in text
  assert 'scale 128' in text and '5.0 steps/s' in text and 'ETA 0:00:16' in text
  live.due(30)  # a call ended: the bar is erased before anything is logged
  assert stream.getvalue().endswith('\r\x1b[K')
  before = stream.getvalue()
  live.draw(100)  # the last step: eval and the results follow on clean lines
  assert stream.getvalue() == before
  assert progress.Progress(total=1, log_every=1, stream=io.StringIO()).live is False


def test_resumed_run_writes_a_tensorboard_point_at_its_first_call(tiny_trainer):
  # log_every 20 is far away: without the first-call line a resumed run would show nothing
  # until step 20.
  first = tiny_trainer(
    **{
      'train.steps': 5,
      'train.log_every': 20,
      'train.steps_per_loop': 5,
      'train.checkpoint_every': 5,
    }
  )
  first.train()
  resumed = tiny_trainer(
    **{
      'train.steps': 40,
      'train.log_every': 20,
      'train.steps_per_loop': 5,
      'train.checkpoint_every': 5,
    }
  )
  resumed.train()
  steps = [s for s, _ in events.read_scalars(resumed.workdir)['train/loss']]
  assert steps == [5, 10, 20, 40]
