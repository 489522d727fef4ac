"""Measurements live in pages the benchmarks write (docs/results/, benchmarks/results.py); the
guides state the method and link there. A guide line with a dated measurement (a date, a load
average, "the quiet machine") is refused, every results page carries its header and is linked
from the results index (docs/results.md), and the test files development.md names exist."""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile

from conftest import ROOT

from benchmarks import results

# A line that dates a measurement or names the load it ran under: it belongs on a results page.
DATED = re.compile(
  r'\b20\d\d-\d\d-\d\d\b'  # a date
  r'|load average\b[^.|]{0,30}?\d|\bload \d'  # the load, as a number
  r'|\b(quiet|loaded|shared|busy)( 2-core)? machine'  # the machine's state
  r'|machine was (shared|busy|quiet)'
  r'|\b(quiet|loaded) 2-core\b',
  re.IGNORECASE,
)


def guide_pages() -> list[str]:
  """README.md and every page of the docs except the generated results pages."""
  pages = ['README.md']
  for folder, _, files in os.walk(os.path.join(ROOT, 'docs')):
    rel = os.path.relpath(folder, ROOT)
    if rel == os.path.join('docs', 'results') or rel.startswith(
      os.path.join('docs', 'results', '')
    ):
      continue
    pages += [os.path.join(rel, f) for f in sorted(files) if f.endswith('.md')]
  return sorted(pages)


def dated_lines(text: str) -> list[str]:
  return [line for line in text.splitlines() if DATED.search(line)]


def test_the_pattern_finds_the_dated_lines_the_guides_had_and_spares_method():
  # Lines the guides carried before the measurements moved to docs/results/.
  dated = [
    '--rounds=6` (22 min) on the quiet machine, 2026-11-24, at commit `d9a5204`; the full report',
    'Machine: AMD EPYC, 2 cores (avx2); load average at start 0.73, 0.94, 1.05.',
    '| setting | kept | s/step (load 12-14) |',
    '[32, 4, 512, 512] are 128 MiB per block in float32). MiB; the machine was shared (RSS is not',
    'the shared 2-core machine measured it at 0.95 training steps for the CNN',
    'median of 7 rounds; a loaded 2-core machine):',
    'minutes on a quiet 2-core machine, install, lint, mypy and the docs build included (550 tests',
  ]
  assert [line for line in dated if not DATED.search(line)] == []
  method = [
    'steps per CPU-second of the process (user + system), which other processes barely',
    'The loss scale stayed at 32768 for 2000 finite steps.',
    'python benchmarks/memory.py --set=model_config.context=512 --batch_size=32',
    'the machine and the load (the 1-minute load average at the start and the end)',
  ]
  assert [line for line in method if DATED.search(line)] == []


def test_no_guide_line_carries_a_dated_measurement():
  found = []
  for page in guide_pages():
    with open(os.path.join(ROOT, page)) as f:
      found += [f'{page}: {line.strip()[:90]}' for line in dated_lines(f.read())]
  assert found == [], (
    'dated measurements belong on a results page (docs/results/, written by the benchmark '
    'through benchmarks/results.py); the guide states the method and links there:\n'
    + '\n'.join(found)
  )


def results_pages() -> list[str]:
  folder = os.path.join(ROOT, 'docs', 'results')
  return sorted(f for f in os.listdir(folder) if f.endswith('.md') and f != 'index.md')


def test_every_results_page_has_its_header_and_is_in_the_results_index():
  pages = results_pages()
  assert len(pages) >= 8  # run, memory, references, peer_nanogpt, ... (one per benchmark)
  with open(os.path.join(ROOT, 'docs', 'results.md')) as f:
    indexed = set(re.findall(r'\]\((results/[\w-]+\.md)\)', f.read()))
  for page in pages:
    with open(os.path.join(ROOT, 'docs', 'results', page)) as f:
      text = f.read()
    assert text.startswith('# Results: ') and results.MARK in text, page
    # A page of sections (one per peer: peer_nanogpt.md, ...): each section has its own header.
    for part in text.split(results.SECTION)[1:] or [text]:
      for row in ('| command |', '| commit |', '| recorded |', '| machine |', '| load |'):
        assert row in part, (page, part[:40], row)
    assert f'results/{page}' in indexed, f'docs/results/{page} is not linked from docs/results.md'


