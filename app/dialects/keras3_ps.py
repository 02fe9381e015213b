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

These read private Keras 3.15 members (`Variable._value` and
`_initialize_with_initializer`, `keras.src.backend.tensorflow.numpy.take`,
`Trainer._loss_tracker`) and TensorFlow's `_gather_saveables_for_checkpoint`
(2.21): if they move, `tests/test_keras3_ps.py` fails.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import shutil

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common.stateless_scope import in_stateless_scope
from keras.src.backend.tensorflow import core as keras_core
from keras.src.backend.tensorflow import numpy as keras_numpy

from app import preemption
from app.config import ConfigError
from app.dialects.keras3_slots import checkpoint_by_table

log = logging.getLogger(__name__)

_keras_assign_add = keras_core.Variable.assign_add
_keras_assign_sub = keras_core.Variable.assign_sub
_keras_take = keras_numpy.take


def _is_sharded(value) -> bool:
    """Whether `value` is a ShardedVariable (it has parts, and is no variable itself)."""
    return hasattr(value, "variables") and not isinstance(value, tf.Variable)


def _assign_add(self, value):
    if in_stateless_scope() or self._value is None or not hasattr(self._value, "assign_add"):
        return _keras_assign_add(self, value)
    return self._value.assign_add(tf.cast(value, self._value.dtype))


def _assign_sub(self, value):
    if in_stateless_scope() or self._value is None or not hasattr(self._value, "assign_sub"):
        return _keras_assign_sub(self, value)
    return self._value.assign_sub(tf.cast(value, self._value.dtype))


def sharded_take(x, indices, axis=None):
    """`keras.ops.take`, looking up rows of a sharded table on the shards' own tasks."""
    value = x.value if isinstance(x, keras.Variable) else x
    if axis == 0 and _is_sharded(value):
        return tf.nn.embedding_lookup(value, indices)
    return _keras_take(x, indices, axis=axis)


def atomic_updates() -> None:
    """Keras 3 variables' assign_add and assign_sub as one TensorFlow op each, and
    `take` shard-aware (see the module's docstring). Idempotent; for the process."""
    keras_core.Variable.assign_add = _assign_add
    keras_core.Variable.assign_sub = _assign_sub
    keras_numpy.take = sharded_take


class ShardVariable(keras.Variable):
    """A Keras 3 variable over one shard of a ShardedVariable, sharing its storage."""

    def __init__(self, shard: tf.Variable):
        self._shard = shard
        super().__init__(initializer=lambda shape, dtype: None, shape=tuple(shard.shape),
                         dtype=shard.dtype.name, trainable=shard.trainable,
                         name=shard.name.split(":")[0].replace("/", "_"))

    def _initialize_with_initializer(self, initializer):
        self._value = self._shard


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
        if self.sharded and type(model).train_step is not _keras_train_step():
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
        model._loss_tracker.update_state(loss,
                                         sample_weight=tf.shape(tf.nest.flatten(x)[0])[0])
        gradients = tape.gradient(loss, [v.value for v in self.variables])
        model.optimizer.apply(gradients, self.variables)
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def _keras_train_step():
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return TensorFlowTrainer.train_step


