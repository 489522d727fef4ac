"""Writing the diagnostics' files (forensic folders, advice.md, audit.md) into a run folder
without ever following a symlink out of it.

`folder(run, path, what)` makes the folder `path` inside `run` and refuses (UserError, one line)
when `path` is not inside `run` or any folder between them is a symlink, which would put the
files somewhere else (a planted `forensics -> /etc` or `step-5 -> ~/.ssh`). `write(path, data)`
writes a file by a fresh temporary name (O_EXCL: never through a link) and a rename (which
replaces a planted link instead of writing through it). A write that fails (a read-only run, a
full disk, a file where a folder should be) is one UserError line naming the path, with nothing
half-written left behind.
"""

from __future__ import annotations

import os
import tempfile

from trainer.errors import UserError


def folder(run: str, path: str, what: str) -> str:
  """Makes `path` (a folder inside `run`) and returns it; UserError when it would leave `run`
  or the folder cannot be made. `what` names the caller in the message ('forensics',
  '--advise', ...)."""
  run, path = os.path.abspath(run), os.path.abspath(path)
  relative = os.path.relpath(path, run)
  if relative == os.pardir or relative.startswith(os.pardir + os.sep):
    raise UserError(f'{what}: {path} is not inside the run folder {run}; nothing written')
  try:
    os.makedirs(run, exist_ok=True)  # where the run is may be a link: the user's choice
  except OSError as e:
    raise UserError(
      f'{what}: cannot write {path} ({e.strerror} at {run}); pass --workdir=<a '
      'folder you can write>'
    ) from None
  current = run
  for part in [p for p in relative.split(os.sep) if p not in ('', os.curdir)]:
    current = os.path.join(current, part)
    if os.path.islink(current):
      raise UserError(
        f'{what}: {current} is a symlink; diagnostics never write through a '
        'link out of the run folder: remove it (or use another --workdir); '
        'nothing written'
      )
    try:
      os.mkdir(current)
    except FileExistsError:
      if not os.path.isdir(current) or os.path.islink(current):
        raise UserError(
          f'{what}: {current} is not a folder; move it out of the run folder '
          '(or use another --workdir); nothing written'
        ) from None
    except OSError as e:
      raise UserError(
        f'{what}: cannot write {current} ({e.strerror}); the run folder is '
        'read-only or full: pass --workdir=<a folder you can write>'
      ) from None
  return path


def temporary(path: str) -> tuple[int, str]:
  """(fd, name) of a new file next to `path` (O_EXCL, never through a link) with the mode a
  plain open() would give it: mkstemp's 0600 would make the records unreadable to the group
  that reads the run's checkpoints (written under the umask)."""
  fd, tmp = tempfile.mkstemp(
    prefix=f'.{os.path.basename(path)}-', suffix='.tmp', dir=os.path.dirname(path)
  )
  os.fchmod(fd, 0o666 & ~_umask())
  return fd, tmp


def _umask() -> int:
  """This process's umask, read without setting it (os.umask sets it for every thread)."""
  try:
    with open('/proc/self/status') as f:
      return next(int(l.split()[1], 8) for l in f if l.startswith('Umask:'))
  except (OSError, StopIteration, ValueError):
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write(path: str, data: bytes | str, what: str) -> None:
  """Writes `path` atomically, never through a symlink (the module docstring)."""
  if isinstance(data, str):
    data = data.encode()
  tmp = None
  try:
    fd, tmp = temporary(path)
    with os.fdopen(fd, 'wb') as f:
      f.write(data)
    if os.path.isdir(path) and not os.path.islink(path):
      raise IsADirectoryError(21, 'a folder is in the way', path)
    os.replace(tmp, path)
  except BaseException as e:
    if tmp and os.path.lexists(tmp):
      os.remove(tmp)
    if isinstance(e, OSError):
      raise UserError(
        f'{what}: cannot write {path} ({e.strerror}); pass --workdir=<a folder '
        'you can write>; nothing half-written is left'
      ) from None
    raise
