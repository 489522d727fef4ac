"""Importing the library changes nothing in the user's process (issue 56): a `fit` user who takes
only the loss scaler gets no environment variable set, no file written (not even under $HOME)
and TensorFlow's thread pools as they were; launch.py opts in with trainer.launcher_defaults()."""

import json
import os
import subprocess
import sys

from conftest import ROOT

PROBE = """
import json, os, sys
before = dict(os.environ)
from trainer import mixed_precision
import tensorflow as tf
optimizer = mixed_precision.LossScaleOptimizer(tf.keras.optimizers.SGD(0.1))
changed = sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))
threads = [tf.config.threading.get_inter_op_parallelism_threads(),
           tf.config.threading.get_intra_op_parallelism_threads()]
print(json.dumps({'changed': changed, 'threads': threads}))
"""


def run(code: str, home) -> dict:
  env = {k: v for k, v in os.environ.items() if k not in ('TF_XLA_FLAGS', 'TF_ENABLE_ONEDNN_OPTS')}
  env.update(HOME=str(home), XDG_CACHE_HOME='', PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL='3')
  out = subprocess.run(
    [sys.executable, '-c', code],
    cwd=home,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def files(home) -> list[str]:
  return sorted(str(p.relative_to(home)) for p in home.rglob('*'))


def test_importing_the_scaler_sets_no_variable_and_writes_no_file(tmp_path):
  home, keras_home = tmp_path / 'home', tmp_path / 'keras_home'
  home.mkdir()
  keras_home.mkdir()
  got = run(PROBE, home)
  assert got['changed'] == [], got
  assert got['threads'] == [0, 0]  # TensorFlow's own choice: nothing configured
  # What Keras itself writes on import (~/.keras/keras.json) and nothing more: no
  # ~/.cache/mpt-trainer.
  run('import json, tensorflow, keras; print(json.dumps({}))', keras_home)
  assert files(home) == files(keras_home)
  assert not any('mpt-trainer' in f for f in files(home))


def test_launcher_defaults_opt_in_to_onednn_and_the_xla_cache(tmp_path):
  """The opt-in does what launch.py relies on: both variables, and the cache folder under HOME."""
  home = tmp_path / 'home'
  home.mkdir()
  got = run(
    PROBE.replace('before = dict', 'import trainer; trainer.launcher_defaults()\nbefore = dict'),
    home,
  )
  assert got['changed'] == []  # set before `before`, so nothing more changed after
  code = (
    'import json, os, trainer; trainer.launcher_defaults(); '
    "print(json.dumps({k: os.environ.get(k) for k in ('TF_ENABLE_ONEDNN_OPTS', 'TF_XLA_FLAGS')}))"
  )
  flags = run(code, home)
  assert flags['TF_ENABLE_ONEDNN_OPTS'] == '1'
  assert (
    f'--tf_xla_persistent_cache_directory={home}/.cache/mpt-trainer/xla/' in flags['TF_XLA_FLAGS']
  )
  assert (home / '.cache' / 'mpt-trainer' / 'xla').is_dir()
