"""Dotted names in nested configs: `train.batch_size` for `config['train']['batch_size']`.

`set_dotted` and `get` on a ConfigDict or a plain dict, `flatten` to {dotted name: leaf} and
`diff`, the dotted names whose values differ between two configs. trainer/config.py re-exports
them (`config_lib.flatten`, ...).
"""

from __future__ import annotations

from typing import Any

import ml_collections


def set_dotted(config, dotted: str, value) -> None:
  """`config['a']['b'] = value` for dotted 'a.b', on a ConfigDict or a plain dict; missing
  parents are created (as ConfigDicts). The value replaces the old one whatever its type."""
  *parents, leaf = dotted.split('.')
  node = config
  for part in parents:
    if part not in node:
      node[part] = ml_collections.ConfigDict()
    node = node[part]
  try:
    node[leaf] = value
  except TypeError:  # a ConfigDict field typed by its old value; trainer.config.validate checks
    del node[leaf]  # the new one against the schema (precision.float8: a bool or a recipe name)
    node[leaf] = value


def get(config, dotted: str):
  """`config['a']['b']` for dotted 'a.b'; KeyError(dotted) when a part is missing."""
  node = config
  for part in dotted.split('.'):
    if not hasattr(node, 'keys') or part not in node:
      raise KeyError(dotted)
    node = node[part]
  return node


def flatten(config, prefix='') -> dict[str, Any]:
  """{'train.batch_size': 128, ...} for every leaf of a (nested) ConfigDict or dict."""
  flat = {}
  for key, value in config.items():
    name = f'{prefix}{key}'
    if hasattr(value, 'items'):
      flat.update(flatten(value, name + '.'))
    else:
      flat[name] = value
  return flat


def diff(old: dict, new: dict) -> list[str]:
  """Flattened keys whose values differ between two configs (as dicts)."""
  a, b = flatten(old), flatten(new)
  return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
