"""The eval loop: one pass over the eval set, one compiled call per batch, every example counted
once."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import keras

import tensorflow as tf

from trainer.errors import ConfigError
from trainer.nn import fused
from trainer.step import grappler as grappler_lib
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
  """One pass over a (distributed) dataset, each batch added in a tf.function: sums of
  per-example loss and metrics over every example, divided by the count, so no example is
  dropped or counted twice; stateful metrics (`Trainer.build_metrics()`) are updated per replica
  and read on the host.
  `jit_compile`: each replica's forward pass and loss compiled by XLA, as the train step's
  gradients are (config.train.jit_compile); the stateful metrics' updates stay outside it.
  `grappler`: TensorFlow's graph optimizer on the compiled call (config.train.grappler)."""

  def __init__(
    self,
    *,
    strategy: tf.distribute.Strategy,
    compute_loss: LossFn,
    metric_names: Iterable[str],
    metrics: Mapping[str, keras.metrics.Metric] | None = None,
    jit_compile: bool = False,
    grappler: bool = True,
  ) -> None:
    self.strategy = strategy
    self.grappler = grappler
    self.compute_loss = compute_loss
    self.metrics = dict(metrics or {})
    self.metric_names = ('loss', *(n for n in metric_names if n not in self.metrics))
    self.reports = (*self.metric_names, *self.metrics)  # the names evaluate() returns
    self.add = tf.function(self._add, autograph=False)
    self._losses = user_code.xla_per_replica(self._replica_losses, jit_compile)

  def _replica_losses(self, batch: Any) -> tuple[tf.Tensor, dict[str, tf.Tensor]]:
    with fused.kernels():  # the model's element-wise chains as XLA kernels (trainer/nn/fused.py)
      return user_code.converted(self.compute_loss)(batch, training=False)

  def _replica_sums(self, batch: Any) -> tuple[dict[str, tf.Tensor], tf.Tensor]:
    per_example_loss, metrics = self._losses(batch)
    sums = {'loss': tf.reduce_sum(tf.cast(per_example_loss, tf.float32))}
    for name, value in metrics.items():
      if name in self.metrics:
        user_code.converted(self.metrics[name].update_state)(*value)
      else:
        sums[name] = tf.reduce_sum(tf.cast(value, tf.float32))
    count = tf.cast(tf.shape(per_example_loss)[0], tf.float32)
    return sums, count

  def _add(self, batch: Any, totals: dict, count: tf.Tensor) -> tuple[dict, tf.Tensor]:
    """One batch added to the running sums (on the device: no host read per batch)."""
    sums, n = self.strategy.run(self._replica_sums, args=(batch,))
    totals = {k: totals[k] + self.strategy.reduce(SUM, sums[k], axis=None) for k in totals}
    return totals, count + self.strategy.reduce(SUM, n, axis=None)

  def run(self, dataset, *, stop=None, batch_done=None, max_batches: int = 0):
    """One pass: ({name: mean over the examples}, the number of examples), as tensors; None
    when `stop()` ended it. One compiled call per batch, so that between batches
    `batch_done(batches)` can report progress and `stop()` can end the pass early. A batch past
    `max_batches` (> 0: config.train.eval_max_batches) is a ConfigError, before it is added."""
    totals = {k: tf.constant(0.0) for k in self.metric_names}
    count = tf.constant(0.0)
    for batches, batch in enumerate(dataset, start=1):
      if 0 < max_batches < batches:
        raise ConfigError(
          f'the eval set yielded more than config.train.eval_max_batches={max_batches} batches '
          '(its length is unknown to tf.data: a generator or a filter; one that loops never '
          'ends an eval): raise the bound (0 = none) or end the eval set'
        )
      with user_code.xla_errors('the eval'), grappler_lib.passes(self.grappler):
        totals, count = self.add(batch, totals, count)
      if stop is not None and stop():
        return None
      if batch_done is not None:
        batch_done(batches)
    return {k: v / count for k, v in totals.items()}, count

  def evaluate(
    self, dataset, *, stop=None, batch_done=None, max_batches: int = 0
  ) -> dict[str, float] | None:
    """Host side: resets the stateful metrics, one pass (`run`), {'loss': ..., <metric>: ...};
    None when `stop()` ended the pass."""
    for metric in self.metrics.values():
      metric.reset_state()
    done = self.run(dataset, stop=stop, batch_done=batch_done, max_batches=max_batches)
    if done is None:
      return None
    results = {k: float(v) for k, v in done[0].items()}
    results.update(read_metrics(self.metrics))
    return results
