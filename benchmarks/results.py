"""The results pages under docs/results/: what a benchmark measured, under a header that says how
(the command, as run from the repository root: no absolute path), on what code (the commit), on
what machine (CPU, cores, TensorFlow and Keras) and under what load (the 1-minute load average at
the start and the end, and the CPU time other processes used meanwhile). The guides state the
method and link to these pages; a new run of a benchmark rewrites its page (or its section of a
page of sections), so the numbers the docs show are the ones a command produced.

  started = results.start()               # first thing in main(): the load and CPU counters
  ...
  results.write('references', body_markdown, started=started, quick=_QUICK.value)

`--results_dir` (default docs/results; '' writes nothing) chooses the folder; a quick (smoke)
run writes a page only when `--results_dir` is given, so tests never overwrite the docs.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time

from absl import flags

from trainer import onednn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DIR = os.path.join(ROOT, 'docs', 'results')
MARK = '<!-- written by benchmarks/results.py -->'

RESULTS_DIR = flags.DEFINE_string(
  'results_dir',
  DEFAULT_DIR,
  "Folder of this run's results page; '' = none (a quick run: unless given).",
)
RESULTS_NAME = flags.DEFINE_string(
  'results_name', '', "The results page's name (or its section's), to keep another run's page."
)


@dataclasses.dataclass(frozen=True)
class Start:
  """What the machine looked like when the measurement began."""

  wall: float  # time.time()
  load: float  # 1-minute load average
  busy: float | None  # CPU-seconds all processes had used (/proc/stat), None where unreadable
  own: float  # CPU-seconds of this process and its waited-for children


def _own_cpu() -> float:
  usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
  return sum(u.ru_utime + u.ru_stime for u in usage)


def _busy_cpu() -> float | None:
  """CPU-seconds every process on the machine has used since boot: /proc/stat's first line minus
  its idle and iowait columns (guest time is already counted in user)."""
  try:
    with open('/proc/stat') as f:
      fields = [int(x) for x in f.readline().split()[1:9]]
  except (OSError, ValueError):
    return None
  user, nice, system, idle, iowait, irq, softirq, steal = fields
  return (user + nice + system + irq + softirq + steal) / os.sysconf('SC_CLK_TCK')


def start() -> Start:
  return Start(time.time(), os.getloadavg()[0], _busy_cpu(), _own_cpu())


def machine() -> dict:
  """CPU model, cores, the CPU flags that matter for 16-bit math, and the library versions (read
  from the installed packages: nothing is imported)."""
  cpu, cpu_flags = platform.processor() or 'unknown', set()
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          cpu = line.split(':', 1)[1].strip()
        elif line.startswith('flags'):
          cpu_flags = set(line.split(':', 1)[1].split())
  except OSError:
    pass

  def version(package: str) -> str:
    try:
      return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      return 'not installed'

  wanted = {'avx2', 'avx512f', 'avx512_bf16', 'avx512_fp16', 'amx_bf16', 'f16c'}
  out = dict(cpu=cpu, cores=os.cpu_count(), cpu_flags=sorted(cpu_flags & wanted))
  return dict(
    out, tensorflow=version('tensorflow'), keras=version('keras'), python=platform.python_version()
  )


def commit(root: str = ROOT) -> str:
  """The checked-out commit, and whether files other than the results pages differ from it."""
  git = lambda *a: (
    subprocess.run(['git', *a], cwd=root, capture_output=True, text=True, check=False).stdout
  )
  head = git('rev-parse', '--short', 'HEAD').strip()
  if not head:
    return 'unknown (not a git checkout)'
  # Not stripped: a porcelain line is 'XY path', and X is a space for a change not staged.
  changed = [
    line
    for line in git('status', '--porcelain', '--untracked-files=no').splitlines()
    if not line[3:].startswith('docs/results/')
  ]
  return f'`{head}`' + (f', with {len(changed)} changed file(s) not committed' if changed else '')


# Flags that only say where a run's outputs go: a page's command leaves them out.
OUTPUT_FLAGS = ('--out', '--results_dir', '--workdir', '--json_out')


def command() -> str:
  """This process's command line as run from the repository root (`python -m benchmarks.<name>
  ...` for a benchmark), without its output folders."""
  script = os.path.abspath(sys.argv[0])
  if os.path.dirname(script) == os.path.join(ROOT, 'benchmarks'):
    head = ['python', '-m', 'benchmarks.' + os.path.splitext(os.path.basename(script))[0]]
  else:
    head = ['python', os.path.relpath(script, ROOT)]
  env = onednn.user_setting()  # the one variable this project's kernels depend on
  head = ([f'{onednn.ENV}={shlex.quote(env)}'] if env is not None else []) + head
  args = [a for a in sys.argv[1:] if a.split('=', 1)[0] not in OUTPUT_FLAGS]
  return ' '.join(head + [shlex.quote(a) for a in args])


def no_machine_paths(text: str) -> str:
  """`text` with this machine's paths relative to the repository root, where commands run, and a
  temporary or home folder named so: a page says how to repeat a run, not where files were."""
  places = ((ROOT, '.'), (os.path.dirname(ROOT), '..'), (tempfile.gettempdir(), '$TMPDIR'))
  for path, name in (*places, (os.path.expanduser('~'), '~')):
    text = re.sub(re.escape(path) + r'(?=/|\b|$)', lambda _: name, text)
  return re.sub(r'(?<![\w~.])\./', '', text)  # ./benchmarks/x -> benchmarks/x


def load_line(started: Start | None, ended: Start) -> str:
  """The load during the run: the 1-minute load average at both ends and the CPU time the
  machine's other processes used, the part of the measurement's conditions numbers can carry."""
  if started is None:
    return f'1-minute load average {ended.load:.2f} at the end (the start was not recorded)'
  text = f'1-minute load average {started.load:.2f} at the start, {ended.load:.2f} at the end'
  if started.busy is not None and ended.busy is not None:
    wall = max(ended.wall - started.wall, 1e-9)
    others = max(0.0, (ended.busy - started.busy) - (ended.own - started.own))
    share = others / (wall * (os.cpu_count() or 1))
    text += (
      f'; other processes used {others:.0f} CPU-s of the {wall:.0f} s '
      f'({share:.0%} of the machine): ' + ('it ran alone' if share < 0.05 else 'it was shared')
    )
  return text


def header(command_line: str, started: Start | None, ended: Start) -> str:
  m = machine()
  when = datetime.datetime.fromtimestamp(ended.wall, datetime.timezone.utc)
  rows = [
    ('command', f'`{command_line}`'),
    ('commit', commit()),
    ('recorded', when.strftime('%Y-%m-%d %H:%M UTC')),
    (
      'machine',
      f'{m["cpu"]}, {m["cores"]} cores ({", ".join(m["cpu_flags"]) or "no 16-bit flags"}); '
      f'TensorFlow {m["tensorflow"]}, Keras {m["keras"]}, Python {m["python"]}',
    ),
    ('load', load_line(started, ended)),
  ]
  if 'tensorflow' in sys.modules:  # this process ran TensorFlow: which matmul kernels it had
    kernels = 'on' if onednn.enabled() else 'off'
    rows.insert(4, ('kernels', f"TensorFlow's oneDNN kernels {kernels}"))
  return '\n'.join(['| | |', '|---|---|'] + [f'| {k} | {v} |' for k, v in rows])


SECTION = '<!-- section: '  # a page of sections: each starts with this mark and its name


def page_text(name, command_line, body, started, section=None, old=''):
  """The whole page: title, header, the benchmark's own markdown (its title line dropped); with
  `section`, the page `old` (or a new one) with the section of that name (its heading, header
  and body) replaced, or added at its end."""
  body = body.strip('\n')
  if body.startswith('# '):
    body = body.split('\n', 1)[1].lstrip('\n') if '\n' in body else ''
  run = f'{header(command_line, started, start())}\n\n{body}\n'
  if section is None:
    return (
      f'# Results: {name}\n\n{MARK}\n\n'
      f'Written by the run below; running its command again rewrites this page.\n\n{run}'
    )
  old = old or (
    f'# Results: {name}\n\n{MARK}\n\nOne section per run, each under its own header; running '
    "a section's command again rewrites that section.\n"
  )
  parts = re.split(f'(?={re.escape(SECTION)})', old.rstrip('\n') + '\n')
  new = f'{SECTION}{section} -->\n\n## {section}\n\n{run}'
  same = [i for i, p in enumerate(parts) if p.startswith(f'{SECTION}{section} -->')]
  if same:
    parts[same[0]] = new
  else:
    parts.append(new)
  return '\n'.join(p.rstrip('\n') + '\n' for p in parts)


def target_dir(quick: bool) -> str:
  """Where a run writes its page: '' for none; a quick run only where asked explicitly."""
  if not flags.FLAGS.is_parsed():
    return '' if quick else DEFAULT_DIR
  if quick and not flags.FLAGS['results_dir'].present:
    return ''
  return RESULTS_DIR.value


def write(
  name: str,
  body: str,
  *,
  started: Start | None = None,
  command_line: str | None = None,
  quick: bool = False,
  results_dir: str | None = None,
  section: str | None = None,
) -> str | None:
  """Writes docs/results/<name>.md (or <results_dir>/<name>.md), or only its section `section`
  (--results_name names the page, or the section); returns its path, or None when this run
  writes no page."""
  folder = target_dir(quick) if results_dir is None else results_dir
  if not folder:
    return None
  if flags.FLAGS.is_parsed() and RESULTS_NAME.value:
    name, section = (name, RESULTS_NAME.value) if section else (RESULTS_NAME.value, None)
  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, f'{name}.md')
  old = ''
  if section and os.path.exists(path):
    with open(path) as f:
      old = f.read()
  text = no_machine_paths(page_text(name, command_line or command(), body, started, section, old))
  with open(path + '.tmp', 'w') as f:
    f.write(text)
  os.replace(path + '.tmp', path)
  print(f'results page: {path}', file=sys.stderr, flush=True)
  return path


def report(out: str, stem: str, text: str, results: list, *, page: str, **write_args) -> None:
  """Prints the markdown `text` and writes it as the results page `page` (`write_args`: those of
  `write`); with `out`, also as <out>/<stem>.md, and `results` as <out>/<stem>.json."""
  print(text, flush=True)
  write(page, text, **write_args)
  if out:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f'{stem}.md'), 'w') as f:
      f.write(text + '\n')
    with open(os.path.join(out, f'{stem}.json'), 'w') as f:
      json.dump(results, f, indent=1)


def exit_now() -> None:
  """Ends a benchmark's process with code 0 once everything it reports is printed and written,
  skipping the interpreter's finalization, as launch.py's `exit_now` does: tearing TensorFlow's
  objects down is slow, and a tf.data iterator still read with autotuning on (a pipeline that is
  not a Trainer's: trainer/data/autotune.py) can wait long to be destroyed (docs/references.md,
  "Dropping a tf.data iterator could wait")."""
  from absl import logging

  from trainer.run import lock

  lock.release_all()  # os._exit skips the atexit handler that would
  logging.flush()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)
