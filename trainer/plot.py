"""A PNG of one or more runs from their TensorBoard events.

  python -m trainer.plot --workdir=runs/a [--workdir=runs/b ...] [--out=runs/a/curves.png]

Panels: loss (train solid, eval dashed with dots), accuracy (same), learning rate, loss scale
(log axis) and skipped steps (cumulative), all against the global step. Several workdirs are drawn
on the same axes, one colour each, labelled by folder name (e.g. bfloat16 against float16).
Needs matplotlib (`pip install mpt-trainer[plots]`).
"""
from __future__ import annotations

import os

import numpy as np

from trainer import events
from trainer.errors import UserError

PANELS = (  # (title, [(tag, style)], log y)
    ('loss', [('train/loss', '-'), ('eval/loss', '--o')], False),
    ('accuracy', [('train/accuracy', '-'), ('eval/accuracy', '--o')], False),
    ('learning rate', [('train/learning_rate', '-')], False),
    ('loss scale', [('train/loss_scale', '-')], True),
    ('skipped steps (cumulative)', [('train/skipped_steps', '-')], False),
)


def read_scalars(workdir: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """{tag: (steps, values)} from <workdir>/tensorboard (trainer/events.py reads the files; the
  last value wins when a resumed run wrote a step twice)."""
  folder = os.path.join(workdir, 'tensorboard')
  if not os.path.isdir(folder):
    raise UserError(f'{folder} not found: --workdir must be a folder a training run wrote')
  series = events.read_scalars(workdir)
  if not series:
    raise UserError(f'{folder} holds no scalar summaries yet; train for at least '
                    'config.train.log_every steps first')
  return {tag: (np.array([s for s, _ in points]), np.array([v for _, v in points]))
          for tag, points in series.items()}


def render(workdirs: list[str], out: str) -> str:
  """Draws the panels for `workdirs` into the PNG `out`; returns its path."""
  try:
    import matplotlib
  except ImportError:
    raise UserError('plotting needs matplotlib: pip install "mpt-trainer[plots]"') from None
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  runs = [(os.path.basename(os.path.normpath(w)), read_scalars(w)) for w in workdirs]
  fig, axes = plt.subplots(2, 3, figsize=(15, 8))
  colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
  for ax, (title, tags, log) in zip(axes.flat, PANELS):
    for i, (name, scalars) in enumerate(runs):
      for tag, style in tags:
        if tag in scalars:
          steps, values = scalars[tag]
          ax.plot(steps, values, style, color=colors[i % len(colors)], markersize=4,
                  label=f'{name} {tag.split("/")[0]}' if len(tags) > 1 else name)
    ax.set_title(title)
    ax.set_xlabel('step')
    if log:
      ax.set_yscale('log', base=2)
    if ax.lines:
      ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
  axes.flat[-1].axis('off')
  fig.suptitle(', '.join(name for name, _ in runs))
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


def main(argv):
  del argv
  from absl import flags
  workdirs = flags.FLAGS.workdir
  out = flags.FLAGS.out or os.path.join(workdirs[0], 'curves.png')
  try:
    print(render(workdirs, out))
  except UserError as e:
    import sys
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)


if __name__ == '__main__':
  from absl import app, flags
  flags.DEFINE_multi_string('workdir', None, 'a run folder; repeat to overlay several runs')
  flags.DEFINE_string('out', None, 'PNG path (default: <first workdir>/curves.png)')
  flags.mark_flags_as_required(['workdir'])
  app.run(main)
