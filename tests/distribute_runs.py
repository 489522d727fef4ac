"""Runs for tests/step/test_distribute.py that need the CPU split into 2 logical devices.

Logical devices must be configured before TensorFlow runs any op, so these runs happen in a
fresh process: `python tests/distribute_runs.py OUT_DIR`. It writes OUT_DIR/arrays.npz (weights,
optimizer slots, per replica) and OUT_DIR/results.json (scalars and error messages); the tests
assert on them.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import tensorflow as tf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, '..', 'shared', 'data', 'mnist')
STEPS = 3


def small_mnist(train_examples, test_examples=None):
  """Reads the MNIST files once per process and keeps the first examples (faster runs)."""
  import functools
  from trainer.data import mnist as mnist_data

  load = functools.lru_cache(mnist_data.load)

  def subset(data_dir=''):
    (x, y), (xt, yt) = load(data_dir)
    return (x[:train_examples], y[:train_examples]), (xt[:test_examples], yt[:test_examples])

  mnist_data.load = subset


def split_cpu():
  cpu = tf.config.list_physical_devices('CPU')[0]
  tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)


def config(**overrides):
  from configs import mnist
  from trainer.config import set_dotted

  c = mnist.get_config()
  c.data.dir = DATA
  c.train.batch_size = 32
  c.train.steps = STEPS
  c.train.steps_per_loop = 1
  c.train.log_every = 1
  c.train.checkpoint_every = 1
  c.train.jit_compile = 'false'
  c.precision.policy = 'float32'
  c.precision.loss_scale = 'none'
  c.optimizer.schedule = 'constant'
  for key, value in overrides.items():
    set_dotted(c, key, value)
  return c


def trainer(workdir, **overrides):
  from models.mnist_cnn import MnistCnnTrainer

  return MnistCnnTrainer(config(**overrides), workdir)


def local(strategy, variables):
  """[replica][variable] numpy arrays."""
  per_var = [strategy.experimental_local_results(_tf_variable(v)) for v in variables]
  return [[vs[r].numpy() for vs in per_var] for r in range(strategy.num_replicas_in_sync)]


def _tf_variable(v):
  import keras

  return v.value if isinstance(v, keras.Variable) else v


def steps(t, n, iterator=None):
  iterator = iterator or iter(t.strategy.experimental_distribute_dataset(t.datasets.train))
  for _ in range(n):
    t.runner.train_loop.run(iterator, 1)
  return iterator


def batchnorm(out_dir):
  """BatchNorm under a skip, in a process of its own: MirroredStrategy instances in one process
  reuse collective instance keys, and TensorFlow caches each instance's shape, so a second
  strategy all-reducing a model of another size fails (main() trains only the MNIST CNN)."""
  split_cpu()
  sys.path.insert(0, ROOT)
  small_mnist(4096)
  import keras
  from models.mnist_cnn import MnistCnnTrainer

  results, work = {}, os.path.join(out_dir, 'work')
  mirrored_opts = {'distribute.strategy': 'mirrored', 'distribute.devices': 'CPU:0,CPU:1'}

  # A skip injected on replica 1 leaves BatchNorm's statistics bit-identical on both.
  class BnTrainer(MnistCnnTrainer):
    def build_model(self):
      return keras.Sequential(
        [
          keras.Input((28, 28, 1)),
          keras.layers.Flatten(),
          keras.layers.Dense(32),
          keras.layers.BatchNormalization(),
          keras.layers.Activation('relu'),
          keras.layers.Dense(10, dtype='float32'),
        ]
      )

  t = BnTrainer(
    config(
      **mirrored_opts, **{'debug.inject_nonfinite_steps': '2', 'debug.inject_nonfinite_replica': 1}
    ),
    work,
  )
  it = steps(t, 2)
  before = local(t.strategy, t.model.non_trainable_variables)
  steps(t, 1, it)  # step 2: skipped everywhere
  after = local(t.strategy, t.model.non_trainable_variables)
  steps(t, 1, it)  # step 3: applied, the statistics move
  moved = local(t.strategy, t.model.non_trainable_variables)
  results['bn/skipped'] = int(t.train_step.skipped_steps.numpy())
  results['bn/identical_on_skip'] = all(
    np.array_equal(b, a) for r in range(2) for b, a in zip(before[r], after[r])
  )
  results['bn/moved_after'] = any(
    not np.array_equal(b, a) for r in range(2) for b, a in zip(after[r], moved[r])
  )

  with open(os.path.join(out_dir, 'results.json'), 'w') as f:
    json.dump(results, f, indent=1)


def float8(out_dir):
  """precision.float8 on 2 replicas vs one device, 3 steps from the same start (own process: see
  `batchnorm`)."""
  split_cpu()
  sys.path.insert(0, ROOT)
  small_mnist(4096)
  from models.mnist_mlp import MnistMlpTrainer

  opts = {
    'precision.policy': 'mixed_bfloat16',
    'precision.float8': True,
    'precision.loss_scale': 'dynamic',
    'optimizer.name': 'sgd',
    'optimizer.learning_rate': 0.1,
  }
  work = os.path.join(out_dir, 'work')
  from configs import mnist_mlp

  base = mnist_mlp.get_config()

  def mlp(**more):
    c = config(**opts, **more)
    c.model = base.model
    return MnistMlpTrainer(c, work)

  one = mlp()
  mirrored = mlp(**{'distribute.strategy': 'mirrored', 'distribute.devices': 'CPU:0,CPU:1'})
  mirrored.model.set_weights(one.model.get_weights())
  steps(one, STEPS)
  steps(mirrored, STEPS)
  arrays = {f'one/{i}': v.numpy() for i, v in enumerate(one.model.variables)}
  for r, ws in enumerate(local(mirrored.strategy, mirrored.model.variables)):
    for i, w in enumerate(ws):
      arrays[f'replica{r}/{i}'] = w
  np.savez(os.path.join(out_dir, 'arrays.npz'), **arrays)
  with open(os.path.join(out_dir, 'results.json'), 'w') as f:
    json.dump(
      {
        'names': [v.path for v in one.model.variables],
        'skipped': int(mirrored.train_step.skipped_steps.numpy()),
      },
      f,
    )


def main(out_dir):
  split_cpu()
  sys.path.insert(0, ROOT)
  # Eval must count every test image once: 2000 of them (not all 10,000: the four evaluations
  # below took a third of this run) keep what the count checks, 62 batches of 32 and a last one
  # of 16 that the two replicas split 8 + 8 (a dropped or doubled partial batch is off by 16 or 8).
  small_mnist(4096, 2000)
  from trainer.errors import UserError

  arrays, results = {}, {}
  work = os.path.join(out_dir, 'work')

  # 1. mirrored on 2 replicas vs one device, same global batch, SGD with momentum, float32.
  trained, starts = {}, {}
  for clip in (0.0, 0.05):
    opts = {'optimizer.name': 'sgd', 'optimizer.learning_rate': 0.1, 'optimizer.clip_norm': clip}
    one = trainer(work, **opts)
    mirrored = trainer(
      work, **{'distribute.strategy': 'mirrored', 'distribute.devices': 'CPU:0,CPU:1', **opts}
    )
    results['replicas'] = mirrored.strategy.num_replicas_in_sync
    starts[clip] = one.model.get_weights()
    mirrored.model.set_weights(starts[clip])
    steps(one, STEPS)
    steps(mirrored, STEPS)
    for i, w in enumerate(one.model.get_weights()):
      arrays[f'clip{clip}/one/{i}'] = w
    for r, ws in enumerate(local(mirrored.strategy, mirrored.model.weights)):
      for i, w in enumerate(ws):
        arrays[f'clip{clip}/replica{r}/{i}'] = w
    results[f'clip{clip}/skipped'] = int(mirrored.train_step.skipped_steps.numpy())
    trained[clip] = (one, mirrored)

  # 2. eval under mirrored covers the test set once (the last batch of 16 split 8 + 8).
  one, mirrored = trained[0.0]
  dataset = mirrored.strategy.experimental_distribute_dataset(mirrored.datasets.eval)
  means, count = mirrored.runner.eval_loop.run(dataset)
  results['eval/mirrored_count'] = float(count)
  results['eval/mirrored'] = {k: float(v) for k, v in means.items()}
  means, count = one.runner.eval_loop.run(one.datasets.eval)
  results['eval/one_count'] = float(count)
  results['eval/one'] = {k: float(v) for k, v in means.items()}

  # 3. jit_compile=true under mirrored: the same as the run without XLA from the same start.
  jit = trainer(
    work,
    **{
      'distribute.strategy': 'mirrored',
      'distribute.devices': 'CPU:0,CPU:1',
      'optimizer.name': 'sgd',
      'optimizer.learning_rate': 0.1,
      'train.jit_compile': 'true',
    },
  )
  jit.model.set_weights(starts[0.0])
  steps(jit, STEPS)
  for r, ws in enumerate(local(jit.strategy, jit.model.weights)):
    for i, w in enumerate(ws):
      arrays[f'jit/replica{r}/{i}'] = w

  # 4. inf on one replica only: every replica skips; weights and slots unchanged; backs off once.
  for bad in (1, 0):
    t = trainer(
      work,
      **{
        'distribute.strategy': 'mirrored',
        'distribute.devices': 'CPU:0,CPU:1',
        'precision.loss_scale': 'dynamic',
        'precision.initial_scale': 1024.0,
        'debug.inject_nonfinite_steps': '1',
        'debug.inject_nonfinite_replica': bad,
      },
    )
    it = steps(t, 1)  # step 0: finite, creates non-zero Adam slots
    state = list(t.model.weights) + list(t.optimizer.variables)
    before = local(t.strategy, state)
    scale_before = local(t.strategy, [t.loss_scaler.scale])
    from trainer.step.loss_scale import all_finite

    # Installed around compute_gradients by the build.
    injection = t.train_step.state.guard.injection
    flags = t.strategy.run(  # at step 1, which replicas would the injection poison?
      lambda: all_finite(injection.poison([tf.ones([2])]))
    )
    results[f'inject{bad}/finite_per_replica'] = [
      bool(f) for f in t.strategy.experimental_local_results(flags)
    ]
    steps(t, 1, it)  # step 1: inf on replica `bad` only
    after = local(t.strategy, state)
    for r in range(2):
      for i, (b, a) in enumerate(zip(before[r], after[r])):
        arrays[f'inject{bad}/before/replica{r}/{i}'] = b
        arrays[f'inject{bad}/after/replica{r}/{i}'] = a
    results[f'inject{bad}/scale_before'] = [float(s[0]) for s in scale_before]
    results[f'inject{bad}/scale_after'] = [
      float(s[0]) for s in local(t.strategy, [t.loss_scaler.scale])
    ]
    results[f'inject{bad}/skipped'] = int(t.train_step.skipped_steps.numpy())
    results[f'inject{bad}/global_step'] = int(t.global_step.numpy())
    steps(t, 1, it)  # step 2: finite again, applied
    results[f'inject{bad}/skipped_after_next'] = int(t.train_step.skipped_steps.numpy())
    results[f'inject{bad}/changed_after_next'] = bool(
      any(not np.array_equal(a, b) for a, b in zip(after[0], local(t.strategy, state)[0]))
    )

  # 5. stateful metrics: the eval AUC on 2 replicas equals the one-device AUC (same weights).
  import keras
  from models.mnist_cnn import MnistCnnTrainer

  class AucTrainer(MnistCnnTrainer):
    def build_metrics(self):
      return {'auc': keras.metrics.AUC(num_thresholds=500)}

    def compute_loss(self, batch, *, training):
      images, labels = batch
      logits = tf.cast(self.model(images, training=training), tf.float32)
      loss = keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
      is_zero = tf.cast(labels == 0, tf.float32)[:, None]
      return loss, {'auc': (is_zero, tf.nn.softmax(logits)[:, :1])}

  mirrored_opts = {'distribute.strategy': 'mirrored', 'distribute.devices': 'CPU:0,CPU:1'}
  one = AucTrainer(config(), work)
  mirrored = AucTrainer(config(**mirrored_opts), work)
  steps(one, 2)
  mirrored.model.set_weights(one.model.get_weights())
  results['auc/one'] = one.evaluate()['auc']
  results['auc/mirrored'] = mirrored.evaluate()['auc']
  steps(mirrored, 2)  # the train-side metric sums over both replicas too
  results['auc/mirrored_train'] = mirrored.runner.train_loop.read_outputs().get('auc')

  # 6. config errors that need two replicas.
  for name, overrides in {
    'odd_batch': {
      'distribute.strategy': 'mirrored',
      'distribute.devices': 'CPU:0,CPU:1',
      'train.batch_size': 33,
    },
    'no_device': {'distribute.strategy': 'mirrored', 'distribute.devices': 'CPU:0,GPU:3'},
    # The CPU is split in 2 and TensorFlow runs: a split in 4 cannot happen any more.
    'split_late': {'distribute.strategy': 'mirrored', 'distribute.devices': 'CPU:0,CPU:3'},
  }.items():
    try:
      trainer(work, **overrides)
      results[f'error/{name}'] = None
    except UserError as e:
      results[f'error/{name}'] = f'{type(e).__name__}: {e}'

  np.savez(os.path.join(out_dir, 'arrays.npz'), **arrays)
  with open(os.path.join(out_dir, 'results.json'), 'w') as f:
    json.dump(results, f, indent=1)


def float8_recipes(out_dir, recipes):
  """Each current-scaling float8 recipe on 2 replicas vs one device, 3 steps from the same start,
  on an MLP whose first layer (K = 784, not whole MX blocks) computes in float32."""
  split_cpu()
  sys.path.insert(0, ROOT)
  small_mnist(4096)
  import keras
  from models.mnist_mlp import MnistMlpTrainer

  class StemMlp(MnistMlpTrainer):
    def build_model(self):
      return keras.Sequential(
        [
          keras.Input((28, 28, 1)),
          keras.layers.Flatten(),
          keras.layers.Dense(64, dtype='float32', name='stem'),
          keras.layers.Dense(128, activation='relu', name='hidden'),
          keras.layers.Dense(10, dtype='float32', name='logits'),
        ],
        name='stem_mlp',
      )

  arrays, results = {}, {}
  for recipe in recipes:
    opts = {
      'precision.policy': 'mixed_bfloat16',
      'precision.float8': recipe,
      'precision.loss_scale': 'dynamic',
      'optimizer.name': 'sgd',
      'optimizer.learning_rate': 0.1,
    }
    work = os.path.join(out_dir, recipe)
    one = StemMlp(config(**opts), work)
    mirrored = StemMlp(
      config(**opts, **{'distribute.strategy': 'mirrored', 'distribute.devices': 'CPU:0,CPU:1'}),
      work,
    )
    mirrored.model.set_weights(one.model.get_weights())
    for i, v in enumerate(one.model.variables):
      arrays[f'{recipe}/start/{i}'] = v.numpy()
    steps(one, STEPS)
    steps(mirrored, STEPS)
    for i, v in enumerate(one.model.variables):
      arrays[f'{recipe}/one/{i}'] = v.numpy()
    for r, ws in enumerate(local(mirrored.strategy, mirrored.model.variables)):
      for i, w in enumerate(ws):
        arrays[f'{recipe}/replica{r}/{i}'] = w
    results[recipe] = {
      'names': [v.path for v in one.model.variables],
      'skipped': int(mirrored.train_step.skipped_steps.numpy()),
      'quantized': [l.name for l in mirrored.model.layers if hasattr(l, 'float8_recipe')],
    }
  np.savez(os.path.join(out_dir, 'arrays.npz'), **arrays)
  with open(os.path.join(out_dir, 'results.json'), 'w') as f:
    json.dump(results, f)


if __name__ == '__main__':
  if sys.argv[1] == '--batchnorm':
    batchnorm(sys.argv[2])
  elif sys.argv[1] == '--float8':
    float8(sys.argv[2])
  elif sys.argv[1] == '--float8-recipes':
    float8_recipes(sys.argv[2], sys.argv[3].split(','))
  else:
    main(sys.argv[1])
  from quick_exit import exit_now

  exit_now()  # the results are written; skip TensorFlow's teardown (tests/quick_exit.py)
