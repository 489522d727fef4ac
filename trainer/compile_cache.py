"""XLA's persistent compile cache: on for launch.py's runs unless the user says otherwise.

With TensorFlow's flag --tf_xla_persistent_cache_directory (in the environment variable
TF_XLA_FLAGS) naming a folder, each program XLA compiles is saved there and loaded instead of
compiled the next time the same program comes (its function's name, argument shapes and HLO are
the key). TensorFlow reads its XLA flags once, when its runtime starts (the first op), so
`prefer` (called by `trainer.launcher_defaults()`, which launch.py calls first; importing trainer
sets nothing) sets them when three things hold:
  * TF_XLA_FLAGS does not mention the flag (`--tf_xla_persistent_cache_directory=`, empty, keeps
    the cache off; a folder of the user's own replaces ours);
  * TensorFlow is not imported yet (then it is too late to tell whether its runtime started);
  * the folder can be created and written (TensorFlow fails the compilation it cannot save).
The folder is $XDG_CACHE_HOME (else ~/.cache)/mpt-trainer/xla/<TensorFlow version>-<CPU>: a saved
program is machine code for one instruction set, built by one XLA, and TensorFlow's key names
neither. It is used for programs compiled for the CPU only
(--tf_xla_persistent_cache_device_types=CPU), the device this project measured it on.

A re-run of a command loads its programs (the train step's and the eval's, whose compilation is
a visible share of a short run's start: docs/results/peer_nanogpt.md). A function's name counts
the functions made before it, so a change that makes more or fewer of them first (a resumed
run's restore) compiles that program again, beside the old one; so that these do not pile up,
`prefer` keeps the folder under LIMIT bytes, deleting the programs written longest ago first (a
load is no write: a program in use may be compiled once more). The run's log line (`describe`)
gives the folder and what it holds. TensorFlow-free.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import platform
import sys
import tempfile

ENV = 'TF_XLA_FLAGS'
FLAG = '--tf_xla_persistent_cache_directory'
DEVICES = '--tf_xla_persistent_cache_device_types=CPU'
LIMIT = 2**30
_off_reason = ''  # why `prefer` left the cache off ('' when it did not run or set it)


def _tensorflow_version() -> str:
  for name in ('tensorflow', 'tensorflow-cpu', 'tf-nightly', 'tensorflow-intel'):
    try:
      return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      continue
  return 'unknown'


def _cpu() -> str:
  """The machine and a short digest of its CPU's model and feature flags."""
  text = platform.processor()
  with contextlib.suppress(OSError), open('/proc/cpuinfo', encoding='utf-8') as f:
    lines = f.read().split('\n\n', 1)[0].splitlines()  # the first core
    text = '\n'.join(x for x in lines if x.startswith(('model name', 'flags', 'Features')))
  return f'{platform.machine()}-{hashlib.sha256(text.encode()).hexdigest()[:10]}'


def default_directory() -> str:
  root = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
  return os.path.join(root, 'mpt-trainer', 'xla', f'{_tensorflow_version()}-{_cpu()}')


def _writable(folder: str) -> bool:
  try:
    os.makedirs(folder, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder):
      return True
  except OSError:
    return False


def prefer() -> None:
  """Turns the cache on (our folder, CPU programs) if TF_XLA_FLAGS does not mention it and
  TensorFlow is not loaded yet; else leaves TF_XLA_FLAGS as it is."""
  global _off_reason
  flags = os.environ.get(ENV, '')
  if FLAG in flags:
    return
  if 'tensorflow' in sys.modules:
    _off_reason = (
      'TensorFlow was imported before trainer.launcher_defaults(): call it first, or name a '
      f'folder in {ENV} before TensorFlow runs its first op ({FLAG}=DIR)'
    )
    return
  folder = default_directory()
  if not _writable(folder):
    _off_reason = f'{folder} cannot be written'
    return
  prune(folder, LIMIT)
  os.environ[ENV] = ' '.join(x for x in (flags, f'{FLAG}={folder}', DEVICES) if x)


def prune(folder: str, limit: int) -> None:
  """Deletes the programs written longest ago until the folder's programs take <= `limit`
  bytes."""
  programs = _programs(folder)
  total = sum(size for _, size, _ in programs)
  for _, size, name in sorted(programs):
    if total <= limit:
      break
    with contextlib.suppress(OSError):
      os.remove(os.path.join(folder, name))
    total -= size


def directory() -> str:
  """The folder TF_XLA_FLAGS names ('' = the cache is off)."""
  found = ''
  for token in os.environ.get(ENV, '').split():
    if token.startswith(FLAG + '='):
      found = token.split('=', 1)[1]  # the last one wins, as in TensorFlow's parser
  return found


def describe() -> str:
  """One log line: the folder in use with how much it holds, or why there is none."""
  folder = directory()
  if not folder:
    why = _off_reason or (
      f'{ENV} sets {FLAG}= empty'
      if FLAG in os.environ.get(ENV, '')
      else f'{ENV} names no folder; trainer.launcher_defaults() names one'
    )
    return f'XLA compile cache off ({why}): every run compiles its XLA programs'
  programs = _programs(folder)
  size = sum(size for _, size, _ in programs)
  return (
    f'XLA compile cache {folder}: {len(programs)} programs, {size / 2**20:.1f} MB '
    f'({ENV}={FLAG}= turns it off)'
  )


def _programs(folder: str) -> list[tuple[float, int, str]]:
  """(mtime, size, name) of each program file in `folder` (none when it cannot be listed)."""
  try:
    names = [n for n in os.listdir(folder) if n.endswith('.pb')]
  except OSError:
    return []
  programs = []
  for name in names:
    try:
      stat = os.stat(os.path.join(folder, name))
    except OSError:  # another process deleted it
      continue
    programs.append((stat.st_mtime, stat.st_size, name))
  return programs
