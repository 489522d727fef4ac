"""trainer/optim/fused_optimizers.py: the fused updates equal Keras's own, step after step."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from trainer.optim import fused_optimizers

CASES = {
  'adam': (keras.optimizers.Adam, fused_optimizers.FusedAdam, {}),
  'adam_weight_decay': (keras.optimizers.Adam, fused_optimizers.FusedAdam, {'weight_decay': 0.1}),
  'adamw': (keras.optimizers.AdamW, fused_optimizers.FusedAdamW, {'weight_decay': 0.05}),
  'sgd': (keras.optimizers.SGD, fused_optimizers.FusedSGD, {}),
  'momentum': (keras.optimizers.SGD, fused_optimizers.FusedSGD, {'momentum': 0.9}),
  'nesterov': (
    keras.optimizers.SGD,
    fused_optimizers.FusedSGD,
    {'momentum': 0.9, 'nesterov': True},
  ),
}
KERNELS = {'ResourceApplyAdagradV2', 'ResourceApplyKerasMomentum', 'ResourceApplyGradientDescent'}


def _train(optimizer_class, kwargs, steps=6, sparse=False, rows=(3, 7, 120, 299)):
  """`steps` compiled updates of two variables from fixed random gradients; returns the
  variables, the optimizer's slots and the op types of the traced update. sparse='slices'
  passes the first gradient as IndexedSlices of `rows`, sparse='dense' as the dense tensor the
  slices make (duplicate rows summed)."""
  rng = np.random.RandomState(0)
  variables = [
    tf.Variable(rng.randn(300, 40).astype(np.float32)),
    tf.Variable(rng.randn(40).astype(np.float32)),
  ]
  optimizer = optimizer_class(learning_rate=0.01, **kwargs)
  optimizer.build(variables)

  @tf.function
  def step(g0, g1, rows):
    if sparse:  # an embedding-style gradient: a few rows of the first variable
      g0 = tf.IndexedSlices(tf.gather(g0, rows), rows, tf.shape(g0, out_type=tf.int64))
      if sparse == 'dense':
        g0 = tf.convert_to_tensor(g0)
    optimizer.apply_gradients([(g0, variables[0]), (g1, variables[1])])

  for _ in range(steps):
    step(
      tf.constant(rng.randn(300, 40).astype(np.float32)),
      tf.constant(rng.randn(40).astype(np.float32)),
      tf.constant(rows, tf.int64),
    )
  graph = step.get_concrete_function(
    tf.TensorSpec([300, 40]), tf.TensorSpec([40]), tf.TensorSpec([4], tf.int64)
  ).graph
  ops = {op.type for op in graph.get_operations()}
  for function in graph.as_graph_def().library.function:
    ops |= {node.op for node in function.node_def}
  return ([v.numpy() for v in variables], [v.numpy() for v in optimizer.variables], ops)


@pytest.mark.parametrize('case', sorted(CASES))
@pytest.mark.parametrize('sparse', [False, 'slices'])
def test_fused_update_equals_keras(case, sparse):
  keras_class, fused_class, kwargs = CASES[case]
  ref_vars, ref_slots, ref_ops = _train(keras_class, kwargs, sparse=sparse)
  vars_, slots, ops = _train(fused_class, kwargs, sparse=sparse)
  assert ops & KERNELS and not ref_ops & KERNELS  # the fused kernel ran, Keras's did not
  initial = np.random.RandomState(0).randn(300, 40).astype(np.float32)
  assert np.abs(ref_vars[0] - initial).max() > 1e-3  # the updates moved the weights
  for got, want in zip(vars_ + slots, ref_vars + ref_slots):
    # Same formula, different rounding: a few float32 ulps of the values after 6 steps.
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize('case', ['adam', 'adam_weight_decay', 'adamw'])
@pytest.mark.parametrize('sparse', [False, 'slices'])
def test_adam_equals_keras_bit_for_bit_over_500_steps(case, sparse):
  """Adam's second-moment rate `1 - beta_2` is where a fused kernel can drift: TF's
  ResourceApplyAdam computes it in float32 (1 - float32(0.999)), Keras rounds the float64
  difference once, 1.3e-5 apart relative, and 500 steps make that visible in every weight.
  Ours computes Keras's formula in Keras's order, so nothing may differ at all."""
  keras_class, fused_class, kwargs = CASES[case]
  ref_vars, ref_slots, _ = _train(keras_class, kwargs, steps=500, sparse=sparse)
  vars_, slots, ops = _train(fused_class, kwargs, steps=500, sparse=sparse)
  assert 'ResourceApplyAdagradV2' in ops
  for got, want in zip(vars_ + slots, ref_vars + ref_slots):
    np.testing.assert_array_equal(got, want)


def test_adams_step_size_is_computed_once_per_apply_not_per_variable(monkeypatch):
  """alpha = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t) is the same for every variable of one
  update (the iteration count advances after them); Keras computes it in each variable's
  update, a chain of scalar ops per variable in every step. Ours: once per apply and dtype, and
  the bit-for-bit test above still holds."""
  calls = []
  step_size = fused_optimizers.adam_step_size
  monkeypatch.setattr(
    fused_optimizers, 'adam_step_size', lambda *args: calls.append(1) or step_size(*args)
  )
  variables = [tf.Variable(tf.ones([3, 2])), tf.Variable(tf.ones([2])), tf.Variable(tf.ones([4]))]
  optimizer = fused_optimizers.FusedAdamW(learning_rate=0.01, weight_decay=0.1)
  optimizer.build(variables)

  @tf.function
  def two_updates():
    optimizer.apply_gradients([(tf.ones_like(v), v) for v in variables])
    optimizer.apply_gradients([(tf.ones_like(v), v) for v in variables])  # t advanced

  two_updates()
  assert len(calls) == 2  # one per apply, not one per variable (6)
  assert int(optimizer.iterations.numpy()) == 2
  expected = [tf.Variable(tf.ones(v.shape)) for v in variables]
  reference = keras.optimizers.AdamW(learning_rate=0.01, weight_decay=0.1)
  reference.build(expected)
  for _ in range(2):
    reference.apply_gradients([(tf.ones_like(v), v) for v in expected])
  for got, want in zip(variables, expected):
    np.testing.assert_array_equal(got.numpy(), want.numpy())


def test_tf_fused_adam_kernel_drifts_from_keras_over_500_steps():
  """The reason the update above is not TF's one-kernel ResourceApplyAdam: over the same 500
  steps that kernel's weights differ from Keras's (so the test above can see a drift)."""

  class KernelAdam(keras.optimizers.Adam):
    def update_step(self, gradient, variable, learning_rate):
      index = self._get_variable_index(variable)
      step = tf.cast(self.iterations + 1, tf.float32)
      handle = lambda v: fused_optimizers._resource(v).handle  # pylint: disable=protected-access
      tf.raw_ops.ResourceApplyAdam(
        var=handle(variable),
        m=handle(self._momentums[index]),
        v=handle(self._velocities[index]),
        beta1_power=tf.pow(self.beta_1, step),
        beta2_power=tf.pow(self.beta_2, step),
        lr=tf.cast(learning_rate, tf.float32),
        beta1=self.beta_1,
        beta2=self.beta_2,
        epsilon=self.epsilon,
        grad=gradient,
      )

  ref_vars, _, _ = _train(keras.optimizers.Adam, {}, steps=500)
  kernel_vars, _, _ = _train(KernelAdam, {}, steps=500)
  assert np.abs(kernel_vars[0] - ref_vars[0]).max() > 1e-6


@pytest.mark.parametrize('case', ['adam', 'momentum'])
def test_repeated_rows_of_a_sparse_gradient_are_summed_first(case):
  """An embedding gradient repeats a row once per occurrence of a token. The fused update sums
  the repeats (the true gradient) before it squares anything: it equals Keras given the dense
  gradient. (Keras's Adam given the slices squares each repeat separately, a different v.)"""
  keras_class, fused_class, kwargs = CASES[case]
  rows = (3, 7, 7, 120)
  want, want_slots, _ = _train(keras_class, kwargs, sparse='dense', rows=rows)
  got, got_slots, _ = _train(fused_class, kwargs, sparse='slices', rows=rows)
  for g, w in zip(got + got_slots, want + want_slots):
    np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-6)


