"""The PyTorch side of benchmarks/peer_torch.py: our own PyTorch model of models/transformer_lm.py,
trained the way our trainer trains it. Runs in PyTorch's own virtual environment (no TensorFlow
there, none of this repository's packages imported):

  /work/torchvenv/bin/python benchmarks/peer_torch_model.py '<json settings>'

and prints one JSON line of figures. The settings (hyperparameters, data path, precision) come
from the same validated config our trainer runs (benchmarks/peer_torch.py builds them).

The same model as models/transformer_lm.py, layer for layer: token and learned position
embeddings (untied, normal(0, 0.02)); pre-norm blocks x + attn(LN(x)), x + W2 gelu(W1 LN(x))
with LayerNorm eps 1e-5, one fused qkv projection and an output projection (biases, Glorot
uniform kernels, zero biases; a [d, 3d] kernel's Glorot limit is the same as PyTorch's
xavier_uniform_ on the [3d, d] weight), exact GELU, causal softmax attention with 1/sqrt(depth)
scaling; a final LayerNorm and a Glorot-initialised Linear to the vocabulary, with bias.
Training as ours: AdamW on every parameter (Keras's AdamW decays every variable; so does this),
global-norm clipping, warm-up factor min(1, (step + 1) / warmup) times a cosine from the peak to
the floor over the steps after warm-up, windows at uniformly random offsets of the train split;
the loss is the mean per-character cross-entropy in float32. Evaluation as ours: every
non-overlapping window of the validation split once, the mean over windows of their mean
per-character loss. bfloat16: torch.autocast('cpu', torch.bfloat16) around the forward pass and
the loss (float32 master weights), in training and evaluation; the logits are cast to float32
before the cross-entropy. Eager mode unless the settings say 'compile': then the model is
`torch.compile(model)` (inductor, its CPU C++ backend), compiled at the first step, which is timed
apart ('first_step_s'); 'steady_ms' is the mean step after the first.

Lockstep (benchmarks/peer_lockstep.py): settings 'init' (an .npz of this model's state_dict,
exported from ours) and 'windows' (an .npy [steps, batch, context + 1] of the training windows,
one batch per step) start from our initial weights and train on our batches; 'keras_epsilon'
adds epsilon as Keras's Adam does (to sqrt(v) before the bias correction: PyTorch's epsilon
divided by sqrt(1 - beta_2^t) each step); 'losses': every step's training loss is reported.
"""

import json
import math
import resource
import sys
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


def load_corpus(path, val_fraction):
  """Character ids over the sorted set of the text's characters; the last val_fraction is
  validation (trainer/data/shakespeare.py's split, restated)."""
  with open(path, encoding='utf-8') as f:
    text = f.read()
  vocab = sorted(set(text))
  index = {c: i for i, c in enumerate(vocab)}
  ids = np.array([index[c] for c in text], dtype=np.int64)
  split = len(ids) - int(round(len(ids) * val_fraction))
  return len(vocab), ids[:split], ids[split:]


def _glorot_linear(d_in, d_out):
  layer = nn.Linear(d_in, d_out)
  nn.init.xavier_uniform_(layer.weight)
  nn.init.zeros_(layer.bias)
  return layer


class Block(nn.Module):
  def __init__(self, d, heads, mlp_ratio):
    super().__init__()
    self.heads = heads
    self.ln1, self.ln2 = nn.LayerNorm(d, eps=1e-5), nn.LayerNorm(d, eps=1e-5)
    self.qkv, self.proj = _glorot_linear(d, 3 * d), _glorot_linear(d, d)
    self.mlp_in, self.mlp_out = _glorot_linear(d, mlp_ratio * d), _glorot_linear(mlp_ratio * d, d)

  def forward(self, x):
    b, t, d = x.shape
    qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [b, heads, t, depth]
    h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + self.proj(h.transpose(1, 2).reshape(b, t, d))
    return x + self.mlp_out(F.gelu(self.mlp_in(self.ln2(x))))


class TransformerLm(nn.Module):
  def __init__(self, vocab, context, d, heads, layers, mlp_ratio):
    super().__init__()
    self.tokens, self.positions = nn.Embedding(vocab, d), nn.Embedding(context, d)
    nn.init.normal_(self.tokens.weight, std=0.02)
    nn.init.normal_(self.positions.weight, std=0.02)
    self.blocks = nn.ModuleList(Block(d, heads, mlp_ratio) for _ in range(layers))
    self.ln = nn.LayerNorm(d, eps=1e-5)
    self.logits = _glorot_linear(d, vocab)

  def forward(self, ids):
    x = self.tokens(ids) + self.positions.weight[: ids.shape[1]][None]
    for block in self.blocks:
      x = block(x)
    return self.logits(self.ln(x))


