"""The config reference (docs/reference/config.md) lists every key of the schema, with the
schema's default where a row names one key."""

import ast
import os

from conftest import ROOT
from trainer import config as config_lib


def schema_keys(node, prefix=''):
  """{dotted key: default} of a ConfigDict."""
  out = {}
  for name, value in node.items():
    if hasattr(value, 'items'):
      out.update(schema_keys(value, f'{prefix}{name}.'))
    else:
      out[f'{prefix}{name}'] = value
  return out


def table_rows():
  """[(keys, default cell)] of the reference's key table; a row 'a.x / y / z' names a.x, a.y,
  a.z."""
  text = open(os.path.join(ROOT, 'docs', 'reference', 'config.md')).read()
  rows = []
  for line in text.splitlines():
    cells = [c.strip() for c in line.strip().strip('|').split('|')]
    if not line.startswith('| ') or cells[0] in ('key', '---') or len(cells) < 3:
      continue
    first, *rest = [k.strip() for k in cells[0].split('/')]
    section = first.rpartition('.')[0]
    keys = [first] + [f'{section}.{k}' if section else k for k in rest]
    rows.append((keys, cells[1]))
  return rows


def test_every_schema_key_is_in_the_reference_with_its_default():
  schema = schema_keys(config_lib.defaults())
  rows = table_rows()
  listed = [k for keys, _ in rows for k in keys]
  assert sorted(set(schema) - set(listed)) == []  # every key documented
  assert sorted(set(listed) - set(schema)) == []  # and nothing that is not a key
  checked = 0
  for keys, default in rows:
    values = [v.strip() for v in default.split(' / ')] if len(keys) > 1 else [default]
    assert len(values) == len(keys), (keys, default)
    for key, value in zip(keys, values):
      assert ast.literal_eval(value) == schema[key], (key, value, schema[key])
      checked += 1
  assert checked == len(schema)
