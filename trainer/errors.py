"""Errors a user can fix: the launcher prints them as one line, never a traceback."""


class UserError(ValueError):
  """Base class: something in the user's config, data or command is wrong.

  The message names the culprit (a config key, a file, a step) and says what to do.
  """


class ConfigError(UserError):
  """A config key has a bad value or does not exist."""


class DataError(UserError):
  """A dataset file is missing, truncated or malformed."""


class CollapseError(UserError):
  """Training stopped: too many steps in a row had non-finite gradients (see skip_guard.py)."""


class NonFiniteError(UserError):
  """The training state or the final eval is not finite: nothing non-finite is saved."""


class DivergenceError(UserError):
  """Training stopped: the loss diverged and config.numerics.divergence_stop is set."""
