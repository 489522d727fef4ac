"""Keras Adam, AdamW and SGD whose per-variable update takes fewer passes over memory.

Keras 3's optimizers update each variable with element-wise ops (Adam: about a dozen, each a full
pass over the variable's memory); in a tf.profiler trace of the MNIST CNN (mixed_bfloat16, 2 CPU
cores) they took about 4 of 30 op-milliseconds per step. The classes here keep everything Keras
does around the update (schedules, weight decay, clipping, EMA, the slots and their checkpoint
names, distribution) and replace only `update_step` with TF's fused training kernels:

  Adam / AdamW   m += (g - m) * (1 - beta_1);  v += (g^2 - v) * (1 - beta_2)   (Keras's own ops)
                 alpha = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)          (scalars)
                 ResourceApplyAdagradV2(update_slots=False, lr=alpha, grad=m, accum=v):
                 var -= m * alpha / (sqrt(v) + epsilon)
                 (Keras's Adam.update_step term for term, in its order: bit-identical results;
                 Keras's five passes of the weight update are one kernel. Not ResourceApplyAdam:
                 it computes `1 - beta` in float32 from float32(beta), where Keras rounds the
                 float64 `1 - beta` once, so v's rate differs by about 1e-5 relative and the
                 weights drift apart over hundreds of steps. AdamW's decoupled decay is applied
                 by Keras before `update_step`, unchanged.)
  SGD            ResourceApplyKerasMomentum:  m = momentum * m - lr * g;  var += m
                 (nesterov: var += momentum * m - lr * g); ResourceApplyGradientDescent without
                 momentum.

Adam and AdamW equal Keras's bit for bit, SGD up to the last bit of some weights
(tests/step/test_fused_optimizers.py, Adam and AdamW over 500 steps). Keras's own `update_step`
takes what the kernels do not cover: amsgrad, and variables that are not float32/float64/
float16/bfloat16 resource variables. Sparse gradients (IndexedSlices, from an embedding lookup)
are made dense first, summing a token's repeated rows into the true gradient (Keras's Adam
squares each repeated row before summing, so on an embedding its v differs; on unique rows they
agree). `config.optimizer.fused=False` selects Keras's classes (trainer/optim/optimizers.py).
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING, Any

import keras
import tensorflow as tf

from trainer.errors import ConfigError

if TYPE_CHECKING:
  # A mixin's `super()` is the Keras optimizer it is mixed ahead of; Keras ships no types: Any.
  from keras.optimizers import Adam as _KerasAdam
else:
  _KerasAdam = object

_KERNEL_DTYPES = (tf.float32, tf.float64, tf.float16, tf.bfloat16)
TESTED_KERAS = '3.15'  # the Keras the fused updates were checked against (tests/)
# Keras private attributes the fused updates read. A Keras that renames one fails at build, with
# its version named, not with an AttributeError deep inside a traced step.
KERAS_ATTRIBUTES = {
  'Adam': ('_momentums', '_velocities', '_get_variable_index', 'iterations'),
  'SGD': ('momentums', '_get_variable_index'),
}


@functools.cache
def check_keras(kind: str) -> None:
  """Raises ConfigError when this Keras's `kind` optimizer ('Adam' or 'SGD') lacks an
  attribute the fused update reads."""
  optimizer = getattr(keras.optimizers, kind)(**({'momentum': 0.9} if kind == 'SGD' else {}))
  optimizer.build([keras.Variable(tf.zeros([1]))])
  missing = [name for name in KERAS_ATTRIBUTES[kind] if not hasattr(optimizer, name)]
  if missing:
    raise ConfigError(
      f'config.optimizer.fused=True reads Keras {kind} internals ({", ".join(missing)}) that '
      f'Keras {keras.__version__} does not have (tested with Keras {TESTED_KERAS}); set '
      "config.optimizer.fused=False to use Keras's own update."
    )


def adam_step_size(
  optimizer: keras.optimizers.Optimizer, learning_rate: tf.Tensor | float, dtype: tf.DType
) -> tf.Tensor:
  """Keras Adam's alpha = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t), t = iterations + 1, in
  `dtype`."""
  step = tf.cast(optimizer.iterations + 1, dtype)
  beta_1_power = tf.pow(tf.cast(optimizer.beta_1, dtype), step)
  beta_2_power = tf.pow(tf.cast(optimizer.beta_2, dtype), step)
  return tf.cast(learning_rate, dtype) * tf.sqrt(1 - beta_2_power) / (1 - beta_1_power)


def _resource(variable: Any) -> tf.Variable | None:
  """The tf.Variable behind a Keras variable (or the variable itself), or None when the fused
  kernels cannot take it."""
  if isinstance(variable, keras.Variable):
    variable = variable.value  # as Keras's own TF optimizer does (no autocast scope here)
  if not isinstance(variable, tf.Variable) or variable.dtype not in _KERNEL_DTYPES:
    return None
  return variable


def _slot(variable: Any) -> tf.Variable:
  """The tf.Variable behind a slot of a variable `_resource` takes (a slot has its variable's
  dtype, so the kernels take it too)."""
  return variable.value if isinstance(variable, keras.Variable) else variable


def _dense(gradient: tf.Tensor | tf.IndexedSlices, dtype: tf.DType) -> tf.Tensor:
  if isinstance(gradient, tf.IndexedSlices):
    gradient = tf.convert_to_tensor(gradient)
  return tf.cast(gradient, dtype)


# Per optimizer, during one `apply`: {(dtype, device): alpha}. Keras computes Adam's step size (a
# cast, two powers, a square root, a division) in every variable's update, the same value each
# time, as scalar ops traced once per variable; the iteration count is fixed within one `apply`
# (Keras advances it after), so one alpha per dtype and device serves all. Kept outside the
# optimizer, whose attributes Keras's tracking would add to checkpoints.
_STEP_SIZES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _FusedAdamUpdate(_KerasAdam):
  """`update_step` for Adam and AdamW (mixed in ahead of the Keras class)."""

  def build(self, variables: list) -> None:
    check_keras('Adam')
    super().build(variables)

  def apply(self, grads: list, trainable_variables: list | None = None) -> Any:
    _STEP_SIZES[self] = {}
    try:
      return super().apply(grads, trainable_variables)
    finally:
      _STEP_SIZES.pop(self, None)

  def _step_size(self, learning_rate: tf.Tensor, dtype: tf.DType, device: str) -> tf.Tensor:
    sizes = _STEP_SIZES.get(self)
    if sizes is None:  # update_step called outside `apply`
      return adam_step_size(self, learning_rate, dtype)
    key = (dtype, device)
    if key not in sizes:
      sizes[key] = adam_step_size(self, learning_rate, dtype)
    return sizes[key]

  def update_step(self, gradient: Any, variable: Any, learning_rate: tf.Tensor) -> Any:
    var = _resource(variable)
    if self.amsgrad or var is None:
      return super().update_step(gradient, variable, learning_rate)
    index = self._get_variable_index(variable)
    m, v = _slot(self._momentums[index]), _slot(self._velocities[index])
    dtype = var.dtype
    grad = _dense(gradient, dtype)
    alpha = self._step_size(learning_rate, dtype, var.device)
    # `1 - beta` is a Python float here, rounded to the variable's dtype once, as in Keras.
    m.assign_add((grad - m) * (1 - self.beta_1), read_value=False)
    v.assign_add((tf.square(grad) - v) * (1 - self.beta_2), read_value=False)
    # var -= m * alpha / (sqrt(v) + epsilon), in that order; the slots are only read.
    tf.raw_ops.ResourceApplyAdagradV2(
      var=var.handle,
      accum=v.handle,
      lr=alpha,
      epsilon=tf.cast(self.epsilon, dtype),
      grad=m.read_value(),
      use_locking=False,
      update_slots=False,
    )


@keras.saving.register_keras_serializable(package='trainer')
class FusedAdam(_FusedAdamUpdate, keras.optimizers.Adam):
  """keras.optimizers.Adam with a fused weight update (same arguments, same results)."""


@keras.saving.register_keras_serializable(package='trainer')
class FusedAdamW(_FusedAdamUpdate, keras.optimizers.AdamW):
  """keras.optimizers.AdamW with a fused weight update (same arguments, same results)."""


@keras.saving.register_keras_serializable(package='trainer')
class FusedSGD(keras.optimizers.SGD):
  """keras.optimizers.SGD with a one-kernel update (same arguments)."""

  def build(self, variables: list) -> None:
    check_keras('SGD')
    super().build(variables)

  def update_step(self, gradient: Any, variable: Any, learning_rate: tf.Tensor) -> Any:
    var = _resource(variable)
    if var is None:
      return super().update_step(gradient, variable, learning_rate)
    dtype = var.dtype
    lr, grad = tf.cast(learning_rate, dtype), _dense(gradient, dtype)
    if self.momentum == 0:
      tf.raw_ops.ResourceApplyGradientDescent(
        var=var.handle, alpha=lr, delta=grad, use_locking=False
      )
      return
    m = _slot(self.momentums[self._get_variable_index(variable)])
    tf.raw_ops.ResourceApplyKerasMomentum(
      var=var.handle,
      accum=m.handle,
      lr=lr,
      grad=grad,
      momentum=tf.cast(self.momentum, dtype),
      use_locking=False,
      use_nesterov=bool(self.nesterov),
    )
