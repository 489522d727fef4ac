"""A new user's mistakes, found by writing a first model from the README: each is one line
naming the hook and the fix, raised before the workdir is touched (or a warning line where the
run can still be right)."""
import keras

from trainer import audit


# ---- the audit ------------------------------------------------------------------------------
def test_functional_model_has_no_input_layer_hazard():
  """A functional model lists its InputLayer, whose float32 output is the input as fed: not a
  layer that 'computes in float32' (this warned on every keras.Model(inputs, outputs))."""
  keras.mixed_precision.set_global_policy('mixed_bfloat16')
  inputs = keras.Input((8,))
  hidden = keras.layers.Dense(16, activation='relu')(inputs)
  model = keras.Model(inputs, keras.layers.Dense(4, dtype='float32')(hidden))
  _, hazards = audit.audit(model, 'mixed_bfloat16')
  assert hazards == []
