"""A PNG of one or more runs from their TensorBoard events.

  `python -m trainer.insight.plot --workdir=runs/a [--workdir=runs/b ...] [--out=runs/a/curves.png]`

Panels: loss (train solid, eval dashed with dots: a curve when config.train.eval_every is set),
the first metric (same; accuracy for the MNIST models), learning rate, loss scale (log axis),
skipped steps (cumulative) and steps/s, all against the global step, and the train loss against
wall-clock time (minutes since the run's first logged point; a resumed run's pause shows as a
gap), which is where the policies' speed difference shows. Several workdirs are drawn on the
same axes, one colour each, labelled by folder name and precision policy (from the run's
config.json; 'auto' is shown with what it resolves to on this machine).
Needs matplotlib, which the `plots` extra installs (`pip install -e '.[plots]'` in a checkout);
without it, plotting is a one-line error saying so.
"""

from __future__ import annotations

import json
import os

import numpy as np

from trainer.insight import events
from trainer.errors import UserError

PANELS = (  # (title, [(tag, style)], log y); '{metric}' is the first metric the runs logged
  ('loss', [('train/loss', '-'), ('eval/loss', '--o')], False),
  ('{metric}', [('train/{metric}', '-'), ('eval/{metric}', '--o')], False),
  ('learning rate', [('train/learning_rate', '-')], False),
  ('loss scale', [('train/loss_scale', '-')], True),
  ('skipped steps (cumulative)', [('train/skipped_steps', '-')], False),
  ('steps/s', [('train/steps_per_sec', '-o')], False),
)
NOT_METRICS = ('loss', 'learning_rate', 'loss_scale', 'skipped_steps', 'steps_per_sec')


def read_scalars(workdir: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """{tag: (steps, values)} from <workdir>/tensorboard (trainer/insight/events.py reads the
  files; the last value wins when a resumed run wrote a step twice)."""
  folder = os.path.join(workdir, 'tensorboard')
  if not os.path.isdir(folder):
    raise UserError(f'{folder} not found: --workdir must be a folder a training run wrote')
  series = events.read_scalars(workdir)
  if not series:
    raise UserError(
      f'{folder} holds no scalar summaries yet; train for at least '
      'config.train.log_every steps first'
    )
  return {
    tag: (np.array([s for s, _ in points]), np.array([v for _, v in points]))
    for tag, points in series.items()
  }


def policy_of(workdir: str) -> str:
  """The run's precision policy from its config.json ('?' when unreadable)."""
  try:
    with open(os.path.join(workdir, 'config.json')) as f:
      policy = json.load(f)['precision']['policy']
  except (OSError, ValueError, KeyError, TypeError):
    return '?'
  if policy == 'auto':
    from trainer.step import precision

    return f'auto = {precision.resolve("auto")[0]} here'
  return policy


def _first_metric(runs) -> str | None:
  for _, _, scalars in runs:
    for tag in scalars:
      kind, _, name = tag.partition('/')
      if kind == 'train' and name not in NOT_METRICS:
        return name
  return None


def pyplot():
  """matplotlib.pyplot on the Agg backend; a one-line UserError naming the extra when
  matplotlib is not installed (`pip install -e .` leaves it out)."""
  try:
    import matplotlib
  except ImportError:
    raise UserError(
      "plotting needs matplotlib, which the 'plots' extra installs: "
      "pip install -e '.[plots]' (in a checkout) or pip install matplotlib"
    ) from None
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  return plt


def render(workdirs: list[str], out: str) -> str:
  """Draws the panels for `workdirs` into the PNG `out`; returns its path."""
  plt = pyplot()
  fig = figure(workdirs)
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


def figure(workdirs: list[str]):
  """The matplotlib Figure of the panels for `workdirs`."""
  plt = pyplot()

  runs = [
    (f'{os.path.basename(os.path.normpath(w))} ({policy_of(w)})', w, read_scalars(w))
    for w in workdirs
  ]
  metric = _first_metric(runs) or 'accuracy'
  fig, axes = plt.subplots(2, 4, figsize=(20, 8))
  colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
  for ax, (title, tags, log) in zip(axes.flat, PANELS):
    title = title.format(metric=metric)
    tags = [(tag.format(metric=metric), style) for tag, style in tags]
    for i, (name, _, scalars) in enumerate(runs):
      for tag, style in tags:
        if tag in scalars:
          steps, values = scalars[tag]
          ax.plot(
            steps,
            values,
            style,
            color=colors[i % len(colors)],
            markersize=4,
            label=f'{name} {tag.split("/")[0]}' if len(tags) > 1 else name,
          )
    ax.set_title(title)
    ax.set_xlabel('step')
    if log:
      ax.set_yscale('log', base=2)
    if ax.lines:
      ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
  wall = axes.flat[len(PANELS)]
  for i, (name, workdir, _) in enumerate(runs):
    times = events.read_wall_times(workdir, 'train/loss')
    if times:
      losses = dict(zip(*read_scalars(workdir)['train/loss']))
      start = times[0][1]
      wall.plot(
        [(t - start) / 60 for _, t in times],
        [losses[s] for s, _ in times],
        '-',
        color=colors[i % len(colors)],
        label=name,
      )
  wall.set_title('train loss against wall-clock time')
  wall.set_xlabel('minutes since the first logged point')
  if wall.lines:
    wall.legend(fontsize=8)
  wall.grid(alpha=0.3)
  axes.flat[-1].axis('off')
  fig.suptitle(', '.join(name for name, _, _ in runs))
  fig.tight_layout()
  return fig


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
