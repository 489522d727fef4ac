"""The step's outputs: what the compiled loop sums and the host reads as means and counts."""

from __future__ import annotations

from collections.abc import Mapping

import tensorflow as tf

from trainer.step.eval_step import read_metrics

COUNTERS = ('steps', 'skipped', 'nonfinite_loss')  # outputs read as counts, not means


def with_counters(
  outputs: Mapping[str, tf.Tensor], skipped: tf.Tensor, loss_finite: tf.Tensor | bool = True
) -> dict[str, tf.Tensor]:
  """`outputs` as float32, zeroed when the loss is not finite, plus the three counters."""
  loss_finite = tf.convert_to_tensor(loss_finite)
  values = {k: tf.where(loss_finite, tf.cast(v, tf.float32), 0.0) for k, v in outputs.items()}
  values.update(
    steps=tf.constant(1.0),
    skipped=tf.cast(skipped, tf.float32),
    nonfinite_loss=1.0 - tf.cast(loss_finite, tf.float32),
  )
  return values


def read(names: list, totals: tf.Variable, metrics: dict) -> dict[str, float]:
  """Host side: from `totals` (a vector variable, one sum per entry of `names`), the counters
  as counts and every other output as its mean over the steps whose loss was finite (NaN when
  there were none); the sums reset. Then the stateful `metrics`' results (reset too)."""
  values = totals.numpy()
  sums = {k: float(v) for k, v in zip(names, values)}
  totals.assign(tf.zeros_like(values))
  counted = sums.get('steps', 0.0) - sums.get('nonfinite_loss', 0.0)
  means = {
    k: (v / counted if counted else float('nan')) for k, v in sums.items() if k not in COUNTERS
  }
  ordered = {'loss': means.pop('loss')} if 'loss' in means else {}
  ordered.update(means)
  ordered.update(read_metrics(metrics))
  ordered.update({k: int(sums[k]) for k in COUNTERS if k in sums})
  return ordered
