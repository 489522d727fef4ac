"""The forensic stop and replay: a skipped step that gets forensics is replayed from its own batch.

With forensics on (config.numerics.forensics_first, forensics_every), each compiled call of the
train loop (trainer/step/loop.py) is told the skip to stop after: the next one that gets
forensics (`forensics.RateLimiter`). The call ends right after that step, with its batch kept on
the device and the weights still the ones it started from (a skipped step changes none); the step
is replayed eagerly, layer by layer, and written to <workdir>/forensics/step-N/
(`forensics.record`, on the chief only); then a second call runs the rest of the steps asked for.
The runner (trainer/run/runner.py) runs every compiled call through `ForensicStop.run`.
"""

from __future__ import annotations

from absl import logging

from trainer.errors import UserError
from trainer.insight import forensics


class ForensicStop:
  """Runs `loop` (a TrainLoop) for `trainer`; `workdir` is the run folder (its `is_chief` and
  `open_for_writing(step)`); `numerics`: config.numerics (which skips get forensics)."""

  def __init__(self, trainer, loop, workdir, numerics):
    self.trainer, self.loop, self.workdir = trainer, loop, workdir
    self.limiter = forensics.RateLimiter(numerics.forensics_first, numerics.forensics_every)

  def run(self, iterator, num_steps: int, check) -> int:
    """`num_steps` steps from `iterator` in one compiled call, or two and more when a skip that
    gets forensics ended one early (replayed before the next); `check(counters)` after each
    call raises what the call found (StepState.check). Returns the global step after them."""
    loop, state = self.loop, self.trainer.train_step.state
    target = None  # the global step to reach: the first call's start + num_steps
    skipped = state.skipped() if loop.forensics else 0
    while True:
      if loop.forensics:  # the compiled loop stops after the next skip that gets forensics
        stop_at = self.limiter.next_after(skipped)
        loop.stop_after_skip(stop_at)
      counters = loop.run(iterator, num_steps)
      if target is None:
        target = counters.first_step + num_steps
      skipped, step = counters.skipped_steps, counters.global_step
      check(counters)
      if step >= target:
        break
      # Stopped early, right after a skipped step: replay it, then run the rest of the call.
      self.replay(step - 1)
      num_steps = target - step
    if loop.forensics and skipped == stop_at:
      self.replay(step - 1)  # the skip was the call's last step
    return step

  def replay(self, step: int) -> None:
    """Replays skipped step `step` eagerly, layer by layer, from the current weights (a skip
    changed none), and writes <workdir>/forensics/step-N/ (trainer/insight/forensics.py)."""
    if not self.workdir.is_chief:
      return
    tr = self.trainer
    # The step's own batch, kept on the device by the compiled loop when it stopped after the
    # skip (trainer/step/kept_batch.py: re-reading element N of the pipeline gives another
    # batch when it reshuffles, augments at random or is non-deterministic).
    kept = self.loop.kept_batch
    batch = kept.read() if kept is not None else None
    if batch is None:
      logging.warning(
        "step %d: the skipped step's batch was not kept; replaying element %d of "
        'datasets.train, which differs when the pipeline reshuffles',
        step,
        step,
      )
      batch = next(iter(tr.datasets.train.skip(step)))
    self.workdir.open_for_writing(step)
    try:
      scale = float(tr.train_step.state.guard.last_scale.numpy())  # the skipped group's
      forensics.record(tr, batch, step, loss_scale=scale)
    except UserError as e:  # a planted symlink, a full disk: refused, said in one line
      logging.warning('step %d: %s; training goes on', step, e)
    except Exception as e:  # pylint: disable=broad-except  (diagnostics never end a run)
      logging.warning(
        'step %d: the forensic replay failed (%s: %s); training goes on',
        step,
        type(e).__name__,
        (str(e).strip().splitlines() or [''])[-1][:200],
      )
