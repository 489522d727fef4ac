"""Errors a user can fix: the launcher prints them as one line, never a traceback.

The launcher's exit status says which kind (README.md, docs/guides/troubleshooting.md): 2 for
a mistake in the input (`UserError`: the command, config, data or model code), 3 for a run whose
numbers failed (`TrainingFailed`: it collapsed, diverged, ended at chance or is not finite).
"""


class UserError(ValueError):
  """Base class: something in the user's config, data or command is wrong.

  The message names the culprit (a config key, a file, a step) and says what to do.
  """

  exit_status = 2


class ConfigError(UserError):
  """A config key has a bad value or does not exist."""


class DataError(UserError):
  """A dataset file is missing, truncated or malformed."""


class TrainingFailed(UserError):
  """The input was accepted but the run's numbers failed: exit status 3, one line naming the
  step and what is on disk. A UserError still (one line, no traceback, the same `except`)."""

  exit_status = 3


class CollapseError(TrainingFailed):
  """Training stopped: too many steps in a row had non-finite gradients (see skip_guard.py)."""


class NonFiniteError(TrainingFailed):
  """The training state or an eval is not finite: nothing non-finite is saved."""


class DivergenceError(TrainingFailed):
  """The loss diverged: config.numerics.divergence_stop stopped the run, or it finished diverged
  or at chance (trainer/run/health.py's check_end)."""


def message_line(e: BaseException, last: bool = False) -> str:
  """The first (or, with `last`, the last) line of str(e), stripped; '' for an empty message (a
  bare `raise ValueError()`), so that a one-line error quoting another never fails itself."""
  lines = str(e).strip().splitlines()
  return lines[-1 if last else 0] if lines else ''
