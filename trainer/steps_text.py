"""Config values that are text naming global steps, parsed (no TensorFlow)."""

from __future__ import annotations

from trainer.errors import ConfigError


def profile_steps(text: str) -> tuple[int, int] | None:
  """'' -> None; '10,20' -> (10, 20); anything else raises ConfigError naming
  config.train.profile_steps (trainer/run/profiling.py traces those steps)."""
  if not text.strip():
    return None
  parts = [p.strip() for p in text.split(',')]
  if len(parts) != 2 or not all(p.isdigit() for p in parts) or int(parts[0]) >= int(parts[1]):
    raise ConfigError(
      f'config.train.profile_steps={text!r}: give two global steps '
      "'start,end' with start < end, e.g. '100,120', or '' for no trace."
    )
  return int(parts[0]), int(parts[1])


def steps(text: str) -> tuple[int, ...]:
  """'3, 10,12' -> (3, 10, 12); ConfigError naming config.debug.inject_nonfinite_steps."""
  steps = []
  for part in filter(None, (p.strip() for p in text.split(','))):
    if not part.isdigit():
      raise ConfigError(
        f'config.debug.inject_nonfinite_steps={text!r}: {part!r} is not a '
        'step number; give comma-separated non-negative integers.'
      )
    steps.append(int(part))
  return tuple(sorted(set(steps)))
