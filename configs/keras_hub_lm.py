"""A randomly initialised KerasHub GPT-2 (2 decoder layers, hidden 128) on Tiny Shakespeare
characters (models/keras_hub_lm.py; needs `pip install -e '.[keras-hub]'`).

Command:
  python launch.py --config=configs/keras_hub_lm.py \
      --config.data.dir=../shared/data/tinyshakespeare --workdir=runs/keras_hub_lm

Starts from configs/shakespeare.py (data, schedule, optimizer) and sets what differs.
"""

import ml_collections

from configs import shakespeare


def get_config():
  config = shakespeare.get_config()
  config.model = 'keras_hub_lm'
  config.model_config = ml_collections.ConfigDict()
  config.model_config.context = 128  # characters seen per prediction
  config.model_config.hidden_dim = 128
  config.model_config.num_layers = 2
  config.model_config.num_heads = 4
  config.model_config.intermediate_dim = 512  # the feedforward width
  config.model_config.dropout = 0.0
  config.model_config.val_fraction = 0.1
  return config
