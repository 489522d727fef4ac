"""The console progress: when a line is due, the line itself, and a live bar on a terminal.

`Progress.due(step, now)` is True after a run's first compiled call (a resumed run's too), every
`log_every` steps, at the last step, and whenever `max_interval` seconds of wall time passed
since the last line: a slow run (float16 emulated on a CPU, a large model) still shows progress;
while one compiled call runs longer, `heartbeat` gives a line ('in steps 100-200, 35 s') every
`max_interval` seconds. Each due line also writes TensorBoard points (the trainer's
log_progress). On a terminal (stderr is a tty) `draw(step, now)` redraws a one-line bar between
calls (steps, the last line's loss and scale: fresh ones would cost a host read per call;
steps/s, ETA); elsewhere logs stay plain lines. The clock is injectable for tests.
"""

from __future__ import annotations

import datetime
import sys
import time

MAX_INTERVAL = 30.0  # seconds of wall time without a progress line, at most
_last_values: dict[str, float] = {}  # the loss and scale of the last line, shown by the bar


def _eta(remaining_steps: int, steps_per_sec: float) -> str:
  if steps_per_sec <= 0:
    return '?'
  return str(datetime.timedelta(seconds=round(remaining_steps / steps_per_sec)))


def _named(label: str, values: float | dict[str, float], text) -> str:
  """'lr 1.00e-03' for one value, 'lr d=1.00e-03 g=2.00e-04' for one per group."""
  if not isinstance(values, dict):
    return f'{label} {text(values)}'
  if len(values) == 1:
    return f'{label} {text(next(iter(values.values())))}'
  return f'{label} ' + ' '.join(f'{name}={text(v)}' for name, v in values.items())


def line(
  *,
  step: int,
  total: int,
  metrics: dict[str, float],
  learning_rate: float | dict[str, float],
  scale: float | dict[str, float],
  skipped: int,
  steps_per_sec: float,
  nonfinite_loss: int = 0,
  steps: int = 0,
) -> str:
  """The progress line. `learning_rate` and `scale` are one value, or one per update group
  ({group name: value}, `learning_rates` and `loss_scales`): each group's shown when there are
  several. `metrics` are means over the `steps` steps since the last line whose loss was
  finite; the `nonfinite_loss` others are said right after them, where the means are read."""
  first = next(iter(scale.values())) if isinstance(scale, dict) else scale
  _last_values.clear()
  _last_values.update({'loss': metrics.get('loss', float('nan')), 'scale': first, 'step': step})
  shown = ' '.join(f'{k} {v:.4f}' for k, v in metrics.items()) + _nonfinite(nonfinite_loss, steps)
  return (
    f'step {step}/{total} ({100.0 * step / max(total, 1):.0f}%) | {shown} | '
    f'{_named("lr", learning_rate, lambda v: f"{v:.2e}")} | '
    f'{_named("scale", scale, lambda v: f"{v:g}")} | skipped {skipped} | '
    f'{rate_text(steps_per_sec)} steps/s | ETA {_eta(total - step, steps_per_sec)}'
  )


def rate_text(per_sec: float) -> str:
  """A rate to 3 significant digits (1.55, 38.5, 152): one decimal would make 1.5 anything from
  1.45 to 1.55, a 7 % band at the slow rates where a speed-up is judged."""
  return f'{per_sec:.0f}' if per_sec >= 100 else f'{per_sec:#.3g}'


def _nonfinite(count: int, steps: int) -> str:
  """' (non-finite loss in 3 of 10 steps; means of the other 7)' after the metrics when a step's
  loss was not finite (its outputs are left out of the means; none left: the means are NaN)."""
  if not count:
    return ''
  of = f' of {steps}' if steps >= count else ''
  rest = f'; means of the other {steps - count}' if steps > count else ''
  return f' (non-finite loss in {count}{of} steps{rest})'


def group_name(group, index: int) -> str:
  """An update group's name: its own `name`, else its index in the step's groups."""
  return getattr(group, 'name', '') or str(index)


def learning_rates(groups) -> dict[str, float]:
  """{group name: the learning rate its optimizer uses at its next update}, read from each
  distinct optimizer of the update groups (`TrainStep.groups`): a schedule of the optimizer's
  own is what it reports, not config.optimizer's."""
  return _per_distinct(groups, lambda g: g.optimizer, lambda o: float(o.learning_rate))