class LoopBackup:
    """The backup of a run of this loop, in <workdir>/backup/chief: the model, the
    optimizer (slots and step; `keras3_slots`), and the position (epoch,
    step). Keras 3's BackupAndRestore restores its own fit() only. Saved by the chief
    once every step scheduled so far has run, so the position is exact; each ps task
    writes its own variables (tf.train.Checkpoint)."""

    def __init__(self, coordinator, model: keras.Model, backup_dir: pathlib.Path,
                 every_steps: int = 0):
        self.coordinator, self.every_steps = coordinator, every_steps
        self.directory = backup_dir / "chief"
        self.sigterm = preemption.Sigterm()
        self._epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="backup_epoch")
        self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="backup_step")
        checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer,
                                         epoch=self._epoch, step=self._step)
        self.manager = tf.train.CheckpointManager(checkpoint, str(self.directory), max_to_keep=1)
        self._since_save = 0

    def restore(self) -> tuple[int, int]:
        """(epoch, step) to go on from; from here on SIGTERM means save and stop."""
        self.sigterm.install()
        latest = self.manager.latest_checkpoint
        if latest:
            self.manager.checkpoint.restore(latest).assert_existing_objects_matched()
            log.info("resumed from %s: epoch %d, step %d", latest,
                     int(self._epoch.numpy()) + 1, int(self._step.numpy()))
        return int(self._epoch.numpy()), int(self._step.numpy())

    def step_done(self, epoch: int, done: int) -> None:
        self._since_save += 1
        if self.sigterm.requested() or self.every_steps and self._since_save >= self.every_steps:
            self.save(epoch, done)
        self._stop_if_asked(epoch, done)

    def epoch_done(self, epoch: int) -> None:
        self.save(epoch + 1, 0)
        self._stop_if_asked(epoch + 1, 0)

    def save(self, epoch: int, step: int) -> None:
        self.coordinator.join()  # every step scheduled so far has run
        self._epoch.assign(epoch)
        self._step.assign(step)
        self.manager.save()
        self._since_save = 0

    def delete(self) -> None:
        self.sigterm.uninstall()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _stop_if_asked(self, epoch: int, step: int) -> None:
        if self.sigterm.requested():
            self.sigterm.ignore()
            log.warning("SIGTERM: backup of epoch %d, step %d saved; stopping", epoch + 1, step)
            raise preemption.preempted(str(self.directory))


def fit(steps: Steps, coordinator, dataset_fn, *, epochs: int, steps_per_epoch: int,
        callbacks: list, verbose, backup: LoopBackup) -> keras.callbacks.History:
    """Train `epochs` x `steps_per_epoch` steps, each scheduled on a free worker; the
    callbacks see what they see under tf_keras' fit with a coordinator (a batch
    ends when it is scheduled; an epoch once all of its steps have run)."""
    if verbose == "auto":
        verbose = 2  # one line per epoch, as fit() does under a coordinator
    model, strategy = steps.model, coordinator.strategy
    iterator = iter(coordinator.create_per_worker_dataset(
        lambda: strategy.distribute_datasets_from_function(dataset_fn)))

    @tf.function
    def step(iterator):
        return strategy.run(steps.train, args=(next(iterator),))

    history = keras.callbacks.History()
    callback_list = keras.callbacks.CallbackList(
        [*callbacks, history], add_progbar=verbose != 0, model=model, epochs=epochs,
        steps=steps_per_epoch, verbose=verbose)
    first_epoch, first_step = backup.restore()
    model.stop_training = False
    try:
        _epochs(model, lambda: coordinator.schedule(step, args=(iterator,)), coordinator.join,
                callback_list, backup, range(first_epoch, epochs), first_step, steps_per_epoch)
    except BaseException:
        # Nothing scheduled may run on after this run, into the next one's restore.
        with contextlib.suppress(Exception):
            coordinator.join()
        raise
    callback_list.on_train_end()
    backup.delete()
    return history


def _epochs(model: keras.Model, schedule, join, callback_list, backup: LoopBackup,
            epochs: range, first_step: int, steps_per_epoch: int) -> None:
    """`epochs`, the first from `first_step`: each step `schedule`d, each epoch `join`ed."""
    callback_list.on_train_begin()
    for epoch in epochs:
        model.reset_metrics()
        callback_list.on_epoch_begin(epoch)
        for index in range(first_step if epoch == epochs.start else 0, steps_per_epoch):
            callback_list.on_train_batch_begin(index)
            schedule()
            callback_list.on_train_batch_end(index, None)
            if index + 1 < steps_per_epoch:  # the last one is saved with its epoch
                backup.step_done(epoch, index + 1)
        join()
        logs = {name: float(np.asarray(value))
                for name, value in model.get_metrics_result().items()}
        callback_list.on_epoch_end(epoch, logs)
        backup.epoch_done(epoch)
        if model.stop_training:
            break
