"""What `ps.mode = sync` needs of Keras 3 (app/distribute/ps/sync.py): its optimizers'
update path, deferred while a contribution is traced, and applied on the chief.

Every public update of a Keras 3 optimizer ends in `Optimizer.apply`:
`apply_gradients` calls it, a custom train_step calls either (Keras 3.15
base_optimizer.py), and `stateless_apply` raises under TensorFlow.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import keras

from app.config import ConfigError
from app.dialects import keras3_internal
from app.distribute.ps import deferral


class UpdatePath:
    """`app.distribute.ps.deferral.UpdatePath` in Keras 3; `tf_variable(v)` gives the
    TensorFlow variable behind a Keras 3 variable."""

    def __init__(self, tf_variable: Callable[[Any], Any]):
        self.tf_variable = tf_variable

    @staticmethod
    @contextlib.contextmanager
    def deferred(optimizer, deposit: Callable[[list, list], None],
                 other: Callable[[Any], None]) -> Iterator[None]:
        """Within it, `optimizer.apply` deposits; any other Keras 3 optimizer's tells `other`."""
        cls = keras.optimizers.Optimizer
        keras_apply = cls.apply

        def apply(self, grads, trainable_variables=None):
            if self is not optimizer:
                other(self)
                return keras_apply(self, grads, trainable_variables)
            if trainable_variables is None:  # the variables it was built for
                trainable_variables = keras3_internal.built_variables(self)
            deposit(list(grads), list(trainable_variables))
            return None

        with deferral.replaced(cls, "apply", apply):
            yield

    @staticmethod
    def apply(optimizer, grads: list, variables: list) -> None:
        optimizer.apply(grads, variables)


def check_optimizer(optimizer, task) -> None:
    """ConfigError for an optimizer whose update ps.mode = sync cannot defer."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ConfigError(deferral.LOSS_SCALING.format(task=type(task).__name__))
