"""Whether a memory-saving option can pay off for this model: one line at build when it cannot.

16-bit master weights (`precision.master_weights`) and 8-bit optimizer state
(`optimizer.state_bits=8`) save memory per parameter, and cost a fixed amount for the code that
does it (compiled update calls, rounding and quantization kernels, their buffers) plus CPU time
per step. The rule: the bytes a model's parameters save must exceed that fixed cost, measured as
the rise in peak RSS on the MNIST MLP (101,770 parameters, saving under 1 MiB), 40 steps through
launch.py, each option against the run without it (docs/results/memory.md, "The fixed cost"):

  optimizer.state_bits=8 (float32)            770 -> 927 MiB and 773 -> 921 MiB
  master_weights='bfloat16_sr' (mixed_bf16)   775 -> 854 MiB

The smaller rise of each is FIXED_MIB, so the line errs towards silence (the small CNN rose by
207 and 71 MiB); it is taken not to grow with the model (code and compiled calls, not
per-parameter buffers): not measured on a larger one. Bytes saved per parameter, from
trainer/optim/low_precision.py's layouts: 8-bit Adam moments take 1 + 4/256 bytes per element
instead of 4, two moments; bfloat16 masters store the weight and each slot in 2 bytes instead of
4, minus the 2-byte compensation buffer of 'bfloat16_kahan'.
"""

from __future__ import annotations

import ml_collections
import numpy as np

MIB = 2**20
FIXED_MIB = {'state_bits': 147, 'master_weights': 79}  # measured: the module docstring
SLOTS = {'adam': 2, 'adamw': 2, 'sgd': 1}  # moments, or momentum (SGD with momentum > 0)


def saved_bytes_per_parameter(option: str, config: ml_collections.ConfigDict) -> float:
  """Bytes of memory one parameter saves under `option` ('state_bits' or 'master_weights')."""
  name = str(config.optimizer.name)
  slots = SLOTS.get(name, 0)
  if name == 'sgd' and not float(config.optimizer.get('momentum', 0.0)):
    slots = 0
  if option == 'state_bits':
    return 2 * (4 - (1 + 4 / 256))
  fp32_slots = slots if int(config.optimizer.state_bits) == 32 else 0  # 8-bit slots stay 8-bit
  compensation = 2 if config.precision.master_weights == 'bfloat16_kahan' else 0
  return 2 * (1 + fp32_slots) - compensation


def requested(config: ml_collections.ConfigDict) -> list[str]:
  """The memory options the config asks for, by their config key."""
  found = []
  if config.precision.master_weights != 'float32':
    found.append('master_weights')
  if int(config.optimizer.state_bits) != 32:
    found.append('state_bits')
  return found


KEYS = {
  'state_bits': lambda c: f'config.optimizer.state_bits={c.optimizer.state_bits}',
  'master_weights': lambda c: f'config.precision.master_weights={c.precision.master_weights!r}',
}


def lines(config: ml_collections.ConfigDict, parameters: int) -> list[str]:
  """One line per requested option that cannot pay off for a model of `parameters` trainable
  parameters: what it saves is less than what it costs (FIXED_MIB)."""
  found = []
  for option in requested(config):
    per = saved_bytes_per_parameter(option, config)
    saved, fixed = parameters * per, FIXED_MIB[option] * MIB
    if saved >= fixed:
      continue
    found.append(
      f'{KEYS[option](config)} cannot pay off for this model: its {parameters:,} parameters '
      f'save {saved / MIB:.1f} MiB, less than the about {FIXED_MIB[option]} MiB of peak memory '
      'the option itself adds (measured on the MNIST MLP: trainer/step/payoff.py), and every '
      f'step costs more CPU; it pays off above about {fixed / per / 1e6:.0f}M parameters'
      if per > 0
      else f'{KEYS[option](config)} cannot pay off for this model: it saves no memory here'
    )
  return found


def parameters(model) -> int:
  """The model's trainable parameters."""
  return int(sum(np.prod(v.shape) for v in model.trainable_variables))
