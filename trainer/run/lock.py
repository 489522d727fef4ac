"""One training process per workdir: a lock file recording the holder's pid and host.

The lock is `<workdir>/train.lock`, a JSON record {"pid", "host", "start", "since"}, created
atomically with its content (a fresh temporary file hard-linked to the lock's name, which fails
if any file or symlink of that name exists): a reader never sees a half-written lock and the
creation never follows a symlink. Without hard links (some FUSE mounts) it is created with
O_CREAT|O_EXCL and then written; a reader that finds it still empty waits. It is removed when the
holder exits (atexit, or `release_all()` before an os._exit) or closes its Workdir.

A lock whose holder is gone is stale and taken over with a warning: same host and no process with
that pid, or one that started at another time (a reused pid; the start time from /proc where
there is one). kill -9 leaves the file behind; the next run takes it over this way. Comparing the
file with the stale record and removing it happen under an flock of the workdir, so of two
processes taking over one stale lock, the later never removes the lock the earlier just created.
An empty or unparsable lock file (a holder killed before writing its record, or a full disk
without hard links) is a holder being written while younger than `GRACE_SECONDS`, stale after
that. A lock held from another host cannot be checked: the error says so and names the file to
delete once that process is known to be gone. The lock is per process, not per object: the same
process may take it again (a second Trainer on the same workdir in one script or test).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import tempfile
import time

from absl import logging

from trainer.errors import UserError

NAME = 'train.lock'
# An empty or garbled lock younger than this may be a holder writing its record; older, stale.
GRACE_SECONDS = 10.0

_held: dict[str, list] = {}  # lock path -> [our record, holders in this process]


def _start_time(pid: int) -> str | None:
  """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), or None
  where there is no /proc."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      stat = f.read()
  except OSError:
    return None
  # The command name (field 2) is in parentheses and may hold spaces: split after it.
  return stat.rsplit(')', 1)[1].split()[19]


def _alive(pid: int, start: str | None) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # exists, owned by someone else
    pass
  now = _start_time(pid)
  return start is None or now is None or now == start


def _record() -> dict:
  pid = os.getpid()
  return {
    'pid': pid,
    'host': socket.gethostname(),
    'start': _start_time(pid),
    'since': datetime.datetime.now().isoformat(timespec='seconds'),
  }


def _read(path: str) -> dict | None:
  """The lock's record; None when there is no lock; {'unreadable': text, ...} when it is empty
  or garbled (a holder still writing it, or a stale one: `acquire` decides by its age). UserError
  when it cannot be opened."""
  try:
    fd = os.open(path, os.O_RDONLY | getattr(os, 'O_NOFOLLOW', 0))
  except FileNotFoundError:
    return None
  except OSError as e:
    raise UserError(
      f'{path} cannot be read ({e.strerror}); it should be a lock file written '
      'by a training process: delete it if no training runs on this workdir.'
    ) from None
  with os.fdopen(fd, 'rb') as f:
    data = f.read(4096)
    age = time.time() - os.fstat(f.fileno()).st_mtime
  try:
    record = json.loads(data.decode())
    int(record['pid']), str(record['host'])
    return record
  except (ValueError, KeyError, TypeError, AttributeError):
    return {'pid': -1, 'host': '', 'unreadable': data[:60], 'age': age}


def _link_new(path: str, record: dict) -> bool:
  """Creates `path` holding `record`, atomically; False when a file of that name exists."""
  fd, tmp = tempfile.mkstemp(prefix='.train.lock-', dir=os.path.dirname(path))
  try:
    with os.fdopen(fd, 'w') as f:
      json.dump(record, f)
    try:
      os.link(tmp, path)
    except FileExistsError:
      return False
    except OSError as e:
      if e.errno not in _NO_HARD_LINKS:
        raise
      return _create_new(path, record)
    return True
  finally:
    os.remove(tmp)


# File systems without hard links (some FUSE mounts, e.g. gcsfuse) refuse os.link with these.
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV}


def _create_new(path: str, record: dict) -> bool:
  """The fallback of _link_new: O_CREAT|O_EXCL (still atomic creation, never through a link),
  then the record is written; a reader in between sees an empty file (`_read`: a holder being
  written)."""
  try:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, 'O_NOFOLLOW', 0), 0o644)
  except FileExistsError:
    return False
  with os.fdopen(fd, 'w') as f:
    json.dump(record, f)
    f.flush()
    os.fsync(f.fileno())
  return True


