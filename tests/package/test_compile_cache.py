"""trainer/compile_cache.py: `trainer.launcher_defaults()` turns XLA's persistent compile cache
on (a folder per TensorFlow version and CPU, for CPU programs) unless TF_XLA_FLAGS names one or
TensorFlow loaded first; the folder is kept under its size limit, oldest programs first. The
runs that load their programs from it: tests/e2e/test_launch.py."""

import os
import sys

import pytest
import tensorflow as tf

from trainer import compile_cache


@pytest.fixture
def fresh(monkeypatch, tmp_path):
  """A process as `import trainer` finds it when TensorFlow is not loaded yet."""
  monkeypatch.delenv(compile_cache.ENV, raising=False)
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))
  monkeypatch.delitem(sys.modules, 'tensorflow')
  monkeypatch.setattr(compile_cache, '_off_reason', '')
  return tmp_path / 'cache'


def test_import_sets_a_folder_per_tensorflow_version_and_cpu_keeping_other_flags(
  fresh, monkeypatch
):
  monkeypatch.setenv(compile_cache.ENV, '--tf_xla_enable_lazy_compilation=false')
  compile_cache.prefer()
  folder = compile_cache.directory()
  assert os.path.dirname(folder) == str(fresh / 'mpt-trainer' / 'xla')
  assert os.path.basename(folder).startswith(f'{tf.__version__}-')  # the installed TensorFlow
  assert os.path.isdir(folder)
  assert os.environ[compile_cache.ENV] == (
    '--tf_xla_enable_lazy_compilation=false '
    f'--tf_xla_persistent_cache_directory={folder} --tf_xla_persistent_cache_device_types=CPU'
  )
  assert compile_cache.describe().startswith(f'XLA compile cache {folder}: 0 programs, 0.0 MB')


@pytest.mark.parametrize(
  'flags', ['--tf_xla_persistent_cache_directory=', '--tf_xla_persistent_cache_directory=/mine']
)
def test_a_folder_the_user_names_or_leaves_empty_is_kept(fresh, monkeypatch, flags):
  monkeypatch.setenv(compile_cache.ENV, flags)
  compile_cache.prefer()
  assert os.environ[compile_cache.ENV] == flags and not fresh.exists()
  if flags.endswith('='):
    assert compile_cache.describe().startswith(
      'XLA compile cache off (TF_XLA_FLAGS sets --tf_xla_persistent_cache_directory= empty)'
    )
  else:
    assert compile_cache.describe().startswith('XLA compile cache /mine: 0 programs')


def test_off_when_tensorflow_loaded_first_or_the_folder_cannot_be_written(fresh, monkeypatch):
  monkeypatch.setitem(sys.modules, 'tensorflow', tf)
  compile_cache.prefer()
  assert compile_cache.ENV not in os.environ and not fresh.exists()
  assert 'off (TensorFlow was imported before trainer.launcher_defaults(): call it first' in (
    compile_cache.describe()
  )

  monkeypatch.delitem(sys.modules, 'tensorflow')
  fresh.write_text('a file, not a folder')
  compile_cache.prefer()
  assert compile_cache.ENV not in os.environ
  assert 'cannot be written' in compile_cache.describe()


def test_prune_deletes_the_programs_written_longest_ago_down_to_the_limit(tmp_path):
  for age, name in enumerate(['new', 'mid', 'old', 'oldest']):
    path = tmp_path / f'{name}.pb'
    path.write_bytes(b'x' * 100)
    os.utime(path, (1e9 - age, 1e9 - age))
  (tmp_path / 'notes.txt').write_bytes(b'x' * 1000)  # not a program: never counted or deleted
  compile_cache.prune(str(tmp_path), 250)
  assert sorted(os.listdir(tmp_path)) == ['mid.pb', 'new.pb', 'notes.txt']
  compile_cache.prune(str(tmp_path), 200)
  assert sorted(os.listdir(tmp_path)) == ['mid.pb', 'new.pb', 'notes.txt']
