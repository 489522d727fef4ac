"""The benchmarks' --set: 'dotted.key=value' overrides of a config, typed like the key."""

from __future__ import annotations

from trainer import config as config_lib


def apply(config, items) -> None:
  """Sets each 'dotted.key=value' of `items` on `config`, the value converted to the type of the
  key's current value ('true' or '1' for a bool), or kept a str for a key the config lacks."""
  for item in items:
    key, value = item.split('=', 1)
    node = config
    for part in key.split('.'):
      node = node[part] if hasattr(node, 'keys') and part in node else None
      if node is None:
        break
    config_lib.set_dotted(
      config,
      key,
      value.lower() in ('1', 'true')
      if isinstance(node, bool)
      else type(node)(value)
      if node is not None
      else value,
    )
