"""Writes the benchmark's results as benchmark.json, benchmark.md (tables) and benchmark.png."""

from __future__ import annotations

import json
import os

# The targets (medians): name -> (description, check on a model's results).
TARGETS = {
  'ours_over_fit': 'ours / Keras fit >= 1.10 in every policy',
  'dynamic_overhead': 'dynamic loss scaling <= 2 % over none, in every policy',
  'bfloat16_speedup': 'mixed_bfloat16 >= 1.5x float32 with our trainer',
  'no_host_sync': 'no host-callback op on a finite step inside the compiled train loop',
}


def targets(model: dict, policies) -> dict[str, bool]:
  """Judged on wall-clock medians (`model`), or per CPU second (pass `model['cpu_time']`
  merged over `model`)."""
  return {
    'ours_over_fit': all(model['ours_over_fit'][p]['median'] >= 1.10 for p in policies),
    'dynamic_overhead': all(
      model['loss_scale_overhead_pct'][p]['dynamic']['median'] <= 2.0 for p in policies
    ),
    'bfloat16_speedup': (
      'mixed_bfloat16' in policies
      and model['speedup_over_float32']['mixed_bfloat16']['median'] >= 1.5
    ),
    'no_host_sync': not model['host_ops_in_train_loop'],
  }


def _yes(ok: bool) -> str:
  return 'yes' if ok else 'no'


def _r(stat: dict, fmt: str = '{:.1f}') -> str:
  """median (min-max) of a `run.summary`."""
  return f'{fmt.format(stat["median"])} ({fmt.format(stat["min"])}-{fmt.format(stat["max"])})'


def _x(stat: dict) -> str:
  return _r(stat, '{:.2f}')


def _pct(stat: dict) -> str:
  return f'{stat["median"]:+.1f} % ({stat["min"]:+.1f} to {stat["max"]:+.1f})'


