"""'auto' on a CPU with bfloat16 arithmetic: mixed_bfloat16 only where the model's matmuls are
wide enough to pay (trainer/step/precision.py), measured on a model built and dropped without a
trace."""

import keras
import pytest

from trainer.step import precision


def _mlp(widths):
  inputs = keras.Input((widths[0],))
  x = inputs
  for w in widths[1:]:
    x = keras.layers.Dense(w)(x)
  return keras.Model(inputs, x)


def test_matmul_width_is_the_parameter_weighted_median_of_the_smaller_sides():
  # Kernels [784, 512] (401k parameters, side 512), [512, 64] (33k, side 64), [64, 10] (640,
  # side 10): the median parameter lies in the first.
  assert precision.matmul_width(_mlp([784, 512, 64, 10])) == 512
  # [32, 1024] (33k, side 32) and [1024, 8] (8k, side 8): the 32-wide one.
  assert precision.matmul_width(_mlp([32, 1024, 8])) == 32
  conv = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.Conv2D(300, 3)])
  assert precision.matmul_width(conv) == 27  # a 3x3x3 patch per output: K = 27 < N = 300
  assert precision.matmul_width(keras.Sequential([keras.Input((4,)), keras.layers.Softmax()])) == 0


@pytest.mark.parametrize(
  'flags, width, policy',
  [
    ({'avx512_bf16'}, 512, 'mixed_bfloat16'),
    ({'amx_bf16'}, 256, 'mixed_bfloat16'),
    ({'avx512_bf16'}, 128, 'float32'),
    ({'avx2'}, 4096, 'float32'),
  ],
)
def test_auto_on_a_cpu_follows_the_flags_and_the_width(monkeypatch, flags, width, policy):
  asked = []
  monkeypatch.setattr(precision, 'cpu_flags', lambda: frozenset(flags))
  got, reason = precision.resolve('auto', lambda: asked.append(1) or width)
  assert got == policy
  assert asked == ([1] if flags & {'avx512_bf16', 'amx_bf16'} else [])  # measured only then
  if asked:
    assert f'{width} wide' in reason


def test_the_probe_leaves_names_policy_and_initial_weights_as_they_were():
  from keras.src.backend.common import global_state

  keras.config.set_dtype_policy('mixed_bfloat16')
  _mlp([16, 300, 4])  # a model built before: the counters are not empty
  names = dict(global_state.get_global_attribute('object_name_uids'))
  assert precision.probe_width(lambda: _mlp([16, 300, 4]), seed=7) == 16
  assert dict(global_state.get_global_attribute('object_name_uids')) == names
  assert keras.config.dtype_policy().name == 'mixed_bfloat16'
  after_probe = _mlp([16, 300, 4])
  keras.utils.set_random_seed(7)
  fresh = _mlp([16, 300, 4])  # what the run would build with the seed set and no probe
  assert (after_probe.layers[1].kernel.numpy() == fresh.layers[1].kernel.numpy()).all()
  assert after_probe.layers[1].compute_dtype == 'bfloat16'
