"""The float16 overflow demo (models/overflow_demo.py): an MNIST MLP whose layer 'culprit'
overflows float16 in the forward pass (model_config.overflow='backward': whose gradient does).

Starts from the schema's defaults (configs/mnist.py documents every key) and sets what differs.

  python launch.py --config=configs/overflow_demo.py --config.data.dir=../shared/data/mnist \
      --workdir=runs/overflow --advise
"""

import ml_collections

from trainer import config as config_lib


def get_config():
  config = config_lib.defaults()
  config.model = 'overflow_demo'
  config.train.batch_size = 128
  config.train.steps = 300
  config.train.steps_per_loop = 50
  config.train.log_every = 50
  config.train.checkpoint_every = 300
  config.precision.policy = 'mixed_float16'
  config.model_config = ml_collections.ConfigDict()
  config.model_config.overflow = 'forward'  # forward, backward or none
  return config