@contextlib.contextmanager
def _takeover_guard(path: str):
  """An exclusive flock on the lock's folder while a lock file is compared and removed: two
  processes taking over the same stale lock (or one releasing while another takes over) cannot
  both read the old record and then remove the newer lock the other just created. Where the file
  system has no flock (some network mounts), without it."""
  try:
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
  except OSError:
    yield
    return
  try:
    with contextlib.suppress(OSError):
      fcntl.flock(fd, fcntl.LOCK_EX)
    yield
  finally:
    os.close(fd)  # releases the flock


def acquire(workdir: str) -> str:
  """Takes the workdir's lock for this process; returns its path. UserError naming the holder
  when a live process holds it."""
  path = os.path.join(workdir, NAME)
  if path in _held:
    _held[path][1] += 1
    return path
  ours = _record()
  for _ in range(3 + int(GRACE_SECONDS / 0.1)):  # a takeover races with another process's
    if _link_new(path, ours):
      _held[path] = [ours, 1]
      return path
    holder = _read(path)
    if holder is None:
      continue  # released between our attempt and the read
    if 'unreadable' in holder:
      if holder['age'] < GRACE_SECONDS:
        time.sleep(0.1)  # its record may be being written (_create_new)
        continue
      text = holder['unreadable']
      logging.warning(
        '%s is %s and %.0f s old: a stale lock (its holder died before writing '
        'it, or the disk was full); taking it over',
        path,
        'empty' if not text else f'not a lock record ({text!r})',
        holder['age'],
      )
      _remove_if(path, holder)
      continue
    same_host = holder['host'] == ours['host']
    if same_host and holder['pid'] == ours['pid'] and holder.get('start') == ours['start']:
      _held[path] = [holder, 1]  # our own, left by an earlier holder in this process
      return path
    if same_host and not _alive(int(holder['pid']), holder.get('start')):
      logging.warning(
        '%s was left by process %s on %s (since %s), which is gone; taking it over',
        path,
        holder['pid'],
        holder['host'],
        holder.get('since', '?'),
      )
      _remove_if(path, holder)
      continue
    raise _in_use(workdir, holder, same_host)
  raise UserError(
    f'could not take the lock {path}: other processes keep replacing it; if no '
    f'training runs on this workdir, delete {path}.'
  )


def _in_use(workdir: str, holder: dict, same_host: bool) -> UserError:
  path = os.path.join(workdir, NAME)
  where = 'this host' if same_host else f'host {holder["host"]}'
  hint = '' if same_host else f'; if that process is gone, delete {path}'
  return UserError(
    f'workdir {workdir} is in use by another training process (pid '
    f'{holder["pid"]} on {where}, since {holder.get("since", "?")}): wait for it '
    f'to finish or stop it, or use another --workdir{hint}.'
  )


def check_free(workdir: str) -> None:
  """UserError (as `acquire` raises it) when a live process holds the workdir's lock; reads the
  lock only. For a launcher, before it starts workers that would read the run folder."""
  holder = _read(os.path.join(workdir, NAME))
  if holder is None or 'unreadable' in holder:
    return  # free, or a holder still writing or stale: the chief's `acquire` decides
  same_host = holder['host'] == socket.gethostname()
  if not same_host or _alive(int(holder['pid']), holder.get('start')):
    raise _in_use(workdir, holder, same_host)


def _remove_if(path: str, record: dict) -> None:
  """Removes the lock at `path` if it still holds `record` (not a newer holder's)."""
  with contextlib.suppress(OSError, UserError), _takeover_guard(path):
    now = _read(path)
    if now is not None and _same(now, record):
      os.remove(path)


def _same(a: dict, b: dict) -> bool:
  """The same lock record (an unreadable one: the same bytes; its age is not compared)."""
  return {k: v for k, v in a.items() if k != 'age'} == {k: v for k, v in b.items() if k != 'age'}


def release(path: str) -> None:
  """Releases one hold of a lock this process took; the file goes with the last one."""
  held = _held.get(path)
  if held is None:
    return
  held[1] -= 1
  if held[1] <= 0:
    del _held[path]
    _remove_if(path, held[0])


@atexit.register
def release_all() -> None:
  """Releases every lock this process holds. Runs at exit; a launcher that ends the process with
  os._exit (skipping atexit) must call it first."""
  for path, (record, _) in list(_held.items()):
    del _held[path]
    _remove_if(path, record)
