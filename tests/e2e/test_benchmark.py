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
  on such a CPU, so their contenders took most of this test's time when it ran them)."""
  check_quick_benchmark(tmp_path, 'mnist_mlp', ['float32'])


@pytest.mark.slow  # mixed_float16's contenders are emulated on a CPU without AVX512_FP16
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
