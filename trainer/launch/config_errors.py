"""launch.py's config mistakes in one line naming the flag, the key or the file's line.

absl and ml_collections report a bad config file or override with their own words (a KeyError
with a suggestion list, a TypeError about casting, "Error whilst parsing config file"); these
functions turn each into the one line the launcher prints. The did-you-mean is the schema's
(`trainer.config.did_you_mean`). TensorFlow-free: they run before TensorFlow is imported.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import traceback

from trainer import config as config_lib

# ml_collections' TypeError when a config file assigns a value of another type to a field.
_CAST = re.compile(r"of original type <class '(\w+)'> and cannot be casted to type <class '(\w+)'>")
# Python's and absl's words for an override of the wrong type, and what they mean to a user.
_WRONG_TYPE = (
  (r"\('Non-boolean argument to boolean flag', '([^']*)'\)", 'is not a boolean (True or False)'),
  (r"invalid literal for int\(\) with base 10: '([^']*)'", 'is not an integer'),
  (r"could not convert string to float: '([^']*)'", 'is not a number'),
)
_RETURN = 'get_config() returned None; end it with `return config` (see configs/mnist.py)'


def config_path(argv: list[str]) -> str | None:
  """--config's value, read from the command line before absl parses it (the one scanner)."""
  for i, arg in enumerate(argv[1:], 1):
    if arg.startswith('--config='):
      return arg.split('=', 1)[1]
    if arg == '--config' and i + 1 < len(argv):
      return argv[i + 1]
  return None


def returned_none(path: str) -> str:
  return f'--config={path}: {_RETURN}'


def not_a_config_dict(path: str, kind: str) -> str:
  return (
    f'--config={path}: get_config() returned a {kind}, not an ml_collections.ConfigDict; '
    'wrap it: return ml_collections.ConfigDict({...})'
  )


def _load(path: str):
  """(what get_config() returns, None) or (None, the exception), from one load of the file."""
  try:
    return config_lib.load_file(path.split(':', 1)[0]), None
  except Exception as e:  # the file's own error, reported by the caller
    return None, e


def file_error(path: str) -> str | None:
  """The error the config file's get_config() raises, in one line naming its line; a value of
  another type than the field holds (ml_collections' TypeError) names the key and the types.
  None when the file loads."""
  file = path.split(':', 1)[0]
  _, e = _load(path)
  if e is None:
    return None
  frames = [
    f
    for f in traceback.extract_tb(e.__traceback__)
    if os.path.abspath(f.filename) == os.path.abspath(file)
  ]
  line = (frames[-1].line or '').strip() if frames else ''
  where = f'{file}, line {frames[-1].lineno}' if frames else file
  cast = _CAST.search(str(e))
  assignment = re.fullmatch(r'([\w.]+)\s*=\s*(.+?)\s*(#.*)?', line)
  if not (cast and assignment):
    return f'--config={path}: {type(e).__name__}: {e} ({where}: {line})'
  key, value = assignment.group(1), assignment.group(2)
  got, want = cast.groups()
  a_want, a_got = (('an ' if t[0] in 'aeiou' else 'a ') + t for t in (want, got))
  return f'{key} = {value} ({where}): {key} holds {a_want}, not {a_got}{_unquote(value, want)}'


def _unquote(value: str, want: str) -> str:
  """'; write 3e-4 without quotes' when `value` is a quoted number the field's type reads."""
  with contextlib.suppress(ValueError, SyntaxError):
    text = ast.literal_eval(value)
    if isinstance(text, str) and want in ('int', 'float'):
      {'int': int, 'float': float}[want](text)
      return f'; write {text} without quotes'
  return ''


def flag_error(text: str) -> str:
  """absl's message, first line; for an exception inside get_config(), its last line too."""
  lines = [l.strip() for l in text.splitlines() if l.strip()]
  first = re.sub(r'^flags [^:]*: ', '', lines[0].removeprefix('flag '))
  if 'Error whilst parsing config file' in text and len(lines) > 1:
    return f'{first} {lines[-1]}'
  for pattern, meaning in _WRONG_TYPE:
    first = re.sub(pattern, lambda m: f'{m.group(1)!r} {meaning}', first)
  return first


def override_error(argv: list[str], path: str | None, e: Exception) -> str:
  """The line for an exception ml_collections raised while applying --config.* overrides (or
  loading the file): the override naming no key, with the schema's did-you-mean."""
  if isinstance(e, AttributeError) and 'get_config' in str(e):
    return (
      f'--config={path}: the file defines no get_config(); a config file returns its '
      'ml_collections.ConfigDict from get_config() (see configs/mnist.py)'
    )
  overrides = [a for a in argv[1:] if a.startswith('--config.')]
  base, failed = _load(path) if path and overrides else (None, e)  # once, to name the culprit
  if path and failed is None and base is None:  # an override found no config to set
    return returned_none(path)
  if path and failed is None and type(base).__name__ != 'ConfigDict':  # a dict, a list, ...
    return not_a_config_dict(path, type(base).__name__)
  if isinstance(e, (KeyError, AttributeError)) and overrides:
    known = list(config_lib.flatten(base)) if base is not None else []
    names = [a.split('=', 1)[0].removeprefix('--config.') for a in overrides]
    # The first override naming no key of the config file; without the file's keys, the one
    # holding the name in the error ("'batch_sise'\nDid you mean ...").
    missing = (str(e).splitlines() or [''])[0].strip('"\'\\ ')
    culprit = next((o for o, n in zip(overrides, names) if known and n not in known), None) or next(
      (o for o, n in zip(overrides, names) if missing in n.split('.')), overrides[0]
    )
    key = culprit.split('=', 1)[0].removeprefix('--config.')
    guess = config_lib.did_you_mean(key, known)
    hint = (
      f'; did you mean {guess}?'
      if guess
      else f'; see the keys in {path} (all of them: docs/reference/config.md)'
    )
    return f'{culprit}: the config has no key {key}{hint}'
  culprit = overrides[0] if len(overrides) == 1 else f'--config={path}'
  return f'{culprit}: {type(e).__name__}: {e}'
