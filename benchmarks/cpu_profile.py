"""Where a training process's CPU time went per steady step, from Linux perf's CPU sampler.

`record(path)` is the prefix that runs a command under `perf record -e cpu-clock` (a timer, so
no hardware counters are needed and it works in a virtual machine), time-stamped on the
monotonic clock that `time.perf_counter` reads. `read(path, launched, marks)` then counts the
samples between step 300 and the last step the command reported (`marks`: (step, seconds after
launch) of its step lines, which the caller reads from its output), by library and by function,
as CPU milliseconds per step: each sample stands for 1/HZ of a CPU second. Code generated while
the process runs (XLA's, in ours) has no symbols; perf names its library after the process's map
file, and it is counted as 'JIT code'.
"""

from __future__ import annotations

import collections
import os
import subprocess

HZ = 499  # samples per second per busy CPU


def record(path: str) -> list[str]:
  """The words before a command that run it under perf's cpu-clock sampler, writing `path`."""
  sampler = ['perf', 'record', '-q', '-e', 'cpu-clock', '-F', str(HZ), '--clockid', 'monotonic']
  return [*sampler, '-o', path, '--']


def window(marks: list[tuple[int, float]]) -> tuple[tuple[int, float], tuple[int, float]] | None:
  """((first step, time), (last step, time)) of the steady part of a run, from its step marks
  (step, time) in order: from step 300 (the second mark, in a shorter run) to the last mark, so
  start-up and compilation stay out; None when there are not two such marks."""
  first = next(((s, t) for s, t in marks if s >= 300), marks[1] if len(marks) > 2 else None)
  if first is None or marks[-1][0] <= first[0]:
    return None
  return first, marks[-1]


def tally(script: str, launched: float, steady) -> dict:
  """CPU milliseconds per step, in all and by library and function, of the samples in
  `perf script -F time,ip,sym,dso` output that fall in the `steady` window (times in seconds
  after `launched`, the monotonic time the command started)."""
  (s0, t0), (s1, t1) = steady
  by_lib: collections.Counter = collections.Counter()
  by_fn: collections.Counter = collections.Counter()
  for line in script.splitlines():  # '  30688.768525:  7fd36eab29d5 ynn::dot_fp32 (/x/lib.so)'
    when, _, rest = line.partition(':')
    try:
      t = float(when) - launched
    except ValueError:
      continue
    if not t0 <= t < t1:
      continue
    fn, _, lib = rest.split(maxsplit=1)[1].rpartition(' (')
    lib = os.path.basename(lib.rstrip(')'))
    lib = 'JIT code' if lib.startswith('perf-') else lib
    by_lib[lib] += 1
    by_fn[fn[:80] if fn != '[unknown]' else f'[{lib}]'] += 1  # templates share long prefixes
  ms = 1000 / HZ / (s1 - s0)  # one sample's CPU milliseconds, per step
  return {
    'steps': f'{s0}-{s1}',
    'cpu_ms_per_step': sum(by_lib.values()) * ms,
    'by_library': {k: round(v * ms, 2) for k, v in by_lib.most_common(6)},
    'by_function': {k: round(v * ms, 2) for k, v in by_fn.most_common(8)},
  }


def read(path: str, launched: float, marks: list[tuple[int, float]]) -> dict | None:
  """`tally` of the samples perf wrote to `path`, over the steady window of `marks`."""
  steady = window(marks)
  if steady is None:
    return None
  script = ['perf', 'script', '-i', path, '-F', 'time,ip,sym,dso']
  return tally(subprocess.run(script, capture_output=True, text=True).stdout, launched, steady)
