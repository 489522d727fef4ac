"""The eval loop under config.train.jit_compile: each replica's forward pass and loss run as one
XLA-compiled function, as the train step's gradients do, and give the eval the uncompiled loop
gives (stateful metrics included, updated outside the compiled function)."""

import keras
import numpy as np
import pytest

from tiny import TinyTrainer, tiny_config


class WithStatefulMetric(TinyTrainer):
  def build_metrics(self):
    return {'auc': keras.metrics.AUC(from_logits=True)}

  def compute_loss(self, batch, *, training):
    loss, metrics = super().compute_loss(batch, training=training)
    _, y = batch
    logits = self.model(batch[0], training=training)
    return loss, {**metrics, 'auc': (y == 0, logits[:, 0])}


def _xla_functions(eval_loop, dataset) -> list[str]:
  """Names of the XLA-compiled functions in the graph of one eval batch."""
  batch = next(iter(dataset))
  totals = {k: 0.0 for k in eval_loop.metric_names}
  graph = eval_loop.add.get_concrete_function(batch, totals, 0.0).graph
  return [
    f.signature.name for f in graph.as_graph_def().library.function if f.attr['_XlaMustCompile'].b
  ]


@pytest.mark.parametrize('jit', ['false', 'true'])
def test_eval_compiles_the_forward_pass_under_jit_compile(tmp_path, jit):
  trainer = WithStatefulMetric(
    tiny_config(**{'train.jit_compile': jit, 'train.batch_size': 48}), str(tmp_path / jit)
  )
  loop = trainer.runner.eval_loop
  dataset = trainer.strategy.experimental_distribute_dataset(trainer.datasets.eval)
  compiled = _xla_functions(loop, dataset)
  assert (len(compiled) == 1) == (jit == 'true'), compiled
  got = loop.evaluate(dataset)  # 512 examples in batches of 48: the last one has 32

  reference = WithStatefulMetric(tiny_config(), str(tmp_path / 'reference'))
  reference.model.set_weights(trainer.model.get_weights())
  x, y = (
    np.concatenate([b[0] for b in trainer.datasets.eval]),
    np.concatenate([b[1] for b in trainer.datasets.eval]),
  )
  logits = reference.model(x).numpy().astype(np.float64)
  shifted = logits - logits.max(axis=1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
  assert got['loss'] == pytest.approx(-log_probs[np.arange(len(y)), y].mean(), rel=1e-5)
  assert got['accuracy'] == pytest.approx((logits.argmax(1) == y).mean(), abs=1e-7)
  auc = keras.metrics.AUC(from_logits=True)
  auc.update_state(y == 0, logits[:, 0])
  assert got['auc'] == pytest.approx(float(auc.result()), rel=1e-6)
