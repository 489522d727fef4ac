"""benchmarks/references.py --quick runs every reference under every policy end to end.

The quick figures are 20 steps' worth, so the checks are what 20 steps must already give: both
nanoGPT evaluations below the uniform guess's ln(65) and close to each other (two estimates of
the same expected loss), the convnet far above chance (0.1), no skipped steps.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import ROOT


# The two cases together run every reference under every policy, each policy once. The mixed
# policies are slow where bfloat16 and float16 are emulated (a CPU without AVX512_BF16 or
# AVX512_FP16), so they are the slow case; float32, the quick one, is not run twice.
@pytest.mark.parametrize(
  'policies',
  [pytest.param(('mixed_bfloat16', 'mixed_float16'), marks=pytest.mark.slow), ('float32',)],
)
def test_quick_references(tmp_path, policies):
  done = subprocess.run(
    [
      sys.executable,
      '-m',
      'benchmarks.references',
      '--quick',
      f'--policies={",".join(policies)}',
      f'--out={tmp_path}',
      f'--results_dir={tmp_path / "pages"}',
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=600,
    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'),
  )
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads((tmp_path / 'references.json').read_text())
  cells = {(r['reference'], r['policy']) for r in results}
  assert cells == {
    (name, policy) for name in ('nanogpt_cpu', 'keras_mnist_convnet') for policy in policies
  }
  for r in results:
    assert r['steps'] == 20 and r['skipped'] == 0, r
    assert r['wall_s'] > 0 and r['cpu_s'] > 0
    if r['reference'] == 'nanogpt_cpu':
      full, estimate = r['metrics']['loss'], r['nanogpt_estimate']
      assert 2.0 < full < math.log(65) and 2.0 < estimate < math.log(65), r
      assert abs(full - estimate) < 0.2, r
    else:
      assert r['metrics']['accuracy'] > 0.5, r
  text = (tmp_path / 'references.md').read_text()
  rows = len(policies)
  assert text.count('\n| nanogpt_cpu |') == rows and text.count('\n| keras_mnist_convnet |') == rows
  # The same table as the results page, under its header (benchmarks/results.py).
  page = (tmp_path / 'pages' / 'references.md').read_text()
  assert '| command | `python -m benchmarks.references --quick' in page and text.strip() in page


def test_quick_keras_example_side(tmp_path):
  """--side=keras_fit runs the convnet example as published (model.fit): 20 steps here, in
  float32 (mixed_bfloat16 is emulated and slow on a CPU without AVX512_BF16)."""
  done = subprocess.run(
    [
      sys.executable,
      '-m',
      'benchmarks.references',
      '--quick',
      '--only=keras_mnist_convnet',
      '--policies=float32',
      '--side=keras_fit',
      f'--out={tmp_path}',
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=600,
    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'),
  )
  assert done.returncode == 0, done.stderr[-3000:]
  [r] = json.loads((tmp_path / 'references.json').read_text())
  assert (r['side'], r['policy'], r['steps'], r['epochs']) == (
    'keras_fit',
    'float32',
    20,
    1,
  ), r
  assert r['metrics']['accuracy'] > 0.5, r
  assert (
    '| keras_mnist_convnet | accuracy 0.9922 | float32 | keras_fit |'
    in (tmp_path / 'references.md').read_text()
  )
