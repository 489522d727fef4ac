"""The README's "Write your own model" walk-through runs verbatim on a copy of the repository."""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def walkthrough():
  """[(file path or None, code)] for the code blocks of the section, in order."""
  text = open(os.path.join(ROOT, 'README.md')).read()
  section = text.split('## Write your own model', 1)[1].split('\n## ', 1)[0]
  section = section.split('### ', 1)[0]
  blocks, end = [], 0
  for match in re.finditer(r'```(?P<lang>\w*)\n(?P<code>.*?)```', section, re.S):
    # The file a block is written to is the first path named in the paragraph before it.
    named = re.search(r'`((?:models|configs)/\w+\.py)`', section[end:match.start()])
    blocks.append((named.group(1) if named else None, match['lang'], match['code']))
    end = match.end()
  return blocks


def test_walkthrough_has_files_and_commands():
  blocks = walkthrough()
  assert [b[0] for b in blocks if b[0]] == ['models/my_mlp.py', 'configs/my_mlp.py']
  assert sum(lang == 'bash' for _, lang, _ in blocks) == 3


@pytest.mark.slow
def test_walkthrough_runs_verbatim(tmp_path):
  repo = tmp_path / 'repo'
  repo.mkdir()
  for name in ('trainer', 'models', 'configs'):
    shutil.copytree(os.path.join(ROOT, name), repo / name,
                    ignore=shutil.ignore_patterns('__pycache__'))
  shutil.copy(os.path.join(ROOT, 'launch.py'), repo)
  os.symlink(os.path.realpath(os.path.join(ROOT, '..', 'shared')), tmp_path / 'shared')
  env = {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '2', 'PYTHONPATH': str(repo)}
  outputs = []
  for path, lang, code in walkthrough():
    if path:
      (repo / path).write_text(code)
      continue
    command = code.replace('\\\n', ' ').strip().replace('python ', f'{sys.executable} ', 1)
    result = subprocess.run(command, shell=True, cwd=repo, env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, f'{command}\n{result.stderr[-3000:]}'
    outputs.append(result.stdout)
  audit, train, _ = outputs
  assert 'No hazards' in audit and '| dense_2 | Dense | float32 | float32 | float32 |' in audit
  accuracy = float(re.search(r'accuracy: ([\d.]+)', train).group(1))
  assert accuracy > 0.97
  assert (repo / 'runs' / 'my_mlp' / 'curves.png').stat().st_size > 10_000
