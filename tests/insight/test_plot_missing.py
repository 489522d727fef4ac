"""Without matplotlib (`pip install -e .` leaves it out), the plot command says in one line which
extra to install, instead of a ModuleNotFoundError traceback."""

import os
import subprocess
import sys

from conftest import ROOT

# matplotlib made unimportable in the child: `import matplotlib` raises ImportError, as it does
# when the package is not installed.
PLOT_WITHOUT_MATPLOTLIB = """
import runpy, sys
sys.modules['matplotlib'] = None
sys.argv = ['plot', '--workdir', sys.argv[1]]
runpy.run_module('trainer.insight.plot', run_name='__main__', alter_sys=True)
"""


def test_plot_without_matplotlib_names_the_extra(tmp_path):
  env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL='3')
  result = subprocess.run(
    [sys.executable, '-c', PLOT_WITHOUT_MATPLOTLIB, str(tmp_path)],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert result.returncode == 2, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr and 'ModuleNotFoundError' not in result.stderr
  # The last line (TensorFlow's C++ start-up lines may come before it, as for any command that
  # imports it) is the one error line.
  errors = [line for line in result.stderr.splitlines() if line.startswith('error:')]
  assert (
    errors
    == [result.stderr.strip().splitlines()[-1]]
    == [
      "error: plotting needs matplotlib, which the 'plots' extra installs: "
      "pip install -e '.[plots]' (in a checkout) or pip install matplotlib"
    ]
  )
  assert not (tmp_path / 'curves.png').exists()
