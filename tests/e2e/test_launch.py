"""launch.py: a bad command is one line naming the culprit, exit 2, and nothing written; a run
whose numbers failed (diverged, collapsed, not finite) is one line and exit 3."""

import json
import os
import re
import subprocess
import sys

import pytest

import tiny
from conftest import ROOT


def launch(*args, cwd=ROOT):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  return subprocess.run(
    [sys.executable, os.path.join(ROOT, 'launch.py'), *args],
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )


def error_lines(result):
  """Lines on stderr that are ours (TF prints its own start-up noise before absl takes over)."""
  return [l for l in result.stderr.splitlines() if l.startswith('error:')]


@pytest.mark.parametrize(
  'override, culprit',
  [
    (
      '--config.train.batchsize=3',
      '--config.train.batchsize=3: the config has no key train.batchsize; did you mean '
      'train.batch_size?',
    ),
    ('--config.train.batch_size=abc', 'config.train.batch_size'),
    ('--config.train.batch_size=0', 'config.train.batch_size=0: must be > 0'),
    ('--config.precision.loss_scale=-4', 'config.precision.loss_scale'),
  ],
)
def test_bad_override_is_one_line(override, culprit, tmp_path):
  workdir = tmp_path / 'work'
  result = launch('--config=configs/mnist.py', override, f'--workdir={workdir}')
  assert result.returncode == 2
  assert 'Traceback' not in result.stderr
  lines = error_lines(result)
  assert len(lines) == 1 and culprit in lines[0], result.stderr[-2000:]
  assert not workdir.exists()


def test_missing_config_file_is_one_line(tmp_path):
  result = launch('--config=configs/no_such.py')
  assert result.returncode == 2 and 'Traceback' not in result.stderr
  assert error_lines(result) == [
    'error: --config=configs/no_such.py: no such file; pass a config file such as configs/mnist.py'
  ]


def test_race_with_workers_is_refused_in_one_line_before_any_worker_starts(tmp_path):
  """--race (like --audit, --advise) runs in one process: under --workers each worker would race."""
  workdir = tmp_path / 'work'
  result = launch('--config=configs/mnist.py', '--workers=2', '--race=5', f'--workdir={workdir}')
  assert result.returncode == 2 and 'Traceback' not in result.stderr
  assert error_lines(result) == [
    'error: --workers=2 trains; --audit/--advise/--race runs in one process: leave --workers=2 out'
  ]
  assert not workdir.exists()


def test_config_file_whose_get_config_returns_none(tmp_path):
  """It said '--config is required', although --config was given."""
  path = tmp_path / 'no_return.py'
  path.write_text(
    'from trainer import config as config_lib\n\n\ndef get_config():\n'
    '  config = config_lib.defaults()\n'
  )
  result = launch(f'--config={path}', f'--workdir={tmp_path / "work"}')
  assert result.returncode == 2 and 'Traceback' not in result.stderr
  assert error_lines(result) == [
    f'error: --config={path}: get_config() returned None; end it with `return config` (see '
    'configs/mnist.py)'
  ]
  assert not (tmp_path / 'work').exists()


def test_launch_trains_and_prints_accuracy(mnist_dir, tmp_path):
  result = launch(
    '--config=configs/mnist.py',
    f'--config.data.dir={mnist_dir}',
    '--config.train.steps=20',
    '--config.train.steps_per_loop=10',
    '--config.train.log_every=10',
    '--config.train.checkpoint_every=10',
    f'--workdir={tmp_path}',
  )
  assert result.returncode == 0, result.stderr[-3000:]
  accuracy = [l for l in result.stdout.splitlines() if l.startswith('accuracy: ')]
  assert len(accuracy) == 1 and 0.5 < float(accuracy[0].split()[1]) <= 1.0
  assert (tmp_path / 'config.json').exists()
  assert sorted(os.listdir(tmp_path / 'checkpoints'))[0] == 'checkpoint'


