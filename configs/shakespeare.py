"""Character-level Transformer LM on Tiny Shakespeare (models/transformer_lm.py).

Command:
  python launch.py --config=configs/shakespeare.py \
      --config.data.dir=../shared/data/tinyshakespeare --workdir=runs/shakespeare
  python -m models.transformer_lm --workdir=runs/shakespeare --prompt='ROMEO:'

Target: validation loss <= 1.70 nats/char within 20 minutes on a 2-core CPU in mixed_bfloat16.
Measured (seed 0, quiet 2-core AVX512-BF16 CPU): 1.623 at step 750, 6 minutes from launch.
Starts from the schema's defaults (configs/mnist.py documents every key) and sets what differs.
"""

import ml_collections

from trainer import config as config_lib


def get_config():
  config = config_lib.defaults()
  config.model = 'transformer_lm'
  config.data.dir = ''  # folder holding input.txt; '' downloads it

  config.model_config = ml_collections.ConfigDict()
  config.model_config.context = 128  # characters seen per prediction
  config.model_config.d_model = 128  # width of the residual stream
  config.model_config.num_heads = 4
  config.model_config.num_layers = 4
  config.model_config.mlp_ratio = 4  # MLP hidden width = mlp_ratio * d_model
  config.model_config.dropout = 0.0  # a 20-minute run underfits: no dropout
  config.model_config.val_fraction = 0.1  # the last 10 % of the characters

  config.train.batch_size = 64  # sequences of `context` characters per step
  config.train.steps = 750  # 6 minutes at 2.3 steps/s on 2 quiet CPU cores (docs/results.md)
  config.train.steps_per_loop = 50
  config.train.log_every = 50
  config.train.eval_every = 250  # a full pass over the validation split (~870 windows)
  config.train.checkpoint_every = 250

  config.optimizer.name = 'adamw'
  config.optimizer.learning_rate = 3e-3  # peak rate
  config.optimizer.schedule = 'cosine'  # decays to 0 at the last step
  config.optimizer.warmup_steps = 100
  config.optimizer.weight_decay = 0.01  # decoupled
  config.optimizer.clip_norm = 1.0  # global norm of the unscaled gradients

  config.precision.policy = 'mixed_bfloat16'
  return config
