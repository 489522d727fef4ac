"""The eval loop: one pass over the eval set in a compiled function, every example counted once."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import keras

import tensorflow as tf

from trainer.step import user_code

SUM = tf.distribute.ReduceOp.SUM
# compute_loss(batch, training=...) -> (per_example_loss [B], {metric name: per-example [B]})
LossFn = Callable[..., tuple[tf.Tensor, dict[str, tf.Tensor]]]


def read_metrics(metrics: Mapping[str, keras.metrics.Metric]) -> dict[str, float]:
  """Host side: {name: result} of stateful Keras metrics, then reset them."""
  results = {name: float(metric.result()) for name, metric in metrics.items()}
  for metric in metrics.values():
    metric.reset_state()
  return results


class EvalLoop:
  """One pass over a (distributed) dataset inside a tf.function: sums of per-example loss and
  metrics over every example, divided by the count, so no example is dropped or counted twice;
  stateful metrics (`Trainer.build_metrics()`) are updated per replica and read on the host."""

  def __init__(
    self,
    *,
    strategy: tf.distribute.Strategy,
    compute_loss: LossFn,
    metric_names: Iterable[str],
    metrics: Mapping[str, keras.metrics.Metric] | None = None,
  ) -> None:
    self.strategy = strategy
    self.compute_loss = compute_loss
    self.metrics = dict(metrics or {})
    self.metric_names = ('loss', *(n for n in metric_names if n not in self.metrics))
    self.reports = (*self.metric_names, *self.metrics)  # the names evaluate() returns
    self.run = tf.function(self._run, autograph=False)

  def _replica_sums(self, batch: Any) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
    per_example_loss, metrics = user_code.converted(self.compute_loss)(batch, training=False)
    sums = {'loss': tf.reduce_sum(tf.cast(per_example_loss, tf.float32))}
    for name, value in metrics.items():
      if name in self.metrics:
        user_code.converted(self.metrics[name].update_state)(*value)
      else:
        sums[name] = tf.reduce_sum(tf.cast(value, tf.float32))
    count = tf.cast(tf.shape(per_example_loss)[0], tf.float32)
    return sums, count

  def _run(self, dataset: Any) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
    # `dataset.reduce` (tf.data's, or tf.distribute's for a distributed dataset) is what
    # autograph makes of `for batch in dataset`, written out: this function traces without
    # autograph (trainer/step/user_code.py).

    def add(state: tuple, batch: Any) -> tuple:
      totals, count = state
      sums, n = self.strategy.run(self._replica_sums, args=(batch,))
      totals = {k: totals[k] + self.strategy.reduce(SUM, sums[k], axis=None) for k in totals}
      return totals, count + self.strategy.reduce(SUM, n, axis=None)

    totals, count = dataset.reduce(
      ({k: tf.constant(0.0) for k in self.metric_names}, tf.constant(0.0)), add
    )
    return {k: v / count for k, v in totals.items()}, count

  def evaluate(self, dataset: Any) -> dict[str, float]:
    """Host side: resets the stateful metrics, one pass, {'loss': ..., <metric>: ...}."""
    for metric in self.metrics.values():
      metric.reset_state()
    means, _ = self.run(dataset)
    results = {k: float(v) for k, v in means.items()}
    results.update(read_metrics(self.metrics))
    return results