def per_sequence_loss(model, x, y, bf16):
  with torch.autocast('cpu', dtype=torch.bfloat16, enabled=bf16):
    logits = model(x)
  losses = F.cross_entropy(logits.float().transpose(1, 2), y, reduction='none')  # [b, t]
  return losses.mean(-1)


def learning_rate(step, s):
  rate = s['learning_rate']
  if s['schedule'] == 'cosine':
    progress = min(max((step - s['warmup']) / max(s['steps'] - s['warmup'], 1), 0.0), 1.0)
    floor = s['min_learning_rate']
    rate = floor + 0.5 * (s['learning_rate'] - floor) * (1 + math.cos(math.pi * progress))
  if s['warmup'] > 0:
    rate *= min(1.0, (step + 1) / s['warmup'])
  return rate


def main(settings):
  s = settings
  torch.manual_seed(s['seed'])
  if s.get('threads'):
    torch.set_num_threads(s['threads'])
  vocab, train, val = load_corpus(s['data'], s['val_fraction'])
  context, batch, bf16 = s['context'], s['batch_size'], s['precision'] == 'bfloat16'
  model = TransformerLm(
    vocab, context, s['d_model'], s['num_heads'], s['num_layers'], s['mlp_ratio']
  )
  optimizer = torch.optim.AdamW(
    model.parameters(),
    lr=s['learning_rate'],
    betas=(s['beta_1'], s['beta_2']),
    eps=s['epsilon'],
    weight_decay=s['weight_decay'],
  )
  if s.get('init'):
    with np.load(s['init']) as weights:
      model.load_state_dict({k: torch.from_numpy(weights[k]) for k in weights.files})
  if s.get('compile'):
    model = torch.compile(model)  # compiles at the first call (the first step)
  fixed = torch.from_numpy(np.load(s['windows']).astype(np.int64)) if s.get('windows') else None
  train_t = torch.from_numpy(train)
  offsets = torch.arange(context + 1)
  generator = torch.Generator().manual_seed(s['seed'])
  losses = []

  wall0, cpu0 = time.perf_counter(), time.process_time()
  model.train()
  for step in range(s['steps']):
    if fixed is None:
      starts = torch.randint(0, len(train) - context, (batch,), generator=generator)
      windows = train_t[starts[:, None] + offsets[None]]
    else:
      windows = fixed[step]
    for group in optimizer.param_groups:
      group['lr'] = learning_rate(step, s)
      if s.get('keras_epsilon'):
        group['eps'] = s['epsilon'] / math.sqrt(1 - s['beta_2'] ** (step + 1))
    loss = per_sequence_loss(model, windows[:, :-1], windows[:, 1:], bf16).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if s['clip_norm'] > 0:
      torch.nn.utils.clip_grad_norm_(model.parameters(), s['clip_norm'])
    optimizer.step()
    if s.get('losses'):
      losses.append(float(loss))
    if step == 0:
      first_step = time.perf_counter() - wall0
  train_wall, train_cpu = time.perf_counter() - wall0, time.process_time() - cpu0

  wall0, cpu0 = time.perf_counter(), time.process_time()
  model.eval()
  starts = np.arange(0, len(val) - (context + 1) + 1, context)
  windows = torch.from_numpy(val[starts[:, None] + np.arange(context + 1)[None]])
  total = 0.0
  with torch.no_grad():
    for i in range(0, len(windows), batch):
      w = windows[i : i + batch]
      total += float(per_sequence_loss(model, w[:, :-1], w[:, 1:], bf16).sum())
  eval_wall, eval_cpu = time.perf_counter() - wall0, time.process_time() - cpu0
  usage = resource.getrusage(resource.RUSAGE_SELF)
  print(
    json.dumps(
      {
        'side': 'torch',
        'val_loss': total / len(windows),
        'last_train_loss': float(loss),
        'train_wall_s': train_wall,
        'train_cpu_s': train_cpu,
        'eval_wall_s': eval_wall,
        'eval_cpu_s': eval_cpu,
        'steps': s['steps'],
        'torch': torch.__version__,
        'threads': torch.get_num_threads(),
        'interop_threads': torch.get_num_interop_threads(),
        'compile': bool(s.get('compile')),
        'first_step_s': first_step,
        'steady_ms': 1000 * (train_wall - first_step) / max(s['steps'] - 1, 1),
        'parameters': sum(p.numel() for p in model.parameters()),
        'peak_rss_mib': usage.ru_maxrss / 1024,
        'losses': losses,
      }
    ),
    flush=True,
  )


if __name__ == '__main__':
  main(json.loads(sys.argv[1]))
