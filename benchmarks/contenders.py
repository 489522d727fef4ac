"""The things the benchmark races: our Trainer's compiled loop and Keras `model.fit`.

Each contender is built under its own precision policy (the Keras policy is global, so it is set
before each model is built: `Trainer.__init__` does it) and stays built, so rounds can interleave
A B C A B C ... in one process. `timed(steps)` runs `steps` optimizer steps and returns the
wall-clock seconds and the process CPU seconds (user + system, all threads) they took, measured in
steady state. CPU seconds barely move when other processes compete for the cores (wall seconds
do), so steps per CPU-second is the fairer comparison on a shared machine:

  Ours      `runner.train_steps(steps)`: what `Trainer.train` does between its evals and
            checkpoints (compiled calls of steps_per_loop steps, their counters and the
            collapse-guard and state checks; at each progress line, every `log_every` steps, the
            metric sums read and reset, the TensorBoard scalars and the 'log' event). Its first
            call opens the run folder as `train()` does; the iterator lives across rounds.
  KerasFit  `model.fit(dataset, steps_per_epoch=...)` with the same model class, dataset, batch,
            optimizer, policy and `steps_per_execution = steps_per_loop`. The optimizer is the
            config's, built by trainer/optim/optimizers.py: Keras's own class when the config says
            `optimizer.fused=False` (what a Keras user has), ours otherwise; with
            `optimizer.clip_norm` > 0 it gets Keras's `global_clipnorm`. Under mixed_float16
            `compile` wraps the optimizer in Keras's LossScaleOptimizer (dynamic scaling).
            Every fit call makes a new iterator (and refills the shuffle buffer), so the first
            execution of each call is not timed: a callback stamps the time after each execution
            and only the executions after the first count.
            `lso='ours'` / `lso='keras'`: the optimizer wrapped explicitly, under any policy, in
            trainer.mixed_precision.LossScaleOptimizer / keras.mixed_precision's (the pair
            `fit ... lso=ours` and `fit ... lso=keras`: the cost of our all-replica,
            bit-identical apply-or-skip against Keras's, everything else equal).
"""

from __future__ import annotations

import tempfile
import time

import keras
import ml_collections

from trainer.optim import optimizers


class Ours:
  kind = 'ours'
  untimed_steps = 0  # steps timed() runs besides the ones it times

  def __init__(self, trainer_class, config: ml_collections.ConfigDict):
    self._workdir = tempfile.TemporaryDirectory(prefix='bench-')
    self.trainer = trainer_class(config, self._workdir.name)
    self.policy = self.trainer.policy
    self.steps_per_loop = self.trainer.config.train.steps_per_loop

  def timed(self, steps: int) -> tuple[float, float]:
    """Runs `steps` steps as Trainer.train does between its evals and checkpoints."""
    start, cpu_start = time.perf_counter(), time.process_time()
    self.trainer.runner.train_steps(steps)
    return time.perf_counter() - start, time.process_time() - cpu_start

  def close(self):
    self.trainer.runner.workdir.close()
    self._workdir.cleanup()


class _ExecutionClock(keras.callbacks.Callback):
  """Time stamps after each execution (fit calls on_train_batch_end once per execution)."""

  def __init__(self):
    super().__init__()
    self.stamps = []

  def on_train_batch_end(self, batch, logs=None):
    self.stamps.append((time.perf_counter(), time.process_time()))


def keras_loss(trainer):
  """The Keras loss for fit: the model class may say (`benchmark_keras_loss()`); otherwise
  sparse categorical cross-entropy on logits, which every model in models/ uses."""
  if hasattr(trainer, 'benchmark_keras_loss'):
    return trainer.benchmark_keras_loss()
  return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _loss_scaled(optimizer, lso: str, strategy):
  """`optimizer` in our LossScaleOptimizer ('ours') or Keras's ('keras'), built in the scope of
  the strategy the model's variables live in."""
  from trainer import mixed_precision

  wrapper = {'ours': mixed_precision, 'keras': keras.mixed_precision}[lso]
  with strategy.scope():
    return wrapper.LossScaleOptimizer(optimizer)


class KerasFit:
  kind = 'fit'

  def __init__(self, trainer_class, config: ml_collections.ConfigDict, lso: str | None = None):
    self._workdir = tempfile.TemporaryDirectory(prefix='bench-')
    # The Trainer builds the model and the dataset exactly as it does for `Ours` (same policy,
    # seed, pipeline); fit then trains that model with Keras's own loop.
    trainer = trainer_class(config, self._workdir.name)
    self.policy = trainer.policy
    self.steps_per_loop = trainer.config.train.steps_per_loop
    self.model = trainer.model
    self.dataset = trainer.datasets.train
    metrics = ['accuracy'] if 'accuracy' in trainer.metric_names else []
    optimizer = optimizers.build(trainer.config.optimizer, trainer.config.optimizer.learning_rate)
    if trainer.config.optimizer.clip_norm > 0:  # ours clips the global norm in the step
      optimizer.global_clipnorm = trainer.config.optimizer.clip_norm
    if lso is not None:
      optimizer = _loss_scaled(optimizer, lso, trainer.strategy)
    self.model.compile(
      optimizer=optimizer,
      loss=keras_loss(trainer),
      metrics=metrics,
      steps_per_execution=self.steps_per_loop,
      jit_compile=trainer.config.train.jit_compile == 'true',
    )
    self.loss_scaled = isinstance(self.model.optimizer, keras.optimizers.LossScaleOptimizer)
    self.untimed_steps = self.steps_per_loop  # timed(): the first execution is not timed

  def timed(self, steps: int) -> tuple[float, float]:
    clock = _ExecutionClock()
    self.model.fit(
      self.dataset,
      epochs=1,
      steps_per_epoch=steps + self.steps_per_loop,
      verbose=0,
      callbacks=[clock],
    )
    (wall0, cpu0), (wall1, cpu1) = clock.stamps[0], clock.stamps[-1]
    return wall1 - wall0, cpu1 - cpu0

  def close(self):
    self._workdir.cleanup()
