"""Keras 3 under ParameterServerStrategy: the project's own loop on the ClusterCoordinator.

Keras 3's `fit` has no ParameterServerStrategy (keras-team/keras#18624), but its
model, losses, metrics and optimizers run under one: built in the strategy's
scope, their variables live on the ps tasks. Each step the chief schedules runs
the model's own `train_step` (or, with sharded variables, the same computation
written here) on a worker. What Keras 3.15 lacks for that, read from its source:

- `KerasVariable.assign_add` reads the variable, adds and assigns
  (backend/common/variables.py): two workers updating one ps-held variable at once
  lose an increment. `optimizer.iterations` read 145 after 200 scheduled steps, and
  a metric's total undercounts. `atomic_updates` makes them TensorFlow's own
  `assign_add`, one op on the ps.
- A Keras 3 variable over a ShardedVariable (a partitioner's) has no `handle`, so
  `tape.gradient` fails on it, and the optimizer cannot update it. `ShardVariable`
  is a Keras 3 variable over one shard, with no copy: the gradients are taken
  with respect to the shards and the optimizer updates (and keeps slots for) each.
- `ops.take` of an Embedding reads the whole table (it converts the variable to a
  tensor, concatenating the shards on the worker); `sharded_take` looks up only
  the rows it needs with `tf.nn.embedding_lookup`, dispatched to each shard's ps.
- Keras 3's checkpoint of an optimizer lists its slots, and the shards it was
  built for, by position: with a slot per shard, a backup restored into another
  number of shards (another number of ps tasks) failed, or silently gave variables
  other variables' values and shapes. `keras3_slots.checkpoint_by_table` makes it
  save each slot of a sharded variable whole, as tf_keras' optimizer does.

These read private Keras 3.15 members, through `app.dialects.keras3_internal`
(a variable's storage and updates, `ops.take`, the trainer's loss tracker and
train_step), and define TensorFlow's `_gather_saveables_for_checkpoint` (2.21):
if they move, `tests/test_keras3_ps.py` fails.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from app.config import ConfigError
from app.dialects import keras3_internal
from app.dialects.keras3_slots import checkpoint_by_table

_keras_assign_add = keras3_internal.variable_class().assign_add
_keras_assign_sub = keras3_internal.variable_class().assign_sub
_keras_take = keras3_internal.numpy_module().take


def _is_sharded(value) -> bool:
    """Whether `value` is a ShardedVariable (it has parts, and is no variable itself)."""
    return hasattr(value, "variables") and not isinstance(value, tf.Variable)


def _assign_add(self, value):
    storage = keras3_internal.tensorflow_value(self)
    if keras3_internal.in_stateless_scope() or not hasattr(storage, "assign_add"):
        return _keras_assign_add(self, value)
    return storage.assign_add(tf.cast(value, storage.dtype))


def _assign_sub(self, value):
    storage = keras3_internal.tensorflow_value(self)
    if keras3_internal.in_stateless_scope() or not hasattr(storage, "assign_sub"):
        return _keras_assign_sub(self, value)
    return storage.assign_sub(tf.cast(value, storage.dtype))


def sharded_take(x, indices, axis=None):
    """`keras.ops.take`, looking up rows of a sharded table on the shards' own tasks."""
    value = x.value if isinstance(x, keras.Variable) else x
    if axis == 0 and _is_sharded(value):
        return tf.nn.embedding_lookup(value, indices)
    return _keras_take(x, indices, axis=axis)


def atomic_updates() -> None:
    """Keras 3 variables' assign_add and assign_sub as one TensorFlow op each, and
    `take` shard-aware (see the module's docstring). Idempotent; for the process."""
    keras3_internal.variable_class().assign_add = _assign_add
    keras3_internal.variable_class().assign_sub = _assign_sub
    keras3_internal.numpy_module().take = sharded_take


class ShardVariable(keras3_internal.VariableOver):
    """A Keras 3 variable over one shard of a ShardedVariable, sharing its storage."""

    def __init__(self, shard: tf.Variable):
        super().__init__(shard, shape=tuple(shard.shape), dtype=shard.dtype.name,
                         trainable=shard.trainable,
                         name=shard.name.split(":")[0].replace("/", "_"))


class ShardedTableVariable(keras.Variable):
    """What a Keras 3 variable over a ShardedVariable becomes (`shard_saving`): saved as
    TensorFlow saves a ShardedVariable, one slice per shard, each written by its own
    ps task. (Keras 3's variable saves its value as one tensor, and a ShardedVariable
    has none: the checkpoint failed on "'ShardedVariable' object has no attribute
    'device'".)"""

    # Defined here, and not `_serialize_to_tensors`: TensorFlow's checkpoint then
    # takes this class's saveables (saveable_object_util.trackable_has_serialize_to_tensor
    # reads the class hierarchy from here up).
    def _gather_saveables_for_checkpoint(self):
        return self.value._gather_saveables_for_checkpoint()

    # The whole table, read shard by shard: what `get_weights` and the native .keras
    # file hold (the SavedModel and the checkpoints are written by the ps tasks).
    def numpy(self):
        return np.concatenate([part.numpy() for part in self.value.variables])

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.numpy(), dtype=dtype)


def shard_saving(model: keras.Model) -> None:
    """Each of `model`'s variables over a ShardedVariable saved shard by shard."""
    for variable in model.variables:
        if _is_sharded(variable.value) and type(variable) is keras.Variable:
            variable.__class__ = ShardedTableVariable


def trainable(model: keras.Model) -> list[list[keras.Variable]]:
    """The model's trainable variables, each as the Keras variables the optimizer
    updates: a sharded one as one per shard, any other as itself."""
    return [[ShardVariable(s) for s in v.value.variables] if _is_sharded(v.value) else [v]
            for v in model.trainable_variables]


class Steps:
    """The functions a worker runs: one training step, in the model's own train_step
    or, with sharded variables, in the same computation over the shards."""

    def __init__(self, model: keras.Model, task, slot_device):
        self.model = model
        shard_saving(model)
        parts = trainable(model)
        self.variables = [variable for group in parts for variable in group]
        self.sharded = len(self.variables) != len(model.trainable_variables)
        if self.sharded and type(model).train_step is not keras3_internal.default_train_step():
            raise ConfigError(
                f"the train_step of {type(model).__name__} (task {type(task).__name__}) "
                "differentiates the model's variables, and some of them are sharded over "
                "the ps tasks (ps.partitioner); set ps.partitioner = none, or train it "
                "under MultiWorkerMirrored")
        with slot_device:
            model.optimizer.build(self.variables)
        checkpoint_by_table(model.optimizer, parts)

    def train(self, data):
        if not self.sharded:
            return self.model.train_step(data)
        # TensorFlowTrainer.train_step (Keras 3.15), differentiating the shards.
        model = self.model
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                      training=True)
        keras3_internal.loss_tracker(model).update_state(
            loss, sample_weight=tf.shape(tf.nest.flatten(x)[0])[0])
        gradients = tape.gradient(loss, [v.value for v in self.variables])
        model.optimizer.apply(gradients, self.variables)
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
