"""The benchmarks run what launch.py runs: oneDNN's CPU kernels and XLA's compile cache are
opted into here, before any benchmark module imports TensorFlow (`import trainer` sets nothing)."""

import trainer

trainer.launcher_defaults()
