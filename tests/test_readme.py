"""The README's "From Python, without launch.py" example runs as written and learns."""
import os
import re
import subprocess
import sys

from conftest import ROOT


def test_readme_example_trains(tmp_path):
  readme = open(os.path.join(ROOT, 'README.md')).read()
  block = re.search(r'tests/test_readme.py -->\n```python\n(.*?)```', readme, re.S).group(1)
  (tmp_path / 'sine.py').write_text(block)
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL='3')
  result = subprocess.run([sys.executable, 'sine.py'], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  mse = float(re.search(r'eval mean squared error ([\d.]+)', result.stdout).group(1))
  assert mse < 0.02  # sin(x) has variance ~0.5 on [-3, 3]: the model really fit it
  assert (tmp_path / 'runs' / 'sine' / 'checkpoints').is_dir()
