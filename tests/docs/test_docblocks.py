"""Every `<!-- tests/... -->` marker in README.md and docs/ names a test that runs its block; the
README's links into docs/ reach their pages."""

import os
import re

import docblocks


def test_every_marker_names_a_test_file_that_uses_it():
  markers = docblocks.markers()
  # The blocks the tests ran from the README before the docs site existed, wherever they are now.
  assert {m.test for m in markers} >= {
    'tests/docs/test_readme.py',
    'tests/docs/test_readme_beyond.py',
    'tests/docs/test_readme_walkthrough.py',
  }
  assert len(markers) >= 6
  assert any(m.page.startswith('docs/') for m in markers)
  assert docblocks.problems() == []


def test_markers_are_found_on_any_page_and_not_inside_code_blocks(tmp_path):
  (tmp_path / 'tests').mkdir()
  (tmp_path / 'tests' / 'test_a.py').write_text("block('runs this block as a.py')\n")
  (tmp_path / 'README.md').write_text(
    '# Title\n\n```\n<!-- tests/test_a.py runs this block as a.py -->\n```\n'
  )
  (tmp_path / 'docs' / 'guides').mkdir(parents=True)
  (tmp_path / 'docs' / 'guides' / 'a.md').write_text(
    '# A\n\n<!-- tests/test_a.py runs this block as a.py -->\n```python\nx = 1\n```\n\n'
    '<!-- tests/test_a.py runs the blocks below -->\n\nfirst `a.py`:\n\n```python\ny = 2\n```\n'
    '```bash\necho\n```\n## Next\n```python\nz = 3\n```\n'
  )
  root = str(tmp_path)
  assert docblocks.pages(root) == ['README.md', 'docs/guides/a.md']
  # The README's marker is an example inside a code block: not a marker.
  assert [(m.page, m.line) for m in docblocks.markers(root)] == [
    ('docs/guides/a.md', 2),
    ('docs/guides/a.md', 7),
  ]
  assert docblocks.block('runs this block as a.py', root) == 'x = 1\n'
  assert docblocks.section('runs the blocks below', root) == [
    ('\nfirst `a.py`:\n', 'python', 'y = 2\n'),
    ('', 'bash', 'echo\n'),
  ]


def test_problems_names_each_bad_marker(tmp_path):
  (tmp_path / 'tests').mkdir()
  (tmp_path / 'tests' / 'test_a.py').write_text("block('runs this block as a.py')\n")
  (tmp_path / 'README.md').write_text(
    '<!-- tests/test_a.py runs this block as a.py -->\n```python\nx = 1\n```\n'
    '<!-- tests/test_gone.py runs this block as b.py -->\n```python\n```\n'
    '<!-- tests/test_a.py runs this block as c.py -->\n```python\n```\n'
    '<!-- tests/test_a.py runs this block as a.py -->\n\n```python\n```\n'
  )
  found = docblocks.problems(str(tmp_path))
  assert found == [
    'README.md:5: the marker names tests/test_gone.py, which does not exist',
    'README.md:8: tests/test_a.py does not use the marker "runs this block as c.py" (its words '
    'are not in the test file)',
    'README.md:11: the marker "runs this block as a.py" is also at README.md:1',
    'README.md:11: the marker "runs this block as a.py" is not right above a code block',
  ]
  try:
    docblocks.block('runs this block as a.py', str(tmp_path))
  except LookupError as e:
    assert '2 markers' in str(e) and 'README.md:1, README.md:11' in str(e)
  else:
    raise AssertionError('a marker used twice was not refused')


def slug(heading: str) -> str:
  """GitHub's and MkDocs' anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
  text = re.sub(r'[`*]', '', heading.strip().lower())
  return re.sub(r'[^\w\- ]', '', text).replace(' ', '-')


def test_readme_links_reach_existing_pages_and_headings():
  """The README is not part of the MkDocs site (whose --strict build checks the pages' links):
  its relative links and anchors are checked here."""
  readme = open(os.path.join(docblocks.ROOT, 'README.md')).read()
  links = re.findall(r'\]\(([^)\s]+)\)', readme)
  local = [link for link in links if not re.match(r'\w+://', link)]
  assert len(local) >= 10
  broken = []
  for link in local:
    path, _, anchor = link.partition('#')
    page = os.path.join(docblocks.ROOT, path) if path else os.path.join(docblocks.ROOT, 'README.md')
    if not os.path.isfile(page):
      broken.append(f'{link}: no file {path}')
      continue
    if anchor:
      headings = re.findall(r'^#+ (.+)$', open(page).read(), re.M)
      if anchor not in {slug(h) for h in headings}:
        broken.append(f'{link}: no heading #{anchor} in {path or "README.md"}')
  assert broken == []
