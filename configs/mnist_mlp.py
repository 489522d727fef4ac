"""MNIST MLP (Flatten, Dense 128 relu, Dense 10 float32): a second MNIST config.

Command:
  python launch.py --config=configs/mnist_mlp.py --config.data.dir=../shared/data/mnist

Starts from the schema's defaults (`trainer.config.defaults()`; configs/mnist.py documents every
key) and sets only what differs from them.
"""

from trainer import config as config_lib


def get_config():
  config = config_lib.defaults()
  config.model = 'mnist_mlp'  # models/mnist_mlp.py
  config.data.dir = ''  # folder with the four MNIST IDX .gz files; '' downloads them
  config.train.batch_size = 128  # global batch
  config.train.epochs = 10  # one epoch is 468 steps
  config.train.checkpoint_every = 1000  # in steps; also at the end
  config.optimizer.name = 'adam'
  config.optimizer.learning_rate = 2e-3  # peak rate
  config.optimizer.schedule = 'cosine'  # decays to 0 at the last step
  config.precision.policy = 'auto'  # mixed_bfloat16 on a CPU with AVX512_BF16
  return config
