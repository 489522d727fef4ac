"""MNIST CNN: 5 epochs, Adam with cosine decay, policy picked from the hardware.

Command:
  python launch.py --config=configs/mnist.py --config.data.dir=../shared/data/mnist

Expected on a 2-core CPU with AVX512_BF16 (measured, seed 0): test accuracy 99.08 % in about
1 minute (policy 'auto' = mixed_bfloat16); with --config.precision.policy=mixed_float16
99.09 % in about 4.3 minutes (float16 is emulated on a CPU).
"""

import ml_collections


def get_config():
  config = ml_collections.ConfigDict()
  config.model = 'mnist_cnn'  # module in models/ holding the Trainer subclass
  config.seed = 0  # seeds Python, NumPy, TF and the input pipeline

  config.data = ml_collections.ConfigDict()
  config.data.dir = ''  # folder with the four MNIST IDX .gz files; '' downloads them

  config.train = ml_collections.ConfigDict()
  config.train.batch_size = 128  # global batch, split across replicas
  config.train.epochs = 5  # length of training, unless train.steps > 0
  config.train.steps = 0  # total optimizer steps (applied or skipped) when > 0
  config.train.steps_per_loop = 100  # steps per compiled call; host work happens between calls
  config.train.log_every = 100  # progress line and TensorBoard scalars, in steps
  config.train.eval_every = 0  # eval during training, in steps; 0 = only at the end
  config.train.checkpoint_every = 500  # in steps; also at the end
  config.train.eval_max_batches = 0  # an eval set of more batches is an error; 0 = no bound
  config.train.max_to_keep = 3  # checkpoints kept
  config.train.jit_compile = 'auto'  # XLA for the per-replica step: auto = on for GPU/TPU
  config.train.grappler = 'auto'  # TensorFlow's graph optimizer on the loops: auto = on for GPU/TPU
  config.train.intra_op_threads = 0  # TF's pool splitting one op; 0 = TF's choice
  config.train.inter_op_threads = 0  # TF's pool running independent ops; 0 = TF's choice
  config.train.deterministic = False  # op determinism (slower); resumed runs bit-identical
  config.train.grad_accum_steps = 1  # micro-batches per step (batch_size must be a multiple)
  config.train.init_from = ''  # another run's workdir: start from its model weights
  config.train.remat = False  # gradient checkpointing of the blocks a model marks
  config.train.profile_steps = ''  # e.g. '100,120': TF profiler trace into the TensorBoard dir
  config.train.accept_config_change = False  # resume a run with a config that changed
  config.train.async_checkpoint = False  # write checkpoints in a background thread
  config.train.recover_tries = 0  # restore the last healthy checkpoint on a collapse; 0 = stop
  config.train.recover_lr_factor = 1.0  # learning rate x this at each recovery

  config.optimizer = ml_collections.ConfigDict()
  config.optimizer.name = 'adam'  # adam, adamw or sgd
  config.optimizer.learning_rate = 1e-3  # peak rate
  config.optimizer.schedule = 'cosine'  # constant or cosine (decays to the floor at the last step)
  config.optimizer.min_learning_rate = 0.0  # cosine's floor, reached at the last step
  config.optimizer.warmup_steps = 0  # linear warm-up from 0 to the peak
  config.optimizer.weight_decay = 0.0  # decoupled weight decay
  config.optimizer.clip_norm = 0.0  # global-norm clipping of the unscaled gradients; 0 = off
  config.optimizer.momentum = 0.9  # sgd only
  config.optimizer.beta_1 = 0.9  # adam/adamw: first-moment decay
  config.optimizer.beta_2 = 0.999  # adam/adamw: second-moment decay
  config.optimizer.epsilon = 1e-7  # adam/adamw: Keras's default (PyTorch's is 1e-8)
  config.optimizer.fused = True  # fused TF kernels in the update; False = Keras's own ops
  config.optimizer.state_bits = 32  # 8: Adam/AdamW moments block-wise quantized to one byte

  config.precision = ml_collections.ConfigDict()
  config.precision.policy = 'auto'  # float32, mixed_float16, mixed_bfloat16 or auto
  config.precision.loss_scale = 'auto'  # auto (dynamic under mixed_float16), none, dynamic, '128'
  config.precision.initial_scale = 32768.0  # first dynamic scale
  config.precision.growth_interval = 2000  # finite steps in a row before the scale grows
  config.precision.growth_factor = 2.0  # scale x this on growth
  config.precision.backoff_factor = 0.5  # scale x this on a non-finite step
  config.precision.min_scale = 1.0  # the scale never backs off below this
  config.precision.max_scale = 16777216.0  # the scale never grows above this (2**24)
  config.precision.hysteresis = 1  # non-finite steps in a row before backing off
  # float8 recipe of the Dense layers: 'none', 'delayed' (Keras's model.quantize('float8')),
  # 'tensorwise', 'rowwise', 'mxfp8' or 'mxfp8_rceil' (docs/guides/float8.md); True = 'delayed'
  config.precision.float8 = 'none'
  config.precision.float8_layers = ''  # only these layers in float8; '' = every one that fits
  config.precision.float8_skip = ''  # these layers not in float8
  config.precision.float32_layers = ''  # e.g. 'dense,conv2d': layers kept float32 (--advise)
  config.precision.master_weights = 'float32'  # or bfloat16_sr / bfloat16_kahan (mixed_bfloat16)
  config.precision.max_consecutive_skips = 50  # skipped steps in a row that stop the run; 0 = off
  config.precision.allow_low_precision_variables = False  # float16/bfloat16 weights allowed

  config.distribute = ml_collections.ConfigDict()
  config.distribute.strategy = 'default'  # default, mirrored, multi_worker (TF_CONFIG) or tpu
  config.distribute.devices = ''  # mirrored: e.g. 'GPU:0,GPU:1'; '' = all local GPUs
  config.distribute.tpu = ''  # tpu: TPU name or 'grpc://host:port'; '' = this host's TPU

  config.numerics = ml_collections.ConfigDict()
  config.numerics.every = 1000  # per-layer underflow/headroom statistics, in steps; 0 = off
  config.numerics.forensics_first = 3  # the first skipped steps replayed to name the layer
  config.numerics.forensics_every = 100  # then every 100th skip; both 0 = off
  config.numerics.divergence_factor = 10.0  # warn when the loss passes 10x its running minimum
  config.numerics.divergence_stop = False  # True: divergence also ends the run (exit status 3)

  config.early_stopping = ml_collections.ConfigDict()
  config.early_stopping.metric = ''  # eval metric to stop on (needs train.eval_every); '' = off
  config.early_stopping.mode = 'auto'  # min, max, or auto (min for losses, max otherwise)
  config.early_stopping.patience = 3  # evals without improvement before stopping
  config.early_stopping.min_delta = 0.0  # smallest change that counts as an improvement

  config.best_checkpoint = ml_collections.ConfigDict()
  config.best_checkpoint.metric = ''  # keep the best eval's weights in <workdir>/best; '' = off
  config.best_checkpoint.mode = 'auto'  # min, max, or auto

  config.debug = ml_collections.ConfigDict()
  config.debug.inject_nonfinite_every = 0  # make every N-th step's gradients inf; 0 = off
  config.debug.inject_nonfinite_steps = ''  # e.g. '10,11': global steps made non-finite
  config.debug.inject_nonfinite_replica = -1  # replica whose gradients are poisoned; -1 = all
  return config
