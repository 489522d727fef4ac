"""Loss scaling for your own loop and for Keras `fit`: change one import line.

    from trainer import mixed_precision
    optimizer = mixed_precision.LossScaleOptimizer(keras.optimizers.Adam())

`LossScaleOptimizer` (trainer/step/loss_scale_optimizer.py) has the API of
`keras.mixed_precision.LossScaleOptimizer` and of tf-keras 2.x's, and the Trainer's rules: a
finite check over every replica, floor, cap, growth, hysteresis, bit-identical skips.
`LossScaleMonitor` puts its scale and skip count into `fit`'s logs (History, TensorBoard).
Keras's dtype-policy functions are re-exported, so `mixed_precision.set_global_policy(...)` of a
loop written against `keras.mixed_precision` keeps working after the import line changes.
Guides: docs/guides/mixed-precision-own-loop.md, docs/guides/mixed-precision-fit.md.
"""

from keras.mixed_precision import DTypePolicy, Policy, dtype_policy, global_policy
from keras.mixed_precision import set_dtype_policy, set_global_policy

from trainer.step.loss_scale_optimizer import LossScaleMonitor, LossScaleOptimizer

__all__ = [
  'DTypePolicy',
  'LossScaleMonitor',
  'LossScaleOptimizer',
  'Policy',
  'dtype_policy',
  'global_policy',
  'set_dtype_policy',
  'set_global_policy',
]
