"""Loss scaling for your own loop and for Keras `fit`: change one import line.

    from trainer import mixed_precision
    optimizer = mixed_precision.LossScaleOptimizer(keras.optimizers.Adam())

`LossScaleOptimizer` (trainer/step/loss_scale_optimizer.py) has the API of
`keras.mixed_precision.LossScaleOptimizer` and of tf-keras 2.x's, and the Trainer's rules: a
finite check over every replica, floor, cap, growth, hysteresis, bit-identical skips.
`LossScaleMonitor` puts its scale and skip count into `fit`'s logs (History, TensorBoard).
Guides: docs/guides/mixed-precision-own-loop.md, docs/guides/mixed-precision-fit.md.
"""

from trainer.step.loss_scale_optimizer import LossScaleMonitor, LossScaleOptimizer

__all__ = ['LossScaleMonitor', 'LossScaleOptimizer']
