"""A memory option that cannot pay off for the model says so in one line at build (issue 35: on a
small CNN, 16-bit masters and 8-bit state raised peak RSS by 71 and 207 MiB, and its CPU time,
with no word)."""

from absl import logging

from tiny import TinyTrainer, tiny_config
from trainer.step import payoff


def test_the_rule():
  small = tiny_config(**{'optimizer.state_bits': 8})
  (line,) = payoff.lines(small, 101_770)  # the MNIST MLP
  assert line.startswith('config.optimizer.state_bits=8 cannot pay off for this model: its ')
  assert '101,770 parameters save 0.6 MiB, less than the about 147 MiB' in line
  assert line.endswith('it pays off above about 26M parameters')
  assert payoff.lines(small, 50_000_000) == []  # 285 MiB saved
  # Kahan masters with plain SGD: the compensation buffer takes what the weight saves.
  sgd = tiny_config(
    **{
      'precision.policy': 'mixed_bfloat16',
      'precision.master_weights': 'bfloat16_kahan',
      'optimizer.name': 'sgd',
      'optimizer.momentum': 0.0,
    }
  )
  assert payoff.saved_bytes_per_parameter('master_weights', sgd) == 0
  assert payoff.lines(sgd, 10**9) == [
    "config.precision.master_weights='bfloat16_kahan' cannot pay off for this model: it saves "
    'no memory here'
  ]
  assert payoff.lines(tiny_config(), 100) == []  # nothing asked for


def test_one_line_at_build(tmp_path, monkeypatch):
  lines = []
  monkeypatch.setattr(logging, 'warning', lambda msg, *args: lines.append(msg % args))
  TinyTrainer(tiny_config(**{'optimizer.state_bits': 8}), str(tmp_path))
  found = [l for l in lines if 'cannot pay off' in l]
  assert len(found) == 1 and 'its 212 parameters save 0.0 MiB' in found[0], lines
