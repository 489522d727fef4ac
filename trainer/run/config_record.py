"""A run's config records (config.json, config-step-N.json: trainer/run/workdir.py writes them):
reading the newest, which keys changed, which a resume may change (RESUMABLE) and which change
what a restored model computes (COMPUTES)."""

from __future__ import annotations

import glob
import json
import os
import re

from trainer import config as config_lib
from trainer.errors import ConfigError

CONFIG = 'config.json'
ACCEPT_KEY = 'train.accept_config_change'

# Keys a resume may change without config.train.accept_config_change (with a warning): they set
# how long the run goes, how often it logs or saves, where the data is, and how the same steps
# are run, not what a step computes.
RESUMABLE = frozenset(
  {
    'train.steps',
    'train.epochs',
    'train.steps_per_loop',
    'train.log_every',
    'train.eval_every',
    'train.checkpoint_every',
    'train.max_to_keep',
    'train.recover_tries',
    'train.profile_steps',
    'train.async_checkpoint',
    'train.jit_compile',
    'numerics.every',
    'numerics.forensics_first',
    'numerics.forensics_every',  # diagnostics only
    'data.dir',
    'distribute.strategy',
    'distribute.devices',
    'distribute.tpu',
    ACCEPT_KEY,
  }
)


# Keys that change what eval, export and diagnose compute from the same weights, with every
# model_config.* and data.* key but data.dir (`computes`).
COMPUTES = ('model', 'precision.policy', 'precision.float8', 'precision.float32_layers')


def computes(key: str) -> bool:
  """Whether config key `key` changes what a restored model computes."""
  return key in COMPUTES or key.startswith(('model_config.', 'data.')) and key != 'data.dir'


def config_records(path: str) -> list[tuple[int, str]]:
  """(step, file) of the workdir's config records, oldest first; config.json counts as step -1."""
  records = []
  if os.path.isfile(os.path.join(path, CONFIG)):
    records.append((-1, os.path.join(path, CONFIG)))
  for name in glob.glob(os.path.join(glob.escape(path), 'config-step-*.json')):
    match = re.fullmatch(r'config-step-(\d+)\.json', os.path.basename(name))
    if match:
      records.append((int(match.group(1)), name))
  return sorted(records)


def read_config(path: str) -> dict | None:
  """The newest config record of the workdir at `path` as a dict (None when it has none);
  ConfigError when that file is not a JSON config."""
  records = config_records(path)
  if not records:
    return None
  name = records[-1][1]
  try:
    with open(name) as f:
      saved = json.load(f)
  except (OSError, ValueError) as e:
    raise ConfigError(
      f'{name} is not a config this framework wrote ({type(e).__name__}: '
      f'{str(e)[:100]}); move it out of the workdir or use a new --workdir.'
    ) from None
  if not isinstance(saved, dict):
    raise ConfigError(
      f'{name} is not a config this framework wrote (a JSON '
      f'{type(saved).__name__}, not an object); move it out of the workdir or '
      'use a new --workdir.'
    )
  return saved


def changed_keys(saved: dict, current: dict) -> list[str]:
  """Keys whose values differ; a key the record lacks counts as unchanged when the current value
  is the schema's default (the record was written before that key existed), and an older
  spelling of the same value is no change (Key.coerce: a record's precision.float8=False is
  'none', True is 'delayed')."""
  a, b = config_lib.flatten(saved), config_lib.flatten(current)
  changed = []
  for key in config_lib.diff(saved, current):
    if key not in a and key in config_lib.SCHEMA and b.get(key) == config_lib.SCHEMA[key].default:
      continue
    if key in a and key in b and _spelled(key, a[key]) == _spelled(key, b[key]):
      continue
    changed.append(key)
  return changed


def _spelled(key: str, value):
  """`value` as config validation spells it (a key outside the schema: as it is)."""
  coerce = config_lib.SCHEMA[key].coerce if key in config_lib.SCHEMA else None
  return coerce(value) if coerce is not None else value


def describe_change(saved: dict, config, keys: list[str], head: str) -> str:
  """'<head> (config.k: old -> new; ... and N more)' for the first four changed keys."""
  flat_saved, flat_now = config_lib.flatten(saved), config_lib.flatten(config.to_dict())
  shown = '; '.join(
    f'config.{k}: {flat_saved.get(k, "(none)")!r} -> {flat_now.get(k, "(none)")!r}'
    for k in keys[:4]
  )
  return f'{head} ({shown}{f" and {len(keys) - 4} more" if len(keys) > 4 else ""})'


def saved_policy(saved: dict | None) -> str | None:
  """config.precision.policy of a config record (None when it has none)."""
  precision = saved.get('precision') if isinstance(saved, dict) else None
  policy = precision.get('policy') if isinstance(precision, dict) else None
  return None if policy is None else str(policy)


def policy_note(trained: str | None, trained_setting: str, now: str | None, setting: str) -> str:
  """'trained in X (...), this runs in Y (...)': the policies that ran, when 'auto' was the
  setting on a side (`trained_setting`: the run's, `setting`: this config's) and they differ
  (`trained` None: what 'auto' resolved to was not recorded). '' when both settings are explicit
  (the config change names them), they agree, or `now` (this process's policy) is unknown."""
  if 'auto' not in (trained_setting, setting) or now is None or trained == now:
    return ''
  if trained is None and trained_setting == setting:
    return ''  # 'auto' both times, its resolution then unknown: nothing to tell
  then = (
    "what 'auto' resolved to on its machine (not recorded)"
    if trained is None
    else f"{trained} ('auto' on its machine)"
    if trained_setting == 'auto'
    else trained
  )
  here = f"{now} ('auto' on this machine)" if setting == 'auto' else now
  return f'trained in {then}, this runs in {here}'
