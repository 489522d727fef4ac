"""A larger character-level Transformer LM on Tiny Shakespeare, where mixed precision matters:
d_model 512 and context 256 (models/transformer_lm.py), about 12.6 M parameters.

Command:
  python launch.py --config=configs/shakespeare_large.py \
      --config.data.dir=../shared/data/tinyshakespeare --workdir=runs/shakespeare_large

Sized so that a run fits in 20 minutes on a 2-core AVX512-BF16 CPU in mixed_bfloat16. Expected
result: validation loss about 2.4 (docs/guides/memory.md): in that time the wider model does not get
past learning character frequencies, so this config is for measuring speed and memory where mixed
precision matters; configs/shakespeare.py gives the better model on a CPU. Starts from
configs/shakespeare.py and sets what differs. With train.remat=True the blocks recompute their
activations (less memory, more compute); batch 32 does not need it.
"""

from configs import shakespeare


def get_config():
  config = shakespeare.get_config()
  config.model_config.context = 256
  config.model_config.d_model = 512
  config.model_config.num_heads = 8
  config.model_config.num_layers = 4

  config.train.batch_size = 32
  config.train.steps = 240
  config.train.steps_per_loop = 20
  config.train.log_every = 20
  config.train.eval_every = 120  # a full pass over the validation split (~435 windows)
  config.train.checkpoint_every = 120

  config.optimizer.learning_rate = 1e-3  # wider model: a lower peak than the small one's 3e-3
  config.optimizer.warmup_steps = 30
  return config
