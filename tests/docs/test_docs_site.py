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