def markdown(results: dict) -> str:
  m, s = results['machine'], results['settings']
  peaks = results['peak_flops']
  lines = [
    '# Benchmark results',
    '',
    f'Machine: {m["cpu"]}, {m["cores"]} cores ({", ".join(m["cpu_flags"])}); TensorFlow '
    f'{m["tensorflow"]}, Keras {m["keras"]}, Python {m["python"]}; load average at start '
    f'{", ".join(f"{x:.2f}" for x in m["load_average_at_start"])}.',
    f'Mode: {"quick (numbers mean little)" if s["quick"] else "full"}; {s["rounds"]} '
    f'interleaved rounds of ~{s["round_seconds"]} s per contender; wall time '
    f'{results["wall_seconds"]:.0f} s.',
    'Cells: median (min-max) over rounds; ratios and overheads are medians of per-round '
    'pairs. "wall" = steps per wall-clock second; "CPU" = steps per CPU-second of this process '
    '(user + system, all threads), which other processes on a shared machine barely move.',
    'Matmul peak (GFLOP/s): ' + ', '.join(f'{k} {v / 1e9:.1f}' for k, v in peaks.items()) + '.',
  ]
  policies = s['policies']
  for name, r in results['models'].items():
    c = r['contenders']
    sps = lambda label: _r(c[label]['steps_per_sec'])
    both = lambda key, sub: f'{_x(r[key][sub])} | {_x(r["cpu_time"][key][sub])}'  # wall, CPU
    spl = r['steps_per_loop']
    lines += [
      '',
      f'## {name} (global batch {r["batch_size"]}, {r["flops_per_step"] / 1e9:.2f} GFLOP per step)',
      '',
      f'### Ours vs Keras fit (steps_per_loop = steps_per_execution = {spl})',
      '',
      '| policy | ours steps/s | fit steps/s | ours / fit (wall) | ours / fit (CPU) '
      '| target >= 1.10 (wall, CPU) |',
      '|---|---|---|---|---|---|',
    ]
    for p in policies:
      ratio, cpu_ratio = r['ours_over_fit'][p], r['cpu_time']['ours_over_fit'][p]
      lines.append(
        f'| {p} | {sps(f"ours {p}")} | {sps(f"fit {p}")} | {both("ours_over_fit", p)} '
        f'| {_yes(ratio["median"] >= 1.10)}, {_yes(cpu_ratio["median"] >= 1.10)} |'
      )
    d = r['default_policy']
    lines += [
      '',
      f'### Where ours / fit comes from ({d})',
      '',
      'Our trainer uses a fused optimizer update (optimizer.fused=True, '
      "trainer/optim/fused_optimizers.py); fit above uses Keras's own. Swapping them:",
      '',
      '| pair | steps/s | ratio (wall) | ratio (CPU) |',
      '|---|---|---|---|',
      f"| ours with Keras's update / fit | {sps(f'ours {d} optimizer.fused=False')} | "
      f'{both("fused_optimizer", "ours_unfused_over_fit")} |',
      f'| fit with our update / fit | {sps(f"fit {d} optimizer.fused=True")} | '
      f'{both("fused_optimizer", "fit_fused_over_fit")} |',
      f'| ours / fit with our update | | {both("fused_optimizer", "ours_over_fit_fused")} |',
    ]
    lso, cpu_lso = r['fit_lso_ours_over_keras'], r['cpu_time']['fit_lso_ours_over_keras']
    lines += [
      '',
      f"### fit with our LossScaleOptimizer / with Keras's ({d})",
      '',
      '| pair | ours steps/s | Keras steps/s | ratio (wall) | ratio (CPU) | target >= 0.95 |',
      '|---|---|---|---|---|---|',
      f'| fit lso=ours / lso=keras | {sps(f"fit {d} lso=ours")} | {sps(f"fit {d} lso=keras")} '
      f'| {_x(lso)} | {_x(cpu_lso)} | {_yes(lso["median"] >= 0.95)} |',
    ]
    lines += [
      '',
      '### Cost of loss scaling (ours; overhead = none / mode - 1)',
      '',
      '| policy | none steps/s | static steps/s | dynamic steps/s | static overhead '
      '| dynamic overhead | dynamic overhead (CPU) | target <= 2 % (wall, CPU) |',
      '|---|---|---|---|---|---|---|---|',
    ]
    for p in policies:
      auto = 'dynamic' if p == 'mixed_float16' else 'none'
      label = lambda mode: f'ours {p}' if mode == auto else f'ours {p} loss_scale={mode}'
      o, cpu_o = r['loss_scale_overhead_pct'][p], r['cpu_time']['loss_scale_overhead_pct'][p]
      lines.append(
        f'| {p} | {sps(label("none"))} | {sps(label("static"))} | '
        f'{sps(label("dynamic"))} | {_pct(o["static"])} | {_pct(o["dynamic"])} | '
        f'{_pct(cpu_o["dynamic"])} | {_yes(o["dynamic"]["median"] <= 2.0)}, '
        f'{_yes(cpu_o["dynamic"]["median"] <= 2.0)} |'
      )
    lines += [
      '',
      '### Policies with our trainer: speed-up, FLOP utilisation, memory',
      '',
      '| policy | steps/s | x float32 (wall) | x float32 (CPU) | GFLOP/s | MFU (of matmul '
      'peak) | peak RSS MiB (after build) |',
      '|---|---|---|---|---|---|---|',
    ]
    for p in policies:
      mfu, mem = r['mfu'][p], r.get('memory', {}).get(p)
      mem_text = f'{mem["peak_mib"]:.0f} ({mem["built_mib"]:.0f})' if mem else 'n/a'
      lines.append(
        f'| {p} | {sps(f"ours {p}")} | {both("speedup_over_float32", p)} '
        f'| {mfu["flops_per_sec"] / 1e9:.1f} | {100 * mfu["fraction"]:.1f} % of '
        f'{mfu["of_peak_dtype"]} | {mem_text} |'
      )
    mem = r.get('memory', {})
    if mem:
      lines += [
        '',
        '### Memory of a training step (peak RSS, MiB, a subprocess per setting)',
        '',
        'step = peak after training - peak after importing TF and the project (what '
        'building and training need); build = peak after building - after the imports.',
        '',
        '| setting | step MiB | build MiB | x float32 |',
        '|---|---|---|---|',
      ]
      base = mem.get('float32', {}).get('step_mib')
      for key, m in mem.items():
        if 'step_mib' in m:
          ratio = f'{m["step_mib"] / base:.2f}' if base else ''
          lines.append(
            f'| {key} | {m["step_mib"]:.0f} | {m["built_mib"] - m["imported_mib"]:.0f} | {ratio} |'
          )
    lines += [
      '',
      f'### steps_per_loop and jit_compile ({d}, the default policy here)',
      '',
      '| setting | ours steps/s | fit steps/s | ours / fit (wall) | ours / fit (CPU) |',
      '|---|---|---|---|---|',
    ]
    for key in r['ours_over_fit']:
      if key in policies and key != d:
        continue
      n = spl if key in policies else int(key.rsplit('=', 1)[1])
      suffix = '' if key in policies else f' steps_per_loop={n}'
      lines.append(
        f'| steps_per_loop={n} | {sps(f"ours {d}{suffix}")} | {sps(f"fit {d}{suffix}")} '
        f'| {both("ours_over_fit", key)} |'
      )
    lines.append(
      f'| steps_per_loop={spl}, jit_compile=True | {sps(f"ours {d} jit_compile")} '
      f'| | x{_x(r["jit_speedup"])} vs no jit '
      f'| x{_x(r["cpu_time"]["jit_speedup"])} vs no jit |'
    )
    met, cpu_met = r['targets_met'], r['targets_met_cpu_time']
    lines += ['', '### Targets (wall clock; per CPU second)', '']
    lines += [f'- {_yes(met[k])}; {_yes(cpu_met[k])}: {text}' for k, text in TARGETS.items()]
    if r['host_ops_in_train_loop']:
      lines.append(f'  host ops found: {", ".join(r["host_ops_in_train_loop"])}')
    if r.get('host_ops_on_skipped_steps_only'):
      lines.append(
        "  on the skip branch only (the skipped step's report line; a finite step "
        f'never runs it): {", ".join(r["host_ops_on_skipped_steps_only"])}'
      )
  lines += [
    '',
    'FLOPs per step: forward + loss + gradients of one global batch, traced from the '
    "model's compute_loss and counted by tf.compat.v1.profiler (float_operation); the "
    'optimizer update is not counted. MFU = FLOPs/step x steps/s / matmul peak of the '
    "policy's compute dtype, measured in the same process.",
    '',
  ]
  return '\n'.join(lines)


