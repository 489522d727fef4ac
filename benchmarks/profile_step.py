"""Where a train step's time goes: a tf.profiler trace of our compiled loop (and of Keras fit),
summed per op type and per layer.

  python benchmarks/profile_step.py --model=transformer_lm --policy=mixed_bfloat16
  python benchmarks/profile_step.py --model=mnist_cnn --policy=mixed_bfloat16 --vs_fit

After a warm-up, `--steps` timed steps are traced with `tf.profiler.experimental` into
`--profile_out/<contender>` (open it in TensorBoard's Profile tab for the timeline); fit's trace
also holds its first execution, which fit's timing leaves out, and the op figures are per step
of the trace (the wall time per timed step). The summary reads the
trace's XSpace: every TensorFlow op the executor ran on the host's compute threads, with its
duration. "op ms" sums those durations over both threads, so it exceeds the wall time when ops
run side by side (and two ops sharing two cores each run slower than alone); the shares are
shares of that sum. Rows:
  * by op type (MatMul, Conv2DBackpropFilter, Cast, Mul, ResourceApplyAdam, ...);
  * by layer: the Keras layer in the op's name scope with block numbers folded
    (block0_mlp_in and block3_mlp_in are 'block#_mlp_in'), forward and backward ('gradient_tape')
    apart; ops outside any layer are the step's own (loss, loss scaling, checks, optimizer).
A diagnostic, not a test.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from absl import app, flags, logging  # noqa: E402

from benchmarks import results as results_page  # noqa: E402  (--results_dir)

from benchmarks import run as bench_run  # noqa: E402  (its flags: --data_root, --data_dir)

_MODEL = flags.DEFINE_string('model', 'mnist_cnn', 'Module in models/.')
_POLICY = flags.DEFINE_string('policy', 'mixed_bfloat16', 'Precision policy.')
_SPL = flags.DEFINE_integer(
  'steps_per_loop',
  None,
  'Steps per compiled call (default: 10, or 1 for the models benchmarks/run.py runs at 1).',
)
_STEPS = flags.DEFINE_integer(
  'steps',
  None,
  'Steps timed (default: 4 compiled calls); fit '
  'also traces its first execution, which it does not time.',
)
_VS_FIT = flags.DEFINE_bool('vs_fit', False, "Also trace Keras fit (Keras's own optimizer).")
_TOP = flags.DEFINE_integer('top', 15, 'Rows per table.')
_PROFILE_OUT = flags.DEFINE_string('profile_out', '/tmp/profile_step', 'Trace folder.')


def op_times(logdir: str, steps: int) -> tuple[dict[str, float], int]:
  """{op name 'scope/name:Type': milliseconds per step} and the op count per step, from the
  newest trace under `logdir`."""
  from tensorflow.tsl.profiler.protobuf import xplane_pb2

  path = max(
    glob.glob(os.path.join(logdir, '**', '*.xplane.pb'), recursive=True), key=os.path.getmtime
  )
  space = xplane_pb2.XSpace()
  with open(path, 'rb') as f:
    space.ParseFromString(f.read())
  times, count = collections.Counter(), 0
  for plane in space.planes:
    for line in plane.lines:
      if not line.name.startswith('tf_Compute'):  # the executor's threads
        continue
      for event in line.events:
        name = plane.event_metadata[event.metadata_id].name
        if ':' not in name or name.startswith(('Executor', 'ThreadpoolListener')):
          continue  # envelopes and markers, not ops
        times[name] += event.duration_ps / 1e9 / steps
        count += 1
  return dict(times), count // steps


def layer_of(op_name: str, model_name: str) -> str:
  scope = op_name.rsplit(':', 1)[0]
  side = 'backward' if 'gradient_tape' in scope else 'forward'
  parts = scope.split('/')
  for i, part in enumerate(parts):
    if re.fullmatch(re.escape(model_name) + r'(_\d+)?', part) and i + 1 < len(parts):
      layer = re.sub(r'_\d+$', '', parts[i + 1])  # Keras's call-count suffix
      layer = re.sub(r'\d+', '#', layer)
      return f'{layer} ({side})'
  return 'the step itself (loss, scaling, checks, update)'


def table(title: str, rows: dict[str, float], total: float, top: int) -> list[str]:
  lines = [f'{title:52} {"ms/step":>9} {"share":>7}']
  for key, ms in sorted(rows.items(), key=lambda kv: -kv[1])[:top]:
    lines.append(f'  {key[:50]:50} {ms:9.2f} {100 * ms / total:6.1f}%')
  return lines


def summarize(
  label: str, wall_ms: float, times: dict, ops_per_step: int, model_name: str, top: int
) -> str:
  total = sum(times.values())
  by_type, by_layer = collections.Counter(), collections.Counter()
  for name, ms in times.items():
    by_type[name.rsplit(':', 1)[1]] += ms
    by_layer[layer_of(name, model_name)] += ms
  lines = [
    f'== {label}: wall {wall_ms:.1f} ms/step; op time {total:.1f} ms/step over the '
    f'compute threads ({total / wall_ms:.2f}x wall); {ops_per_step} ops/step'
  ]
  lines += table('by op type', by_type, total, top)
  lines += table('by layer', by_layer, total, top)
  return '\n'.join(lines)


def measure_and_print(argv):
  del argv
  logging.set_verbosity(logging.ERROR)
  import models
  import tensorflow as tf
  from benchmarks.contenders import KerasFit, Ours

  name = _MODEL.value
  spl = _SPL.value or bench_run.SLOW_MODELS.get(name, {}).get('steps_per_loop', 10)
  steps = _STEPS.value or 4 * spl
  steps = spl * max(1, steps // spl)
  base = bench_run.model_config(name)
  trainer_class = models.get_trainer_class(name)
  contenders = {
    'ours': Ours(trainer_class, bench_run.variant(base, policy=_POLICY.value, steps_per_loop=spl))
  }
  if _VS_FIT.value:
    contenders['fit'] = KerasFit(
      trainer_class, bench_run.variant(base, policy=_POLICY.value, steps_per_loop=spl, fused=False)
    )
  print(f'{name}, {_POLICY.value}, steps_per_loop={spl}, {steps} steps timed per contender')
  for label, contender in contenders.items():
    contender.timed(spl)  # traces and compiles
    contender.timed(steps)  # warm
    logdir = os.path.join(_PROFILE_OUT.value, label)
    shutil.rmtree(logdir, ignore_errors=True)
    tf.profiler.experimental.start(logdir)
    wall, _ = contender.timed(steps)
    tf.profiler.experimental.stop()
    model_name = (contender.trainer.model if label == 'ours' else contender.model).name
    # The trace holds every step timed() ran, the untimed ones too (fit's first execution): op
    # figures are per traced step, the wall per timed step.
    traced = steps + contender.untimed_steps
    times, ops = op_times(logdir, traced)
    print(
      summarize(
        f'{label} ({traced} steps in the trace {logdir})',
        1000 * wall / steps,
        times,
        ops,
        model_name,
        _TOP.value,
      )
    )
    contender.close()


def main(argv):
  """What it prints is also docs/results/profile_step.md (benchmarks/results.py)."""
  with results_page.recording('profile_step', markdown=False):
    measure_and_print(argv)
  results_page.exit_now()  # the page is written


if __name__ == '__main__':
  app.run(main)
