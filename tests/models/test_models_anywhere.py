"""`config.model` as a dotted module path: a model in a package outside models/."""

import os
import textwrap

import pytest

import models
import tiny
from trainer.errors import ConfigError


def make_package(tmp_path, body: str, name='my_project', module='tiny_model'):
  """tmp_path/src/<name>/<module>.py holding `body`; returns the folder to put on sys.path."""
  package = tmp_path / 'src' / name
  package.mkdir(parents=True)
  (package / '__init__.py').write_text('')
  (package / f'{module}.py').write_text(textwrap.dedent(body))
  return tmp_path / 'src'


# tests/tiny.py's model, in a module of its own package: one Trainer subclass.
ONE = """
    import tiny
    from trainer import Trainer


    class MyTiny(tiny.TinyTrainer):
      pass
    """


def test_dotted_path_finds_the_one_subclass(tmp_path, monkeypatch):
  monkeypatch.syspath_prepend(str(make_package(tmp_path, ONE)))
  assert models.get_trainer_class('my_project.tiny_model').__name__ == 'MyTiny'


@pytest.mark.parametrize(
  'package, body, words',
  [
    ('pkg_none', 'from trainer import Trainer\n', 'found 0 (none)'),
    (
      'pkg_two',
      'from trainer import Trainer\nclass A(Trainer): pass\nclass B(Trainer): pass\n',
      'found 2 (A, B)',
    ),
  ],
)
def test_none_or_several_subclasses_is_one_line(tmp_path, monkeypatch, package, body, words):
  monkeypatch.syspath_prepend(str(make_package(tmp_path, body, name=package)))
  with pytest.raises(ConfigError) as info:
    models.get_trainer_class(f'{package}.tiny_model')
  message = str(info.value)
  assert '\n' not in message and words in message
  assert f"config.model='{package}.tiny_model'" in message
  assert 'exactly one Trainer subclass' in message


def test_missing_module_is_one_line():
  with pytest.raises(ConfigError) as info:
    models.get_trainer_class('no_such_project.gan')
  message = str(info.value)
  assert '\n' not in message and "no module 'no_such_project'" in message
  assert 'PYTHONPATH' in message


def test_an_import_error_inside_the_module_keeps_its_traceback(tmp_path, monkeypatch):
  monkeypatch.syspath_prepend(
    str(make_package(tmp_path, 'import not_installed_dep\n', name='pkg_broken'))
  )
  with pytest.raises(ModuleNotFoundError, match='not_installed_dep'):
    models.get_trainer_class('pkg_broken.tiny_model')


def test_launch_trains_a_model_from_a_package_outside_models(tmp_path):
  """Then --mode=eval and --mode=export leave every file of the run folder byte-identical."""
  from test_workdir import snapshot

  src = make_package(tmp_path, ONE, name='outside_pkg')
  workdir = tmp_path / 'run'
  launch = lambda *a: tiny.launch_tiny(
    workdir, '--config.train.steps=10', *a, model='outside_pkg.tiny_model', path=src
  )
  result = launch()
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'training MyTiny: 10 steps' in result.stderr
  assert 'XLA off, oneDNN kernels on, grappler off' in result.stderr  # what runs (a CPU)
  accuracy = result.stdout.split('accuracy: ')[1].split()[0]
  assert sorted(os.listdir(workdir)) == ['checkpoints', 'config.json', 'tensorboard']  # no lock
  before = snapshot(workdir)
  result = launch('--mode=eval', '--config.optimizer.learning_rate=0.5')
  assert result.returncode == 0, result.stderr[-3000:]
  assert f'accuracy: {accuracy}' in result.stdout
  result = launch('--mode=export', f'--export_dir={tmp_path / "exported"}')
  assert result.returncode == 0, result.stderr[-3000:]
  assert (tmp_path / 'exported' / 'model.keras').is_file()
  assert snapshot(workdir) == before