def test_tensorflows_tf_data_options_warning_is_hidden_and_others_are_not():
  """A mirrored eval printed TensorFlow's 'To make it possible to preserve tf.data options ...'
  UserWarning, raised inside its own distributed-dataset reduce; other warnings still show."""
  code = (
    'import warnings; from trainer.launch import startup; startup.quiet_tensorflow(); '
    'warnings.warn("To make it possible to preserve tf.data options across '
    'serialization boundaries, ..."); warnings.warn("a warning of the user\'s own")'
  )
  result = subprocess.run(
    [sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
  )
  assert 'preserve tf.data options' not in result.stderr
  assert "a warning of the user's own" in result.stderr


def test_launch_imports_keras_without_matplotlib_and_keras_plots_still_work(tmp_path):
  """`import keras` loads matplotlib.pyplot and .patches (keras.visualization) when matplotlib is
  installed, for plotting functions training never calls; launch.py hides it while Keras loads,
  and Keras's plotting functions import it when called."""
  pytest.importorskip('matplotlib')
  png = tmp_path / 'gallery.png'
  code = (
    'import sys; from trainer.launch import startup; startup.import_keras(); '
    "print(sorted(m for m in sys.modules if m.split('.')[0] == 'matplotlib')); "
    'import numpy as np, keras; '
    f'keras.visualization.plot_image_gallery(np.zeros([2, 8, 8, 3]), path={str(png)!r}); '
    "print('matplotlib.pyplot' in sys.modules)"
  )
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3', MPLBACKEND='Agg')
  result = subprocess.run(
    [sys.executable, '-c', code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.split('\n')[:2] == ['[]', 'True']
  assert png.stat().st_size > 0


GC_MODULE = """import gc, json, tiny


class Tiny(tiny.TinyTrainer):
  def build_actions(self):
    def record(event):
      if event.kind == 'log':
        with open(self.workdir + '/gc.json', 'w') as f:
          json.dump([gc.isenabled(), gc.get_freeze_count()], f)
    return [record]
"""


def test_the_collector_is_on_while_training_with_the_imports_frozen_out_of_it(tmp_path):
  """launch.py turns Python's cycle collector off while TensorFlow and Keras import (hundreds of
  passes over what they make) and back on, those objects frozen, before the trainer is built: a run
  with it left off would never free a reference cycle."""
  (tmp_path / 'gcpkg').mkdir()
  (tmp_path / 'gcpkg' / '__init__.py').write_text('')
  (tmp_path / 'gcpkg' / 'gc_model.py').write_text(GC_MODULE)
  result = tiny.launch_tiny(
    tmp_path / 'run', '--config.train.steps=5', model='gcpkg.gc_model', path=tmp_path
  )
  assert result.returncode == 0, result.stderr[-3000:]
  enabled, frozen = json.loads((tmp_path / 'run' / 'gc.json').read_text())
  assert enabled
  assert frozen > 100_000  # TensorFlow's and Keras's objects: about 500,000 here


def launch_tiny(tmp_path, *args):
  """launch.py with tests/tiny.py's model (a module of a package in tmp_path), run in
  tmp_path/run."""
  return tiny.launch_tiny(tmp_path / 'run', *args, model=tiny.tiny_package(tmp_path), path=tmp_path)


def test_a_run_that_ends_diverged_exits_3_with_one_line(tmp_path):
  """It exited 0 ('final eval: loss 1.8e+04'): a script or CI job saw success."""
  result = launch_tiny(
    tmp_path,
    '--config.train.steps=40',
    '--config.optimizer.name=sgd',
    '--config.optimizer.learning_rate=5',
    '--config.optimizer.schedule=constant',
  )
  assert result.returncode == 3, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr and 'final eval' not in result.stdout
  lines = error_lines(result)
  assert len(lines) == 1, result.stderr[-3000:]
  assert lines[0].startswith('error: step 40: the run ended diverged (divergence at step 40: ')
  assert 'last healthy: ckpt-' in lines[0]


@pytest.mark.slow
def test_eval_names_its_checkpoint_and_a_collapsed_run_exits_3(tmp_path):
  """--mode=eval of a collapsed run evaluated its newest (finite, useless) checkpoint and exited
  0 with 'final eval: loss nan'. The collapse itself exits 3 too, and so does its export."""
  assert launch_tiny(tmp_path, '--config.train.steps=20').returncode == 0
  healthy = launch_tiny(tmp_path, '--config.train.steps=20', '--mode=eval')
  assert healthy.returncode == 0, healthy.stderr[-3000:]
  assert '(ckpt-20, the last healthy one): loss ' in healthy.stderr
  broken = launch_tiny(
    tmp_path,
    '--config.train.steps=60',
    '--config.optimizer.learning_rate=1e38',
    '--config.train.accept_config_change=True',
    '--config.precision.max_consecutive_skips=20',
    '--config.train.max_to_keep=2',
  )
  assert broken.returncode == 3, broken.stderr[-3000:]
  assert error_lines(broken)[0].startswith('error: training collapsed at step ')
  result = launch_tiny(tmp_path, '--config.train.steps=60', '--mode=eval')
  assert result.returncode == 3, result.stderr[-3000:]
  lines = error_lines(result)
  assert len(lines) == 1 and 'final eval' not in result.stdout, result.stderr[-3000:]
  assert re.match(
    r'error: --mode=eval: ckpt-(\d+) \(step \1, not the last healthy one \(last healthy: '
    r'ckpt-20, step 20, loss [\d.]+\)\) gives eval loss nan',
    lines[0],
  ), lines[0]
  # --mode=export of it exited 0 with no warning: refused the same way, nothing exported.
  export = launch_tiny(tmp_path, '--config.train.steps=60', '--mode=export')
  assert export.returncode == 3, export.stderr[-3000:]
  assert error_lines(export) == [lines[0].replace('--mode=eval', '--mode=export')]
  assert not os.path.exists(f'{tmp_path / "run"}-export')


def _launch_python(*args, python_flags=(), prelude='pass'):
  """launch.py run as __main__ after `prelude`, with `python_flags` (e.g. -X importtime)."""
  code = (
    f'import runpy, sys; {prelude}; sys.argv[0] = "launch.py"; '
    'runpy.run_path("launch.py", run_name="__main__")'
  )
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='3')
  return subprocess.run(
    [sys.executable, *python_flags, '-c', code, *args],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )


def test_a_value_of_the_wrong_type_in_a_config_file_is_one_line_naming_the_key(tmp_path):
  """It printed ml_collections' words: 'Could not override field 'learning_rate' (reference).
  3e-4 is of original type <class 'str'> ...', with no key path and no line."""
  path = tmp_path / 'bad_value.py'
  path.write_text(
    'from trainer import config as config_lib\n\n\ndef get_config():\n'
    '  config = config_lib.defaults()\n'
    "  config.model = 'mnist_cnn'\n"
    "  config.optimizer.learning_rate = '3e-4'  # a quoted number\n"
    '  return config\n'
  )
  result = launch(f'--config={path}', f'--workdir={tmp_path / "work"}')
  assert result.returncode == 2 and 'Traceback' not in result.stderr
  assert 'original type' not in result.stderr
  assert error_lines(result) == [
    f"error: config.optimizer.learning_rate = '3e-4' ({path}, line 7): "
    'config.optimizer.learning_rate holds a float, not a str; write 3e-4 without quotes'
  ]


@pytest.mark.parametrize(
  'file_text, args, culprit',
  [
    (  # a value of the wrong type inside get_config()
      'from trainer import config as config_lib\n\n\ndef get_config():\n'
      '  config = config_lib.defaults()\n'
      "  config.train.batch_size = 'big'\n"
      '  return config\n',
      (),
      'config.train.batch_size holds an int, not a str',
    ),
    (  # a schema value checked by trainer/config.py
      'from trainer import config as config_lib\n\n\ndef get_config():\n'
      '  config = config_lib.defaults()\n'
      "  config.model = 'mnist_cnn'\n"
      '  config.train.batch_size = 0\n'
      '  return config\n',
      (),
      'config.train.batch_size=0: must be > 0',
    ),
    (  # an override
      'from trainer import config as config_lib\n\n\ndef get_config():\n'
      '  return config_lib.defaults()\n',
      ('--config.precision.loss_scale=-4',),
      'config.precision.loss_scale',
    ),
  ],
)
def test_config_mistakes_are_reported_before_tensorflow_is_imported(
  file_text, args, culprit, tmp_path
):
  """TensorFlow (the slowest import of a run) was imported before the config was read."""
  path = tmp_path / 'config.py'
  path.write_text(file_text)
  result = _launch_python(
    f'--config={path}', *args, f'--workdir={tmp_path / "work"}', python_flags=('-X', 'importtime')
  )
  assert result.returncode == 2
  lines = error_lines(result)
  assert len(lines) == 1 and culprit in lines[0], result.stderr[-2000:]
  imported = [
    l.rsplit('|', 1)[-1].strip() for l in result.stderr.splitlines() if 'import time' in l
  ]
  assert 'ml_collections' in imported and 'tensorflow' not in imported


def test_a_plain_dict_from_get_config_is_named_even_with_overrides(tmp_path):
  """With an override of a key the dict lacks, the first override was blamed: 'the config has
  no key optimizer.learning_rate'."""
  path = tmp_path / 'plain.py'
  path.write_text("def get_config():\n  return {'model': 'mnist_cnn', 'train': {'steps': 10}}\n")
  for overrides in (['--config.optimizer.learning_rate=0.1'], ['--config.train.steps=5']):
    result = launch(f'--config={path}', *overrides)
    assert result.returncode == 2 and 'Traceback' not in result.stderr
    assert error_lines(result) == [
      f'error: --config={path}: get_config() returned a dict, not an '
      'ml_collections.ConfigDict; wrap it: return ml_collections.ConfigDict({...})'
    ], overrides


def test_an_error_after_tensorflow_is_loaded_ends_the_process_without_finalization(tmp_path):
  """After its error line the process spent seconds in the interpreter's finalization (tearing
  down TensorFlow's and Keras's modules and objects); it now ends at once, so an atexit handler
  registered before the launch never runs (one that runs means a normal, slow exit)."""
  result = _launch_python(
    '--config=configs/mnist.py',
    f'--config.data.dir={tmp_path / "missing"}',
    f'--workdir={tmp_path / "work"}',
    prelude='import atexit; atexit.register(print, "finalized")',
  )
  assert result.returncode == 2
  assert len(error_lines(result)) == 1 and 'config.data.dir' in error_lines(result)[0]
  assert 'finalized' not in result.stdout


def test_a_second_run_loads_its_xla_programs_from_the_compile_cache(tmp_path, monkeypatch):
  """With the cache on (its default; the tests turn it off, tests/conftest.py) the first run
  compiles its XLA programs into the folder and the same command again loads every one of them
  (no file is written again: a compiled program replaces its file) and trains to the same losses,
  bit for bit."""
  monkeypatch.delenv('TF_XLA_FLAGS')
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))
  package = tiny.tiny_package(tmp_path)
  runs, listings = [], []
  for name in ('first', 'second'):
    result = tiny.launch_tiny(
      tmp_path / name,
      '--config.train.steps=10',
      '--config.train.jit_compile=true',
      model=package,
      path=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    runs.append(result)
    (folder,) = re.findall(r'XLA compile cache (\S+): \d+ programs', result.stderr)
    files = sorted(os.scandir(folder), key=lambda e: e.name)
    listings.append([(e.name, e.inode(), e.stat().st_mtime_ns) for e in files])
  programs = listings[0]
  assert len(programs) >= 2  # the train step's and the eval's
  assert listings[1] == programs
  assert f'{folder}: 0 programs' in runs[0].stderr
  assert f'{folder}: {len(programs)} programs' in runs[1].stderr

  def numbers(result):
    lines = re.findall(r'(step \d+/10 .*?) \| lr|(eval at step .*)', result.stderr)
    return [a or b for a, b in lines] + [result.stdout]

  assert numbers(runs[0]) == numbers(runs[1]) and len(numbers(runs[0])) >= 3


def test_a_compile_cache_that_cannot_be_written_is_one_line_naming_it(tmp_path, monkeypatch):
  """TensorFlow fails the compilation whose program it cannot save (a folder of the user's own
  that is not writable, a full disk) with an error of many lines."""
  folder = tmp_path / 'a_file'
  folder.write_text('not a folder')
  monkeypatch.setenv(
    'TF_XLA_FLAGS',
    f'--tf_xla_persistent_cache_directory={folder} --tf_xla_persistent_cache_device_types=CPU',
  )
  result = launch_tiny(tmp_path, '--config.train.steps=10', '--config.train.jit_compile=true')
  assert result.returncode == 2, result.stderr[-3000:]
  (line,) = error_lines(result)
  assert line.startswith(
    f'error: XLA compile cache {folder}: compiling the train step failed there ('
  ), line
  assert 'turn the cache off (TF_XLA_FLAGS=--tf_xla_persistent_cache_directory=)' in line
