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
  assert 'scale 128' in text and '5.00 steps/s' in text and 'ETA 0:00:16' in text
  live.due(30)  # a call ended: the bar is erased before anything is logged
  assert stream.getvalue().endswith('\r\x1b[K')
  before = stream.getvalue()
  live.draw(100)  # the last step: eval and the results follow on clean lines
  assert stream.getvalue() == before
  assert progress.Progress(total=1, log_every=1, stream=io.StringIO()).live is False


def test_the_line_says_which_steps_its_means_leave_out():
  """The means are over the steps whose loss was finite: the line says how many of its steps
  were not, right after the means (NaN when none was finite)."""
  common = dict(step=10, total=100, learning_rate=1e-3, scale=1.0, skipped=0, steps_per_sec=1.0)
  some = progress.line(
    metrics={'loss': 0.5, 'accuracy': 0.75}, nonfinite_loss=3, steps=10, **common
  )
  assert (
    '| loss 0.5000 accuracy 0.7500 (non-finite loss in 3 of 10 steps; means of the other 7) |'
    in some
  )
  nan = float('nan')
  every = progress.line(metrics={'loss': nan}, nonfinite_loss=10, steps=10, **common)
  assert '| loss nan (non-finite loss in 10 of 10 steps) |' in every
  finite = progress.line(metrics={'loss': 0.5}, steps=10, **common)
  assert '| loss 0.5000 |' in finite and 'non-finite' not in finite


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


def test_a_long_compiled_call_gets_a_heartbeat_line():
  """Issue 35: a long 100-step call of a float16 run printed no line until it ended."""
  clock = FakeClock()
  p = progress.Progress(total=10_000, log_every=1000, clock=clock, live=False)
  assert p.due(100)  # a progress line at 1000.0
  started = clock.now
  clock.now += 29.0
  assert p.heartbeat(100, 200, started) is None
  clock.now += 1.5
  assert p.heartbeat(100, 200, started) == 'in steps 100-200, 30 s'
  clock.now += 20.0
  assert p.heartbeat(100, 200, started) is None  # 20 s since the heartbeat
  clock.now += 10.0
  assert p.heartbeat(100, 200, started) == 'in steps 100-200, 60 s'
  clock.now += 5.0
  assert p.due(200)  # the call ended 65.5 s after the last progress line: a line with the loss


def test_a_run_says_it_traces_and_beats_during_a_call(tmp_path, caplog, monkeypatch):
  import logging

  from tiny import TinyTrainer, tiny_config

  monkeypatch.setattr(progress, 'MAX_INTERVAL', 0.0)  # a heartbeat at every wait of the host
  trainer = TinyTrainer(tiny_config(**{'train.steps': 5}), str(tmp_path / 'w'))
  with caplog.at_level(logging.INFO):
    trainer.train()
  lines = [r.getMessage() for r in caplog.records]
  first = lines.index('tracing and compiling the train step (the first call: steps 0-5)')
  assert any(l.startswith('in steps 0-5, ') for l in lines[first:]), lines


def test_rate_has_three_significant_digits():
  # The shown rate's relative error is at most half a unit in its third digit: a 1.45 and a 1.55
  # steps/s run no longer print the same.
  for rate in (0.123456, 1.45, 1.55, 5.0, 38.46, 99.94, 152.4, 1234.5):
    text = progress.rate_text(rate)
    assert abs(float(text) - rate) / rate <= 0.005 + 1e-12, (rate, text)
    assert len(text.replace('.', '').lstrip('0')) >= 3, (rate, text)
  assert progress.rate_text(1.45) != progress.rate_text(1.55)
