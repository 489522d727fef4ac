"""What the Runner does when training goes wrong: one policy for divergence and recovery.

At each progress line the policy asks the divergence rule (trainer/insight/divergence.py) about
the logged loss and records the loss's health (trainer/run/health.py: what makes the next save
the last healthy checkpoint). When the loss diverged, the collapse guard stopped the compiled
loop (CollapseError), or the state is not finite (NonFiniteError: an applied update left a
weight or an optimizer slot non-finite, trainer/step/step_state.py, or a save found one),

  * with `train.recover_tries` left, it restores the last healthy checkpoint and the run goes on
    from its step with the data after the failure, the learning rate multiplied by
    `train.recover_lr_factor` once more (the factor is a variable the schedule reads:
    trainer/optim/optimizers.py's Recoverable, checkpointed as 'lr_factor');
  * else a collapse or a non-finite state raises as without recovery (saying so when tries
    were left but no checkpoint is healthy), and a divergence stops the run
    (DivergenceError) with `numerics.divergence_stop`, or is left to the collapse guard.
"""

from __future__ import annotations

from collections.abc import Callable

from absl import logging

from trainer.errors import DivergenceError, TrainingFailed
from trainer.insight.divergence import DivergenceMonitor
from trainer.run import checkpoints, health


class Recovery:
  """The policy of one run. `workdir` is the run folder (trainer/run/workdir.py), `items` the
  checkpoint items it restores, `factor` the schedule's recovery factor (a tf.Variable, or None
  when train.recover_lr_factor is 1), `global_step` the trainer's; `clock` counts redone steps
  and `write_scalars(prefix, values, step)` writes TensorBoard points."""

  def __init__(self, config, *, workdir, items, factor, global_step, clock, write_scalars):
    self.tries = int(config.train.recover_tries)
    self.lr_factor = float(config.train.recover_lr_factor)
    self.divergence_stop = bool(config.numerics.divergence_stop)
    self.divergence = DivergenceMonitor(config.numerics.divergence_factor)
    self.health = health.Health()
    self.recoveries = 0
    self.workdir, self.items, self.factor = workdir, items, factor
    self.global_step, self.clock, self.write_scalars = global_step, clock, write_scalars

  def start(self, first_loss: Callable[[], float], resumed: bool = False) -> None:
    """Before the first step of this process: the loss at the current weights (a forward pass,
    made only when the divergence rule is on) starts the divergence rule; `resumed` when the
    weights are trained already (a resume, `train.init_from`: trainer/insight/divergence.py)."""
    if self.divergence.factor > 0:
      self.divergence.start(first_loss(), resumed=resumed)

  def healthy(self, consecutive_skips: int) -> bool:
    """Whether a save now is healthy (trainer/run/health.py)."""
    return self.health.healthy(consecutive_skips)

  def after_log(self, step: int, logged: dict[str, float], rate: float | None) -> int:
    """At a progress line (`logged`: its metrics, `rate`: the learning rate): the step to go
    on from, `step` itself unless a divergence was recovered from."""
    line = None
    if 'loss' in logged:
      line = self.divergence.update(step, logged['loss'], rate)
      if line is not None and not self.tries:  # else recover() says it, once, with what it did
        logging.warning(line)
    self.health.observe(logged.get('loss'), diverged=line is not None)
    if line is None:
      return step
    if self.tries:  # the last healthy checkpoint, unless no try is left
      restored = self.recover(line)
      if restored != step:
        return restored
    if self.divergence_stop:  # the newest checkpoint was written before the divergence
      newest = self.workdir.latest_checkpoint
      raise DivergenceError(
        line
        + '. Stopped (config.numerics.divergence_stop=True); '
        + (f'the newest checkpoint, {newest}, was written before it' if newest else '')
        + ('' if newest else 'no checkpoint was written yet')
      )
    return step

  def after_collapse(self, error: TrainingFailed) -> int:
    """After the collapse guard stopped a compiled call (CollapseError) or a non-finite state
    (NonFiniteError): the restored step, or `error` raised when no try is left."""
    return self.recover(str(error), error=error)

  def recover(self, reason: str, error: Exception | None = None) -> int:
    """Restores the last healthy checkpoint and returns its step (the data iterator goes on
    past the batches that failed); at most train.recover_tries times. Then a collapse raises
    as without recovery and a divergence is left to the collapse guard (its step returned)."""
    record = self.workdir.healthy_record()
    failed = int(self.global_step.numpy())
    if self.recoveries >= self.tries or record is None:
      return self._give_up(reason, record, failed, error)
    # The factor in use now, lowered once more (the restore puts back the checkpoint's).
    factor = float(self.factor.numpy()) * self.lr_factor if self.factor is not None else 1.0
    path = self.workdir.healthy_path()
    assert path is not None  # a record names it (checked above)
    checkpoints.restore(self.items, path)
    self.recoveries += 1
    if self.factor is not None:
      self.factor.assign(factor)
    step = int(self.global_step.numpy())
    self.health.bad = False
    self.clock.redone(failed - step)
    logging.warning(
      'recovery %d of %d: %s; restored the checkpoint (%s) and go on from step %d '
      'with the data after step %d%s',
      self.recoveries,
      self.tries,
      reason.split('. ')[0],
      health.describe(record),
      step,
      failed,
      f', learning rate x{factor:g}' if self.factor is not None else '',
    )
    self.write_scalars(
      'recovery',
      {'recoveries': self.recoveries, 'redone_steps': failed - step, 'lr_factor': factor},
      failed,
    )
    return step

  def _give_up(self, reason: str, record, failed: int, error: Exception | None) -> int:
    if error is None:
      logging.warning(
        '%s; %s (%d of config.train.recover_tries=%d done, %s)',
        reason,
        'no recovery left' if self.recoveries >= self.tries else 'no checkpoint to recover to',
        self.recoveries,
        self.tries,
        health.describe(record),
      )
      return failed
    if self.recoveries < self.tries:  # tries left, but nothing healthy to go back to
      raise type(error)(
        f'{error} (config.train.recover_tries={self.tries}: no recovery, for no checkpoint of '
        'this run is healthy)'
      ) from None
    if self.recoveries:
      raise type(error)(
        f'{error} ({self.recoveries} recoveries of config.train.recover_tries={self.tries} done)'
      ) from None
    raise error
