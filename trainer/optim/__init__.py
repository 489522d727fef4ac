"""The optimizers: a config to a Keras optimizer, fused updates, low-precision state and its
rounding."""