def test_every_test_file_development_md_names_exists():
  with open(os.path.join(ROOT, 'docs', 'development.md')) as f:
    text = f.read()
  named = set(re.findall(r'\b(test_\w+\.py|\w+_runs?\.py|docblocks\.py|conftest\.py)\b', text))
  assert len(named) >= 30  # the table "what is tested where"
  present = {f for _, _, files in os.walk(os.path.join(ROOT, 'tests')) for f in files}
  assert sorted(named - present) == []
  # No test count to go stale: the page says how to count instead.
  assert 'pytest --collect-only -q' in text
  assert not re.search(r'\b\d{3} tests\b', text)


# A path of one machine: a checkout under /work, a scratch folder under /tmp, root's home.
MACHINE_PATH = re.compile(r'(?<![\w.~$])/(work|tmp|root)/')


def test_no_page_names_a_machine_path():
  """A page says how to repeat a measurement from the repository root (`--data_root=../shared/
  data`), not where one machine kept its files."""
  found = []
  for folder, _, files in os.walk(os.path.join(ROOT, 'docs')):
    for name in sorted(f for f in files if f.endswith('.md')):
      with open(os.path.join(folder, name)) as f:
        found += [f'{name}: {line[:100]}' for line in f if MACHINE_PATH.search(line)]
  assert found == [], '\n'.join(found)


