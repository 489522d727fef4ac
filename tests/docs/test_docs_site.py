"""The site's shape (mkdocs.yml, docs/index.md): a manual with the records beside it. The nav
has one Results entry, the records are reached from its index (docs/results.md), and the front
page's map links every guide."""

import os
import re

import yaml
from conftest import ROOT


def test_every_guide_is_on_the_front_pages_map():
  with open(os.path.join(ROOT, 'docs', 'index.md')) as f:
    linked = set(re.findall(r'\]\(guides/([\w-]+\.md)\)', f.read()))
  guides = {f for f in os.listdir(os.path.join(ROOT, 'docs', 'guides')) if f.endswith('.md')}
  assert len(guides) >= 16
  assert sorted(guides - linked) == [], 'guides missing from docs/index.md'


def test_the_nav_has_one_results_entry_and_no_record():
  with open(os.path.join(ROOT, 'mkdocs.yml')) as f:
    site = yaml.load(f, Loader=yaml.BaseLoader)
  top = {title: page for entry in site['nav'] for title, page in entry.items()}
  assert top['Results'] == 'results.md'
  assert not re.search(r"results/|'references\.md'", str(site['nav']))
  # Left out of the nav on purpose, so that a strict build does not warn about them.
  assert {'/results/', '/references.md'} <= set(site['not_in_nav'].split())


def test_the_api_page_renders_the_public_scaler_and_its_monitor():
  with open(os.path.join(ROOT, 'docs', 'reference', 'api.md')) as f:
    entries = re.findall(r'^::: ([\w.]+)', f.read(), re.M)
  assert entries[0] == 'trainer.trainer.Trainer'  # the hooks first
  for name in ('LossScaleOptimizer', 'LossScaleMonitor'):
    assert f'trainer.mixed_precision.{name}' in entries, name


def test_the_modules_page_shows_every_module_under_its_package():
  """docs/reference/modules.md renders each module's docstring; after a move (trainer/launch,
  trainer/optim, trainer/distribute) the page names the modules where they now are."""
  with open(os.path.join(ROOT, 'docs', 'reference', 'modules.md')) as f:
    shown = set(re.findall(r'^::: ([\w.]+)', f.read(), re.M))
  modules = set()
  for folder, _, files in os.walk(os.path.join(ROOT, 'trainer')):
    package = os.path.relpath(folder, ROOT).replace(os.sep, '.')
    modules |= {f'{package}.{f[:-3]}' for f in files if f.endswith('.py') and f != '__init__.py'}
  assert sorted(modules - shown) == [] and sorted(shown - modules) == []