def loss_scales(groups) -> dict[str, float]:
  """{group name: its loss scale}, one entry per distinct loss scaler of the update groups."""
  return _per_distinct(groups, lambda g: g.loss_scaler, lambda s: float(s.scale.numpy()))


def _per_distinct(groups, part, read) -> dict[str, float]:
  values: dict[str, float] = {}
  seen: set[int] = set()
  for index, group in enumerate(groups):
    if id(part(group)) not in seen:
      seen.add(id(part(group)))
      values[group_name(group, index)] = read(part(group))
  return values


def scalars(name: str, values: dict[str, float]) -> dict[str, float]:
  """TensorBoard scalars of per-group `values`: `name` is the first group's (the only one's),
  and with several, `name/<group>` each."""
  first = {name: next(iter(values.values()))} if values else {}
  return first if len(values) < 2 else {**first, **{f'{name}/{k}': v for k, v in values.items()}}


class Progress:
  """Cadence of the progress lines and the live bar of one `train()` call."""

  def __init__(
    self,
    *,
    total: int,
    log_every: int,
    first_step: int = 0,
    max_interval: float = MAX_INTERVAL,
    clock=time.monotonic,
    stream=None,
    live: bool | None = None,
  ):
    self.total = int(total)
    self.log_every = int(log_every)
    self.max_interval = float(max_interval)
    self.clock = clock
    self.stream = stream or sys.stderr
    self.live = live if live is not None else bool(getattr(self.stream, 'isatty', lambda: False)())
    self._first = True
    self._last_line = clock()
    self._start = (first_step, self._last_line)  # for the bar's steps/s over the whole run
    self._drawn = False
    self._timed = (0.0, 0)  # seconds and steps of the calls since the last line
    self._last_beat = -float('inf')  # the last heartbeat line

  def heartbeat(self, first: int, last: int, started: float, now: float | None = None):
    """While a compiled call of steps `first` to `last` runs (since `started`, on this clock):
    a line when `max_interval` seconds passed since the last line of either kind, so that no
    gap between lines passes it and a slow call is told from a stuck one; else None."""
    now = self.clock() if now is None else now
    if now - max(self._last_line, self._last_beat) < self.max_interval:
      return None
    self.clear()
    self._last_beat = now
    return f'in steps {first}-{last}, {now - started:.0f} s'

  def timed(self, seconds: float, steps: int) -> None:
    """A compiled call of `steps` steps took `seconds`: counted in the next line's steps/s."""
    self._timed = (self._timed[0] + seconds, self._timed[1] + steps)

  def steps_per_sec(self) -> float:
    """Steps per second of the calls since the last line (then counted from zero again)."""
    (seconds, steps), self._timed = self._timed, (0.0, 0)
    return steps / seconds if seconds > 0 else 0.0

  def due(self, step: int, now: float | None = None) -> bool:
    """Whether the call that reached `step` gets a progress line; records it when it does."""
    now = self.clock() if now is None else now
    self.clear()  # the bar is shown during a call; what the host logs after it starts clean
    due = (
      self._first
      or step % self.log_every == 0
      or step >= self.total
      or now - self._last_line >= self.max_interval
    )
    if due:
      self._first = False
      self._last_line = now
    return due

  def bar(self, step: int, now: float, width: int = 24) -> str:
    """The bar's text: [#####.....] step/total, loss, scale, steps/s, ETA."""
    start_step, start_time = self._start
    rate = (step - start_step) / (now - start_time) if now > start_time else 0.0
    filled = int(width * step / max(self.total, 1))
    parts = [f'[{"#" * filled}{"." * (width - filled)}] {step}/{self.total}']
    if 'loss' in _last_values:
      parts.append(f'loss {_last_values["loss"]:.4f} (at step {_last_values["step"]})')
      parts.append(f'scale {_last_values["scale"]:g}')
    parts += [f'{rate_text(rate)} steps/s', f'ETA {_eta(self.total - step, rate)}']
    return ' | '.join(parts)

  def draw(self, step: int, now: float | None = None) -> None:
    """Redraws the bar in place (a terminal only; not after the last step, when eval and the
    results follow)."""
    if not self.live or step >= self.total:
      return
    now = self.clock() if now is None else now
    self.stream.write('\r' + self.bar(step, now) + '\x1b[K')
    self.stream.flush()
    self._drawn = True

  def clear(self) -> None:
    """Erases the bar so that a log line starts on a clean line."""
    if self._drawn:
      self.stream.write('\r\x1b[K')
      self.stream.flush()
      self._drawn = False
