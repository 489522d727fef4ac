"""trainer/onednn.py: `trainer.launcher_defaults()` (launch.py's first call) turns TensorFlow's
oneDNN kernels on unless the user said otherwise, and the test process itself runs them
(tests/conftest.py calls it first); `import trainer` alone leaves the switch alone."""

import os
import subprocess
import sys

import pytest

from trainer import onednn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROBE = """
import os, sys
{first}
import tensorflow
from trainer import onednn
print(os.environ.get('TF_ENABLE_ONEDNN_OPTS'), onednn.enabled())
print(onednn.hint())
"""


def probe(first: str, env_value: str | None) -> str:
  env = {k: v for k, v in os.environ.items() if k != onednn.ENV}
  if env_value is not None:
    env[onednn.ENV] = env_value
  env['TF_CPP_MIN_LOG_LEVEL'] = '3'
  out = subprocess.run(
    [sys.executable, '-c', PROBE.format(first=first)],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  state, hint = out.stdout.split('\n')[-3:-1]
  # The log's hint: only when the kernels are off and the user did not set the variable.
  assert (hint != 'None') == (not state.endswith('True') and state.startswith('None ')), out.stdout
  return state


@pytest.mark.parametrize(
  'first, env_value, expected',
  [
    ('import trainer; trainer.launcher_defaults()', None, '1 True'),  # unset: turned on
    ('import trainer; trainer.launcher_defaults()', '0', '0 False'),  # the user's 0 holds
    ('import tensorflow, trainer; trainer.launcher_defaults()', None, None),  # too late
    ('import trainer', None, None),  # the import alone: TensorFlow's own default
  ],
)
def test_launcher_defaults_turn_onednn_on_unless_told_or_too_late(first, env_value, expected):
  got = probe(first, env_value)
  if expected is None:
    # TensorFlow loaded first: trainer leaves the variable unset, and what runs is TensorFlow's
    # default for this CPU, which `enabled` reports.
    assert got.startswith('None ')
  else:
    assert got == expected


def test_this_test_process_runs_what_users_run():
  assert onednn.enabled()
