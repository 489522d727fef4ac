"""The package layout, measured from the code's imports (issue 19): no import circles, no import
from a lower layer to a higher one, trainer/trainer.py importing at most 6 project modules, no
module over 400 lines, and the config schema loading no TensorFlow."""
import ast
import os
import subprocess
import sys

from conftest import ROOT

# Low to high; a module may import its own layer or lower ones.
LAYERS = {'errors': 0, 'registry': 0, 'steps_text': 0, 'dotted': 0, 'config': 0, 'data': 1,
          'nn': 2, 'step': 3, 'insight': 4, 'run': 5, 'trainer': 6, '__init__': 7}


def modules() -> dict[str, str]:
  """{'trainer.step.train_step': path} for every module of the package."""
  found = {}
  for folder, _, files in os.walk(os.path.join(ROOT, 'trainer')):
    for name in files:
      if name.endswith('.py'):
        path = os.path.join(folder, name)
        dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, '.')
        found[dotted.removesuffix('.__init__') if name == '__init__.py' and
              dotted != 'trainer.__init__' else dotted] = path
  return found


def imports(path: str, known) -> set[str]:
  """The project modules `path` imports, at any depth of the file (lazy imports count)."""
  out = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [f'{node.module}.{a.name}' for a in node.names] + [node.module]
    else:
      continue
    for name in names:
      if name in known:
        out.add(name)
  # `from trainer.step import contract` names the module, not the package, when both match.
  return {m for m in out if not any(o.startswith(m + '.') for o in out)} or out


def layer(module: str) -> int:
  parts = module.split('.')
  return LAYERS[parts[1] if len(parts) > 1 else '__init__']


def graph():
  known = modules()
  return {m: imports(p, known) - {m} for m, p in known.items()}


def test_no_import_circles():
  edges = graph()
  state: dict[str, int] = {}

  def visit(node, path):
    state[node] = 1
    for nxt in edges.get(node, ()):
      if state.get(nxt) == 1:
        raise AssertionError('import circle: ' + ' -> '.join(path + [nxt]))
      if nxt not in state:
        visit(nxt, path + [nxt])
    state[node] = 2

  for node in edges:
    if node not in state:
      visit(node, [node])


def test_imports_only_point_down():
  upward = [f'{m} (layer {layer(m)}) imports {d} (layer {layer(d)})'
            for m, deps in graph().items() for d in deps
            if layer(d) > layer(m) and m not in ('trainer', 'trainer.__init__')]
  assert not upward, upward


def test_trainer_module_imports_at_most_six_project_modules():
  deps = graph()['trainer.trainer']
  assert len(deps) <= 6, sorted(deps)


def test_no_module_over_400_lines():
  long = {m: n for m, p in modules().items() if (n := len(open(p).readlines())) > 400}
  assert not long, long


def test_the_config_schema_loads_no_tensorflow():
  code = ('import sys, trainer.config, trainer.errors; from trainer import ConfigError; '
          "trainer.config.validate(trainer.config.defaults()); "
          "print('tensorflow' in sys.modules, 'keras' in sys.modules)")
  out = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.split() == ['False', 'False']
