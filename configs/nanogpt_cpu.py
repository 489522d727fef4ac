"""nanoGPT's CPU recipe (karpathy/nanoGPT README, "I only have a macbook") on our trainer.

Published: validation loss 1.88 (nanoGPT README: "our validation loss is 1.88" after 2000
iterations of `python train.py config/train_shakespeare_char.py --device=cpu --compile=False
--eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4
--n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0`). nanoGPT estimates it from
20 random batches of 12 windows of the validation split (eval_iters=20); our trainer evaluates
the whole split. benchmarks/references.py reports both. Evaluation work: nanoGPT's recipe
evaluates 9 times (iterations 0, 250, ..., 2000) on 20 batches of each split, 360 forward
batches; ours once, at the end, 146 batches (the validation split): less, so whole-process
timings against nanoGPT's train.py do not charge ours extra evaluation (docs/references.md).
The recipe: train_shakespeare_char.py's AdamW (lr 1e-3, beta2 0.99, 100 warm-up steps, cosine to
min_lr 1e-4 at step 2000) with train.py's weight decay 0.1 and clip 1.0, PyTorch's epsilon 1e-8.
The model is ours (models/transformer_lm.py: untied embeddings, biases, learned positions), the
same shape as nanoGPT's: 4 layers, 4 heads, width 128, context 64, MLP 4x; the data split is the
same (character ids, the last 10 % is validation).

Command:
  python launch.py --config=configs/nanogpt_cpu.py \
      --config.data.dir=../shared/data/tinyshakespeare [--config.precision.policy=mixed_bfloat16]
  python -m benchmarks.references --only=nanogpt_cpu    # every policy, both evaluations

Measured (seed 0, `python -m benchmarks.references --only=nanogpt_cpu`, 2026-11-24, a quiet
2-core CPU; docs/references.md has the table): validation loss, nanoGPT's 20-batch estimate /
the full split (mixed_bfloat16 the same with XLA on and off):
  float32 1.790 / 1.784;  mixed_bfloat16 1.790 / 1.784;  mixed_float16 (dynamic) 1.790 / 1.784,
i.e. 0.09 below the published 1.88 in every policy. Our model is not nanoGPT's (untied
embeddings, biases, Keras's Glorot init), so the comparison is of recipes, not of code.
"""

import ml_collections

from trainer import config as config_lib


def get_config():
  config = config_lib.defaults()
  config.model = 'transformer_lm'
  config.data.dir = ''  # folder holding input.txt; '' downloads it

  config.model_config = ml_collections.ConfigDict()
  config.model_config.context = 64  # --block_size=64
  config.model_config.d_model = 128  # --n_embd=128
  config.model_config.num_heads = 4  # --n_head=4
  config.model_config.num_layers = 4  # --n_layer=4
  config.model_config.mlp_ratio = 4  # nanoGPT's MLP is 4 x n_embd
  config.model_config.dropout = 0.0  # --dropout=0.0
  config.model_config.val_fraction = 0.1  # nanoGPT's prepare.py: the last 10 % is val

  config.train.batch_size = 12  # --batch_size=12
  config.train.steps = 2000  # --max_iters=2000
  config.train.steps_per_loop = 100
  config.train.log_every = 100
  config.train.eval_every = 0  # once, at the end
  config.train.checkpoint_every = 2000

  config.optimizer.name = 'adamw'
  config.optimizer.learning_rate = 1e-3
  config.optimizer.schedule = 'cosine'
  config.optimizer.min_learning_rate = 1e-4  # min_lr, reached at --lr_decay_iters=2000
  config.optimizer.warmup_steps = 100  # warmup_iters
  config.optimizer.weight_decay = 0.1
  config.optimizer.clip_norm = 1.0  # grad_clip
  config.optimizer.beta_1 = 0.9
  config.optimizer.beta_2 = 0.99  # "make a bit bigger because number of tokens per iter is small"
  config.optimizer.epsilon = 1e-8  # torch.optim.AdamW's default

  config.precision.policy = 'float32'
  # XLA for float32 runs only. With oneDNN's kernels on (trainer/onednn.py), XLA's compiled
  # float32 step at this shape is faster than the uncompiled one (`python -m
  # benchmarks.peer_nanogpt` races `ours+train.jit_compile=false` against the config;
  # docs/references.md links the pages). Under mixed_bfloat16 XLA's CPU backend computes the
  # matmuls in float32 (its optimized HLO holds float32 dots only): the policy's casts would
  # remain, its arithmetic would not, so bfloat16 runs go without XLA, and `auto` picks float32
  # with XLA here (trainer/step/precision.py).
  config.train.jit_compile = 'float32'
  return config