# ---- the writer ---------------------------------------------------------------------------------
def test_the_writer_fills_the_header_from_git_and_the_machine(tmp_path):
  started = results.start()
  path = results.write(
    'demo',
    '# Ignored title\n\n| a | b |\n|---|---|\n| 1 | 2 |\n',
    started=started,
    command_line='python -m benchmarks.demo --rounds=1',
    results_dir=str(tmp_path),
  )
  assert path == str(tmp_path / 'demo.md')
  text = (tmp_path / 'demo.md').read_text()
  head = subprocess.run(
    ['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True, text=True
  ).stdout.strip()
  assert text.startswith('# Results: demo\n') and 'Ignored title' not in text
  assert '| command | `python -m benchmarks.demo --rounds=1` |' in text
  assert f'| commit | `{head}`' in text
  assert f'{os.cpu_count()} cores' in text and 'TensorFlow 2.' in text and 'Keras 3.' in text
  assert re.search(r'\| load \| 1-minute load average [\d.]+ at the start, [\d.]+ at the end', text)
  assert "| kernels | TensorFlow's oneDNN kernels on |" in text  # this process runs TensorFlow
  assert '| 1 | 2 |' in text
  assert os.listdir(tmp_path) == ['demo.md']  # written by a rename, nothing left behind


def test_the_writer_writes_no_machine_path(tmp_path, monkeypatch):
  """The command as run from the repository root, without the folders its outputs went to; the
  page's own paths relative to the root, a scratch folder as $TMPDIR."""
  from trainer import onednn

  scratch = tempfile.gettempdir()
  argv = [
    os.path.join(ROOT, 'benchmarks', 'demo.py'),
    f'--data_root={os.path.dirname(ROOT)}/shared/data',
    f'--nanogpt={scratch}/nanogpt',
    f'--out={tmp_path}/out',
    f'--results_dir={tmp_path}',
  ]
  monkeypatch.setattr(sys, 'argv', argv)
  monkeypatch.delenv(onednn.ENV, raising=False)
  body = f'trace in {scratch}/trace; config {ROOT}/configs/mnist.py'
  results.write('demo', body, started=results.start(), results_dir=str(tmp_path))
  text = (tmp_path / 'demo.md').read_text()
  assert '`python -m benchmarks.demo --data_root=../shared/data --nanogpt=$TMPDIR/nanogpt`' in text
  assert 'trace in $TMPDIR/trace; config configs/mnist.py' in text
  assert not MACHINE_PATH.search(text) and ROOT not in text


def test_the_command_names_the_onednn_switch_the_user_set(monkeypatch):
  from trainer import onednn

  monkeypatch.setattr(sys, 'argv', [os.path.join(ROOT, 'benchmarks', 'demo.py'), '--x=1'])
  monkeypatch.setenv(onednn.ENV, '0')  # the user's 0
  assert results.command() == 'TF_ENABLE_ONEDNN_OPTS=0 python -m benchmarks.demo --x=1'
  # trainer's default, or inherited from a parent that imported trainer: not part of the command
  monkeypatch.setenv(onednn.ENV, '1')
  assert results.command() == 'python -m benchmarks.demo --x=1'
  monkeypatch.delenv(onednn.ENV)
  assert results.command() == 'python -m benchmarks.demo --x=1'


def test_the_load_line_says_whether_the_machine_was_shared():
  cores = os.cpu_count()
  a = results.Start(wall=0.0, load=0.5, busy=100.0, own=10.0)
  alone = results.Start(wall=100.0, load=0.7, busy=100.0 + 80 * cores, own=10.0 + 80 * cores)
  shared = results.Start(wall=100.0, load=9.0, busy=100.0 + 90 * cores, own=10.0 + 40 * cores)
  assert results.load_line(a, alone).endswith('(0% of the machine): it ran alone')
  line = results.load_line(a, shared)
  assert 'at the start' in line and line.endswith('(50% of the machine): it was shared')
  assert 'not recorded' in results.load_line(None, shared)


def test_a_quick_run_writes_no_page_unless_asked(tmp_path):
  assert results.target_dir(quick=True) == ''  # flags unparsed: no --results_dir given
  assert results.write('demo', 'x', quick=True) is None
  assert results.target_dir(quick=False) == results.DEFAULT_DIR


def test_the_report_prints_and_writes_the_page_and_the_out_files(tmp_path, monkeypatch):
  """results.report, which references.py and peer_nanogpt.py end with (nanoGPT's needs a PyTorch
  environment and nanoGPT's tree, so its own runs are not tests)."""
  monkeypatch.setattr(results, 'DEFAULT_DIR', str(tmp_path / 'pages'))
  table = '| shape | ours |\n|---|---|\n| nanogpt_cpu | 1.78 |'
  with contextlib.redirect_stdout(io.StringIO()) as printed:
    results.report(
      str(tmp_path / 'out'), 'peer', table, [{'a': 1}], page='peer_nanogpt', started=results.start()
    )
  assert printed.getvalue() == table + '\n'
  assert (tmp_path / 'out' / 'peer.md').read_text() == table + '\n'
  assert json.loads((tmp_path / 'out' / 'peer.json').read_text()) == [{'a': 1}]
  page = (tmp_path / 'pages' / 'peer_nanogpt.md').read_text()
  assert page.startswith('# Results: peer_nanogpt\n') and table in page and '| load |' in page


def test_a_section_is_rewritten_in_place_and_the_others_kept(tmp_path):
  """A page of sections (peer_nanogpt.md: one per race): writing a section replaces that section
  alone, or adds it at the end; each keeps its own header."""
  write = lambda section, body: results.write(  # noqa: E731
    'peers',
    body,
    section=section,
    command_line=f'python -m x --{section}',
    results_dir=str(tmp_path),
  )
  write('alone', '| a | 1 |')
  write('loaded', '| b | 2 |')
  write('alone', '| a | 3 |')
  text = (tmp_path / 'peers.md').read_text()
  assert text.startswith('# Results: peers\n') and text.count(results.MARK) == 1
  assert '| a | 1 |' not in text and text.index('| a | 3 |') < text.index('| b | 2 |')
  sections = text.split(results.SECTION)[1:]
  assert [s.split(' -->')[0] for s in sections] == ['alone', 'loaded']
  for name, section in zip(('alone', 'loaded'), sections):
    assert f'\n## {name}\n' in section and f'`python -m x --{name}`' in section
    for row in ('| command |', '| commit |', '| recorded |', '| machine |', '| load |'):
      assert section.count(row) == 1, (name, row)


def test_the_commit_line_counts_changed_files_but_not_results_pages(tmp_path):
  run = lambda *a: subprocess.run(['git', *a], cwd=tmp_path, check=True, capture_output=True)
  run('init', '-q')
  (tmp_path / 'docs' / 'results').mkdir(parents=True)
  (tmp_path / 'docs' / 'results' / 'x.md').write_text('a\n')
  (tmp_path / 'code.py').write_text('a\n')
  run('add', '.')
  run('-c', 'user.name=t', '-c', 'user.email=t@t', 'commit', '-qm', 'init')
  assert not results.commit(str(tmp_path)).endswith('committed')
  # An unstaged change to a results page alone: its porcelain line starts with a space.
  (tmp_path / 'docs' / 'results' / 'x.md').write_text('b\n')
  assert 'not committed' not in results.commit(str(tmp_path))
  (tmp_path / 'code.py').write_text('b\n')
  assert results.commit(str(tmp_path)).endswith('with 1 changed file(s) not committed')
