"""Code blocks of README.md and the docs/ pages that tests run, found by their markers.

A marker is an HTML comment on a line of its own, outside code blocks, naming a test file and what
that test does with the code below it:

  <!-- tests/docs/test_readme_beyond.py runs this block as my_project/gan.py -->

The words after the file name identify the marker: `block(words)` is the fenced block on the
next line, `section(words)` the fenced blocks from the marker to the next heading. Markers are
looked up in README.md and every page under docs/, so a block can move between pages and its test
still runs it; `problems()` lists the markers that name no test file, or one that does not use
them (tests/docs/test_docblocks.py).
"""

from __future__ import annotations

import dataclasses
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r'<!-- (tests/[\w./-]+\.py) (.+?) -->')
FENCE = re.compile(r'(```+|~~~+)(\w*)')


@dataclasses.dataclass(frozen=True)
class Marker:
  page: str  # relative to the root, e.g. 'docs/guides/custom-steps.md'
  line: int  # 0-based index of the marker's line
  test: str  # 'tests/test_x.py'
  words: str  # what follows the test's name: 'runs this block as my_project/gan.py'


def pages(root: str = ROOT) -> list[str]:
  """README.md and every .md file under docs/, relative to `root`."""
  found = ['README.md'] if os.path.isfile(os.path.join(root, 'README.md')) else []
  for folder, dirs, files in os.walk(os.path.join(root, 'docs')):
    dirs.sort()
    found += [
      os.path.relpath(os.path.join(folder, f), root) for f in sorted(files) if f.endswith('.md')
    ]
  return found


def _lines(root: str, page: str) -> list[str]:
  with open(os.path.join(root, page), encoding='utf-8') as f:
    return f.read().split('\n')


def _outside_fences(lines: list[str]):
  """(index, line) of the lines outside fenced code blocks (a marker shown as an example inside
  a block is not a marker)."""
  fence = None
  for i, line in enumerate(lines):
    opening = FENCE.match(line.strip())
    if fence is None:
      if opening:
        fence = opening.group(1)
      else:
        yield i, line
    elif line.strip() == fence:
      fence = None


def markers(root: str = ROOT) -> list[Marker]:
  found = []
  for page in pages(root):
    for i, line in _outside_fences(_lines(root, page)):
      match = MARKER.fullmatch(line.strip())
      if match:
        found.append(Marker(page, i, match.group(1), match.group(2)))
  return found


def find(words: str, root: str = ROOT) -> Marker:
  """The one marker whose words are `words`."""
  hits = [m for m in markers(root) if m.words == words]
  if len(hits) != 1:
    where = ', '.join(f'{m.page}:{m.line + 1}' for m in hits) or 'no page'
    raise LookupError(
      f'{len(hits)} markers "... {words} -->" in README.md and docs/ '
      f'({where}); there must be exactly one'
    )
  return hits[0]


def _fenced(lines: list[str], start: int) -> tuple[str, str, int]:
  """(language, code, index after the closing fence) of the block opening at lines[start]."""
  opening = FENCE.match(lines[start].strip())
  fence, lang = opening.group(1), opening.group(2)
  for end in range(start + 1, len(lines)):
    if lines[end].strip() == fence:
      return lang, '\n'.join(lines[start + 1 : end]) + '\n', end + 1
  raise LookupError(f'the code block opening at line {start + 1} is never closed')


def block(words: str, root: str = ROOT) -> str:
  """The code of the fenced block on the line right after the marker."""
  marker = find(words, root)
  lines = _lines(root, marker.page)
  below = marker.line + 1
  if below >= len(lines) or not FENCE.match(lines[below].strip()):
    raise LookupError(
      f'{marker.page}:{marker.line + 1}: the marker "{words}" is not on the line '
      'right above a code block'
    )
  return _fenced(lines, below)[1]


def section(words: str, root: str = ROOT) -> list[tuple[str, str, str]]:
  """[(prose before the block, language, code)] for the fenced blocks after the marker, up to
  the next heading."""
  marker = find(words, root)
  lines = _lines(root, marker.page)
  blocks, prose, i = [], [], marker.line + 1
  while i < len(lines) and not lines[i].startswith('#'):
    if FENCE.match(lines[i].strip()):
      lang, code, i = _fenced(lines, i)
      blocks.append(('\n'.join(prose), lang, code))
      prose = []
    else:
      prose.append(lines[i])
      i += 1
  return blocks


def problems(root: str = ROOT) -> list[str]:
  """One line per marker that names a missing test file or one whose source does not contain
  the marker's words, per words used by two markers, and per 'runs this block' marker that is
  not right above a code block."""
  found, seen = [], {}
  for m in markers(root):
    where = f'{m.page}:{m.line + 1}'
    path = os.path.join(root, m.test)
    if not os.path.isfile(path):
      found.append(f'{where}: the marker names {m.test}, which does not exist')
    else:
      with open(path, encoding='utf-8') as f:
        if m.words not in f.read():
          found.append(
            f'{where}: {m.test} does not use the marker "{m.words}" (its words are '
            'not in the test file)'
          )
    if m.words in seen:
      found.append(f'{where}: the marker "{m.words}" is also at {seen[m.words]}')
    seen.setdefault(m.words, where)
    if m.words.startswith('runs this block'):
      lines = _lines(root, m.page)
      if m.line + 1 >= len(lines) or not FENCE.match(lines[m.line + 1].strip()):
        found.append(f'{where}: the marker "{m.words}" is not right above a code block')
  return found
