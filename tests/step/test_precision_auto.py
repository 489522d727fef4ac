"""'auto' on a CPU with bfloat16 arithmetic: mixed_bfloat16, except where the config turns XLA on
for float32 runs (XLA computes a CPU's bfloat16 matmuls in float32, so the two do not pair):
float32 with XLA there (trainer/step/precision.py)."""

import pytest

from trainer.run import build
from trainer.step import precision


@pytest.mark.parametrize(
  'flags, float32_xla, policy',
  [
    ({'avx512_bf16'}, False, 'mixed_bfloat16'),
    ({'amx_bf16'}, False, 'mixed_bfloat16'),
    ({'avx512_bf16'}, True, 'float32'),
    ({'avx2'}, False, 'float32'),
    ({'avx2'}, True, 'float32'),
  ],
)
def test_auto_on_a_cpu_follows_the_flags_and_the_xla_setting(
  monkeypatch, flags, float32_xla, policy
):
  monkeypatch.setattr(precision, 'cpu_flags', lambda: frozenset(flags))
  got, reason = precision.resolve('auto', float32_xla)
  assert got == policy
  if float32_xla and flags & {'avx512_bf16', 'amx_bf16'}:
    assert 'XLA on for float32' in reason and '--race' in reason
  assert precision.resolve('mixed_float16', float32_xla)[0] == 'mixed_float16'  # set: kept


@pytest.mark.parametrize(
  'setting, float32_xla',
  [('auto', False), ('true', True), ('false', False), ('float32', True), ('mixed_bfloat16', False)],
)
def test_the_xla_setting_read_for_float32_on_a_cpu(setting, float32_xla, caplog):
  assert build._xla(setting, 'float32')[0] is float32_xla
  with caplog.at_level('INFO'):
    on = build.jit(setting, 'mixed_bfloat16')
  warned = [r for r in caplog.records if r.levelname == 'WARNING']
  # XLA on under bfloat16 on a CPU is the user's explicit choice: kept, with a warning.
  assert bool(warned) is on and (
    not warned or 'bfloat16 matmuls in float32' in warned[0].getMessage()
  )