def chart(results: dict, path: str) -> None:
  """steps/s of every contender (median, min-max over rounds), one panel per model."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  models = results['models']
  rows = max(len(r['contenders']) for r in models.values()) * len(models)
  fig, axes = plt.subplots(len(models), 1, figsize=(11, 0.32 * rows + 1.5), squeeze=False)
  for ax, (name, r) in zip(axes[:, 0], models.items()):
    labels, stats = list(r['contenders']), [c['steps_per_sec'] for c in r['contenders'].values()]
    med = [st['median'] for st in stats]
    errors = [
      [st['median'] - st['min'] for st in stats],
      [st['max'] - st['median'] for st in stats],
    ]
    colors = [{'ours': 'tab:blue'}.get(c['kind'], 'tab:orange') for c in r['contenders'].values()]
    ax.barh(range(len(labels)), med, xerr=errors, color=colors, capsize=2)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel('steps/s (median, min-max over rounds); blue = ours, orange = Keras fit')
    ax.set_title(f'{name}, global batch {r["batch_size"]}')
  m = results['machine']
  fig.suptitle(f'{m["cpu"]}, {m["cores"]} cores, TF {m["tensorflow"]}', fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write(results: dict, out: str) -> list[str]:
  for r in results['models'].values():
    r['targets_met'] = targets(r, results['settings']['policies'])
    r['targets_met_cpu_time'] = targets({**r, **r['cpu_time']}, results['settings']['policies'])
  paths = [os.path.join(out, f'benchmark.{ext}') for ext in ('json', 'md', 'png')]
  with open(paths[0], 'w') as f:
    json.dump(results, f, indent=2)
  with open(paths[1], 'w') as f:
    f.write(markdown(results))
  chart(results, paths[2])
  return paths