def test_amsgrad_falls_back_to_keras():
  ref_vars, _, _ = _train(keras.optimizers.Adam, {'amsgrad': True})
  vars_, _, ops = _train(fused_optimizers.FusedAdam, {'amsgrad': True})
  assert not ops & KERNELS
  for got, want in zip(vars_, ref_vars):
    np.testing.assert_array_equal(got, want)


def test_checkpoint_of_keras_adam_restores_into_fused_adam(tmp_path):
  """Slots keep Keras's names: a workdir written before `optimizer.fused` existed resumes."""
  variable = tf.Variable(np.ones([5], np.float32))
  keras_adam = keras.optimizers.Adam(0.1)
  keras_adam.apply_gradients([(tf.constant([1.0, 2.0, 3.0, 4.0, 5.0]), variable)])
  path = tf.train.Checkpoint(v=variable, optimizer=keras_adam).save(str(tmp_path / 'ckpt'))
  fresh = tf.Variable(np.zeros([5], np.float32))
  fused = fused_optimizers.FusedAdam(0.1)
  fused.build([fresh])
  tf.train.Checkpoint(v=fresh, optimizer=fused).restore(path).assert_existing_objects_matched()
  for got, want in zip(fused.variables, keras_adam.variables):
    np.testing.assert_array_equal(got.numpy(), want.numpy())
  assert int(fused.iterations.numpy()) == 1


@pytest.mark.parametrize('case', ['adamw', 'nesterov'])
def test_fused_optimizers_serialize_like_keras_ones(case):
  """A model compiled with one saves and loads (registered with Keras), same hyperparameters."""
  _, fused_class, kwargs = CASES[case]
  optimizer = fused_class(learning_rate=0.02, **kwargs)
  again = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
  assert type(again) is fused_class
  assert again.get_config() == optimizer.get_config()


def test_keras_internals_the_fused_updates_read_exist_in_this_keras():
  from trainer.optim import fused_optimizers

  for kind in fused_optimizers.KERAS_ATTRIBUTES:
    fused_optimizers.check_keras(kind)  # raises when this Keras renamed one


def test_a_keras_without_those_internals_is_named(monkeypatch):
  from trainer.optim import fused_optimizers
  from trainer.errors import ConfigError

  monkeypatch.setitem(fused_optimizers.KERAS_ATTRIBUTES, 'SGD', ('momentums', '_renamed_in_4'))
  fused_optimizers.check_keras.cache_clear()
  with pytest.raises(ConfigError, match=rf'_renamed_in_4.*Keras {keras.__version__}.*fused=False'):
    fused_optimizers.FusedSGD(0.1, momentum=0.9).build([keras.Variable(tf.zeros([2]))])
  fused_optimizers.check_keras.cache_clear()
