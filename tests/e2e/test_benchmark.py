"""The benchmark's quick mode runs end to end, so benchmarks/run.py never rots.

It checks that the outputs exist and hold every section for every model with positive numbers;
it makes no claim about speed (those are measured side by side by the full run, not by tests).
"""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT


def run_benchmark(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
  """`python *args` (a benchmark script or `-m module`, then its flags) from the repository
  root, TensorFlow's C++ log quieted; it must succeed (its stderr's tail otherwise)."""
  done = subprocess.run(
    [sys.executable, *args],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=timeout,
    env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'),
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return done


def test_quick_benchmark_writes_tables_json_and_chart(tmp_path):
  """float32 only (with the machine's default policy, float32 on an AVX2-only CPU) on the MLP:
  every contender and every ratio row of the full run, the fewest steps. The loss-scaled
  policies go through the same code in the slow test below (float16 and bfloat16 are emulated
  on such a CPU: their contenders took most of the 9 minutes this test once ran)."""
  check_quick_benchmark(tmp_path, 'mnist_mlp', ['float32'])


@pytest.mark.slow  # ~9 min on the 2-core AVX2 CPU: mixed_float16's contenders are emulated
def test_quick_benchmark_with_a_loss_scaled_policy(tmp_path):
  check_quick_benchmark(tmp_path, 'mnist_cnn', ['float32', 'mixed_float16'])


def check_quick_benchmark(tmp_path, name: str, wanted: list[str]) -> None:
  """Runs `benchmarks/run.py --quick` on model `name` in the policies `wanted`; checks that
  benchmark.json/.md/.png and the results page hold every section, contender and ratio."""
  out = tmp_path / 'bench'
  run_benchmark(
    os.path.join(ROOT, 'benchmarks', 'run.py'),
    '--quick',
    f'--models={name}',
    f'--policies={",".join(wanted)}',
    f'--out={out}',
    f'--results_dir={tmp_path}',
    timeout=900,
  )
  for file in ('benchmark.json', 'benchmark.md', 'benchmark.png'):
    assert (out / file).stat().st_size > 0, file

  results = json.loads((out / 'benchmark.json').read_text())
  machine = results['machine']
  assert machine['cores'] >= 1 and machine['cpu'] and machine['tensorflow']
  assert all(results['peak_flops'][d] > 0 for d in ('float32', 'bfloat16', 'float16'))
  policies = results['settings']['policies']
  assert set(wanted) <= set(policies)
  model = results['models'][name]
  assert model['flops_per_step'] > 0
  assert model['host_ops_in_train_loop'] == []  # nothing a finite step runs calls the host
  assert model['host_ops_on_skipped_steps_only'] == ['PrintV2']  # the skip report, and only it
  rounds = results['settings']['rounds']
  for label, contender in model['contenders'].items():
    assert len(contender['rounds']) == rounds and all(r > 0 for r in contender['rounds']), label
    for clock in ('steps_per_sec', 'steps_per_cpu_sec'):
      stats = contender[clock]
      assert 0 < stats['min'] <= stats['median'] <= stats['max'], (label, clock)
  default = model['default_policy']
  expected = {f'{kind} {p}' for kind in ('ours', 'fit') for p in policies}
  auto = {p: 'dynamic' if p == 'mixed_float16' else 'none' for p in policies}
  expected |= {
    f'ours {p} loss_scale={m}'
    for p in policies
    for m in ('none', 'static', 'dynamic')
    if m != auto[p]
  }
  expected |= {
    f'{kind} {default} steps_per_loop={n}'
    for kind in ('ours', 'fit')
    for n in results['settings']['loop_sweep']
    if n != results['settings']['steps_per_loop']
  }
  expected.add(f'ours {default} jit_compile')
  expected |= {f'ours {default} optimizer.fused=False', f'fit {default} optimizer.fused=True'}
  expected |= {f'fit {default} lso=ours', f'fit {default} lso=keras'}  # issue 36's pair
  assert expected <= set(model['contenders'])
  assert model['fit_lso_ours_over_keras']['median'] > 0
  assert model['jit_speedup']['median'] > 0
  assert all(stats['median'] > 0 for stats in model['fused_optimizer'].values())
  assert set(model['fused_optimizer']) == {
    'ours_unfused_over_fit',
    'ours_over_fit_fused',
    'fit_fused_over_fit',
  }
  for p in policies:
    assert model['ours_over_fit'][p]['median'] > 0
    assert model['cpu_time']['ours_over_fit'][p]['median'] > 0
    assert set(model['loss_scale_overhead_pct'][p]) == {'static', 'dynamic'}
    assert model['speedup_over_float32'][p]['median'] > 0
    assert 0 < model['mfu'][p]['fraction']
    memory = model['memory'][p]
    assert 0 < memory['imported_mib'] <= memory['built_mib'] <= memory['peak_mib']
    assert memory['step_mib'] == memory['peak_mib'] - memory['imported_mib']
  for n in results['settings']['loop_sweep']:
    if n != results['settings']['steps_per_loop']:
      assert model['ours_over_fit'][f'{default} steps_per_loop={n}']['median'] > 0
  assert set(model['memory']) == set(policies)  # no remat rows: these models mark no blocks
  assert (
    set(model['targets_met'])
    == set(model['targets_met_cpu_time'])
    == {'ours_over_fit', 'dynamic_overhead', 'bfloat16_speedup', 'no_host_sync'}
  )

  table = (out / 'benchmark.md').read_text()
  assert machine['cpu'] in table and machine['tensorflow'] in table
  for heading in (
    f'## {name}',
    'Ours vs Keras fit',
    'Where ours / fit comes from',
    "fit with our LossScaleOptimizer / with Keras's",
    'Cost of loss scaling',
    'speed-up, FLOP utilisation, memory',
    'steps_per_loop and jit_compile',
    'Memory of a training step',
  ):
    assert heading in table, heading
  for p in policies:
    assert f'| {p} |' in table
  assert f'## {name}' in results_page(tmp_path, 'run')  # the same tables, as the results page


def results_page(folder, name: str) -> str:
  """The results page a benchmark wrote (benchmarks/results.py), checked for its header."""
  text = (folder / f'{name}.md').read_text()
  for row in ('| command | `python -m benchmarks.', '| commit |', '| machine |', '| load |'):
    assert row in text, (row, text[:800])
  return text


def test_step_ablation_runs_every_contender(tmp_path):
  """benchmarks/ablate_step.py builds its stripped-down steps on the public TrainStep contract;
  one short round of each, on the MLP, so it never rots. No claim about speed. In float32 with
  a dynamic loss scale (the loss-scaled step, at float32's speed: in mixed_float16, emulated on
  an AVX2-only CPU, this test took 192 s on one loaded xdist worker)."""
  done = run_benchmark(
    os.path.join(ROOT, 'benchmarks', 'ablate_step.py'),
    '--model=mnist_mlp',
    '--policy=float32',
    '--loss_scale=dynamic',
    '--rounds=1',
    '--calls=1',
    f'--results_dir={tmp_path}',
  )
  rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()[2:] if line.strip()}
  assert set(rows) == {
    'ours',
    'no_cond',
    'bare',
    'no_forensics',
    'no_guard',
    'no_state_check',
    'fit',
  }, done.stdout
  assert all(float(row[1]) > 0 for row in rows.values())  # steps per second
  assert done.stdout.strip() in results_page(tmp_path, 'ablate_step')  # what it printed


def test_step_ablation_takes_a_config_file_with_xla(tmp_path):
  """--config races a file of configs/ (its model and settings), --jit with XLA on: the header
  names both, and the page records the command."""
  done = run_benchmark(
    os.path.join(ROOT, 'benchmarks', 'ablate_step.py'),
    '--config=mnist_mlp',
    '--jit',
    '--contenders=ours',
    '--rounds=1',
    '--calls=1',
    f'--results_dir={tmp_path}',
  )
  header, _, *rows = done.stdout.strip().splitlines()
  assert header.startswith('mnist_mlp float32 steps_per_loop=10, XLA on, 1 rounds'), header
  assert [row.split()[0] for row in rows] == ['ours', 'fit'], done.stdout
  assert '--config=mnist_mlp --jit' in results_page(tmp_path, 'ablate_step')


def trace_events(folder: str, suffix: str) -> tuple[int, int]:
  """(events whose op name ends with `suffix`, all op events) on the executor's threads of the
  newest tf.profiler trace under `folder`."""
  import glob
  from tensorflow.tsl.profiler.protobuf import xplane_pb2

  path = max(glob.glob(f'{folder}/**/*.xplane.pb', recursive=True), key=os.path.getmtime)
  space = xplane_pb2.XSpace()
  with open(path, 'rb') as f:
    space.ParseFromString(f.read())
  names = [
    plane.event_metadata[event.metadata_id].name
    for plane in space.planes
    for line in plane.lines
    if line.name.startswith('tf_Compute')
    for event in line.events
  ]
  names = [n for n in names if ':' in n and not n.startswith(('Executor', 'ThreadpoolListener'))]
  return sum(n.endswith(suffix) for n in names), len(names)


def test_step_profile_divides_by_the_steps_in_each_trace(tmp_path):
  """benchmarks/profile_step.py --vs_fit: fit's trace holds one execution more than fit times,
  and the per-step op figures divide by the steps in the trace. Reference: the loss kernel,
  once per step in both loops, counted in the trace files."""
  done = run_benchmark(
    os.path.join(ROOT, 'benchmarks', 'profile_step.py'),
    '--model=mnist_mlp',
    '--policy=float32',
    '--vs_fit',
    '--steps_per_loop=2',
    '--steps=4',
    f'--profile_out={tmp_path}',
    f'--results_dir={tmp_path}',
  )
  heads = [line for line in done.stdout.splitlines() if line.startswith('== ')]
  assert len(heads) == 2, done.stdout
  for label, head in zip(('ours', 'fit'), heads):
    traced = int(head.split('(')[1].split()[0])
    losses, events = trace_events(str(tmp_path / label), ':SparseSoftmaxCrossEntropyWithLogits')
    assert losses == traced == {'ours': 4, 'fit': 6}[label], head
    assert int(head.split(' ops/step')[0].rsplit(' ', 1)[1]) == events // traced, head
  assert heads[0] in results_page(tmp_path, 'profile_step')


def test_eager_or_compiled_times_both_ways(tmp_path):
  """benchmarks/eager_or_compiled.py (the figures behind the eager limits of the probe and the
  checkpoint check) reads the two functions through EagerThenCompiled; one config, so it never
  rots. No claim about speed."""
  done = run_benchmark(
    os.path.join(ROOT, 'benchmarks', 'eager_or_compiled.py'),
    '--configs=mnist_mlp:float32',
    '--eager_calls=2',
    f'--results_dir={tmp_path}',
  )
  row = [line for line in done.stdout.splitlines() if line.startswith('| mnist_mlp, float32')]
  assert len(row) == 1, done.stdout
  cells = [c.strip() for c in row[0].strip('|').split('|')]
  times = [float(x) for i in (1, 2, 5, 6) for x in cells[i].split(' / ')]
  assert all(t > 0 for t in times) and int(cells[4]) > 0, row
  assert row[0] in results_page(tmp_path, 'eager_or_compiled')  # the parent's page, no child's
  assert os.listdir(tmp_path) == ['eager_or_compiled.md']


def test_grappler_benchmark_times_both_settings(tmp_path):
  """benchmarks/grappler.py (the figures behind train.grappler='auto') runs each setting in a
  process of its own; its off / on column is the ratio of the medians of the runs it lists. No
  claim about speed."""
  done = run_benchmark(
    '-m',
    'benchmarks.grappler',
    '--configs=mnist_mlp:float32:20',
    '--rounds=2',
    f'--results_dir={tmp_path}',
  )
  rows = [line for line in done.stdout.splitlines() if line.startswith('| mnist_mlp, float32')]
  cells = {r.split('|')[2].strip(): [c.strip() for c in r.strip('|').split('|')] for r in rows}
  assert sorted(cells) == ['false', 'true'], done.stdout
  runs = {g: [[float(x) for x in c[i].split(', ')] for i in (2, 3, 4, 5)] for g, c in cells.items()}
  assert all(len(v) == 2 and min(v) > 0 for g in runs for v in runs[g]), runs

  def median(values):
    return sum(values) / 2  # two rounds

  ratios = [float(x) for x in cells['false'][6].split(', ')]
  assert len(ratios) == 4, cells['false']
  for ratio, off, on in zip(ratios, runs['false'], runs['true']):
    # the figures have three significant digits, the ratio two decimals
    assert ratio == pytest.approx(median(off) / median(on), rel=0.011, abs=0.006), (off, on)
  assert rows[0] in results_page(tmp_path, 'grappler')
  assert os.listdir(tmp_path) == ['grappler.md']


def test_memory_breakdown_setting_and_table():
  from benchmarks import memory

  assert memory._parse_setting(
    'bf16 sr:mixed_bfloat16,precision.master_weights=bfloat16_sr,train.remat=true'
  ) == (
    'bf16 sr',
    'mixed_bfloat16',
    True,
    ['precision.master_weights=bfloat16_sr', 'train.remat=true'],
  )
  rows = [
    {'label': 'a', 'bytes_per_param': 12.0, 'step_mib': 200.0, 'kept_mib': 100.0},
    {'label': 'b', 'bytes_per_param': 4.0, 'step_mib': 120.0, 'kept_mib': 50.0},
  ]
  table = memory.markdown(rows).splitlines()
  assert table[0].startswith('| setting | bytes/param |')
  assert table[3].startswith('| b | 4.0 |')
  assert '120 (0.60x)' in table[3] and '50 (0.50x)' in table[3]


def test_training_runs_tabulates_a_launch_run(tmp_path):
  """benchmarks/training_runs.py (the runs behind docs/results.md) on one short run: its final
  eval line and times reach the results page. No claim about accuracy or speed."""
  run_benchmark(
    '-m',
    'benchmarks.training_runs',
    '--runs=mnist_mlp',
    '--set=train.steps=10',
    f'--results_dir={tmp_path}',
  )
  page = results_page(tmp_path, 'training_runs')
  [row] = [line for line in page.splitlines() if line.startswith('| mnist_mlp |')]
  cells = [c.strip() for c in row.strip('|').split('|')]
  assert cells[1] == '`python launch.py --config=configs/mnist_mlp.py --config.train.steps=10`'
  assert cells[2].startswith('loss ') and ', accuracy ' in cells[2], row
  assert float(cells[3]) > 0 and float(cells[4]) > 0, row


def test_cpu_profile_counts_the_steady_samples_per_step():
  """benchmarks/cpu_profile.py (peer_nanogpt --perf): the samples between step 300 and the last
  step mark, each 1/HZ CPU-seconds, per step; recounted here from the samples given."""
  from benchmarks import cpu_profile

  marks = [(0, 1.0), (100, 8.0), (300, 10.0), (500, 20.0)]  # (step, seconds after launch)
  assert cpu_profile.window(marks) == ((300, 10.0), (500, 20.0))
  launched = 1000.0
  samples = [  # (seconds after launch, symbol, library)
    *[(9.9, 'startup', '/x/libtf.so')] * 7,  # before the window
    *[(10.0 + i / 100, 'ynn::dot_fp32', '/x/libtf.so') for i in range(600)],
    *[(12.0 + i / 100, '[unknown]', '/tmp/perf-42.map') for i in range(300)],
    *[(15.0, 'T<' + 'a' * 90 + '>::run', '/x/libtf.so')] * 2,  # two names, one 80-char prefix
    *[(15.0, 'T<' + 'a' * 90 + '>::wait', '/x/libtf.so')] * 3,
    *[(20.0, 'teardown', '/x/libtf.so')] * 5,  # at the last line: after the window
  ]
  script = '\n'.join(f'  {launched + t:.6f}:  7fd3 {fn} ({lib})' for t, fn, lib in samples)
  got = cpu_profile.tally(script, launched, cpu_profile.window(marks))
  per_step = lambda n: n * (1000 / cpu_profile.HZ) / 200  # noqa: E731  (ms per sample / steps)
  assert got['steps'] == '300-500'
  assert got['cpu_ms_per_step'] == pytest.approx(per_step(600 + 300 + 5))
  assert got['by_library'] == {
    'libtf.so': round(per_step(605), 2),
    'JIT code': round(per_step(300), 2),
  }
  assert got['by_function'] == {
    'ynn::dot_fp32': round(per_step(600), 2),
    '[JIT code]': round(per_step(300), 2),
    ('T<' + 'a' * 90)[:80]: round(per_step(5), 2),
  }
  assert cpu_profile.window(marks[:2]) is None  # no steady part to count
  assert cpu_profile.window([(0, 1.0), (100, 2.0), (200, 3.0)]) == ((100, 2.0), (200, 3.0))


def test_cpu_profile_reads_what_perf_sampled(tmp_path):
  """record + read on a real process (where perf can sample): 100 'steps' of a busy loop that
  uses 0.6 CPU-seconds come out at about 6 CPU-ms per step, most in Python's own library: perf's
  time stamps and the lines' line up."""
  import shutil
  import time

  from benchmarks import cpu_profile

  if shutil.which('perf') is None:
    pytest.skip('perf is not installed')
  busy = (
    'import time\n'
    'def spin(s):\n'  # CPU time, not wall: beside other tests the loop gets less of a core
    '  t = time.process_time()\n'
    '  while time.process_time() - t < s:\n'
    '    for _ in range(10000): pass\n'
    "spin(0.3); print('iter 300: ', flush=True); spin(0.6); print('iter 400: ', flush=True)"
  )
  path = str(tmp_path / 'perf.data')
  launched = time.perf_counter()
  proc = subprocess.Popen(
    [*cpu_profile.record(path), sys.executable, '-c', busy], stdout=subprocess.PIPE, text=True
  )
  lines = [(time.perf_counter() - launched, line.rstrip('\n')) for line in proc.stdout]
  if proc.wait() or not os.path.exists(path):
    pytest.skip('perf may not sample here (kernel.perf_event_paranoid)')
  marks = [(int(text.split()[1].rstrip(':')), t) for t, text in lines if text.startswith('iter')]
  got = cpu_profile.read(path, launched, marks)
  assert got['steps'] == '300-400'
  assert 4.0 < got['cpu_ms_per_step'] < 7.0, got  # 600 ms over 100 steps; sampling loses a few
  lib, ms = next(iter(got['by_library'].items()))
  assert lib.startswith('libpython') or lib == os.path.basename(sys.executable), got
  assert ms > 0.5 * got['cpu_ms_per_step'], got
