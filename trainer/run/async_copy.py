"""Asynchronous checkpoints (config.train.async_checkpoint) with Keras 3 variables."""

from __future__ import annotations


def keras_variables_copy_once() -> None:
  """TensorFlow's asynchronous checkpoint copies every variable to the CPU in a tf.function once
  per save (`_copy_trackable_to_cpu(object_map)`), where Keras 3's TensorFlow variable makes a
  new tf.Variable on every call, refused after the first trace ("tf.function only supports
  singleton tf.Variables created on the first call"; TF 2.21, Keras 3.15). So the Keras variable
  is mapped to the copy of the tf.Variable behind it, which TensorFlow creates once and assigns
  on later saves (saved under the same VARIABLE_VALUE key)."""
  from keras.src.backend.tensorflow import core  # pylint: disable=import-outside-toplevel

  if getattr(core.Variable, '_copy_once', False):
    return

  def copy_to_cpu(self, object_map):
    self.value._copy_trackable_to_cpu(object_map)  # pylint: disable=protected-access
    object_map[self] = object_map[self.value]

  core.Variable._copy_trackable_to_cpu = copy_to_cpu  # pylint: disable=protected-access
  core.Variable._copy_once = True  # pylint: disable=protected-access
