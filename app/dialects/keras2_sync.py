"""What `ps.mode = sync` needs of tf_keras (app/distribute/ps/sync.py): its optimizers'
update path, deferred while a contribution is traced, and applied on the chief.

Every public update of a tf_keras optimizer ends in `apply_gradients`: `minimize`
calls it, and so do Keras' train_step and a custom one (tf_keras 2.21
optimizer.py, and legacy/optimizer_v2.py for the legacy optimizers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import tf_keras as keras

from app.config import ConfigError
from app.distribute.ps import deferral

# The classes whose `apply_gradients` every tf_keras optimizer inherits.
_OPTIMIZER_CLASSES = (keras.optimizers.Optimizer, keras.optimizers.legacy.Optimizer)


class UpdatePath:
    """`app.distribute.ps.deferral.UpdatePath` in tf_keras."""

    @staticmethod
    @contextlib.contextmanager
    def deferred(optimizer, deposit: Callable[[list, list], None],
                 other: Callable[[Any], None]) -> Iterator[None]:
        """Within it, `optimizer.apply_gradients` deposits; any other tf_keras optimizer's
        tells `other`."""
        with contextlib.ExitStack() as stack:
            for cls in _OPTIMIZER_CLASSES:
                stack.enter_context(deferral.replaced(cls, "apply_gradients",
                                                  _deferring(cls, optimizer, deposit, other)))
            yield

    @staticmethod
    def apply(optimizer, grads: list, variables: list) -> None:
        # Summed over replicas already: the mean of the workers' gradients.
        optimizer.apply_gradients(zip(grads, variables, strict=True),
                                  experimental_aggregate_gradients=False)

    @staticmethod
    def tf_variable(variable):
        return variable


def _deferring(cls: type, optimizer, deposit, other):
    keras_apply = cls.apply_gradients

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        if self is not optimizer:
            other(self)
            return keras_apply(self, grads_and_vars, *args, **kwargs)
        pairs = list(grads_and_vars)
        deposit([g for g, _ in pairs], [v for _, v in pairs])
        return self.iterations

    return apply_gradients



def check_optimizer(optimizer, task) -> None:
    """ConfigError for an optimizer whose update ps.mode = sync cannot defer."""
    if isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer):
        raise ConfigError(deferral.LOSS_SCALING.format(task=type(task).__name__))
