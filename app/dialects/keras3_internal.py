"""The Keras 3 internals the Keras 3 dialect uses, walled off here (read from Keras 3.15),
as `app.tf_internal` walls off TensorFlow's.

`keras3`, `keras3_build`, `keras3_ps` and `keras3_slots` use Keras 3's public API
and these. Each says why the public API does not suffice and what fails if it moves:

- `built_variables`: the variables an optimizer was built for, which ps.mode =
  sync's deferred `optimizer.apply(grads)` (no variables given) deposits gradients
  for (`keras3_sync`). If it moves, such a train_step fails to trace under sync.
- `adam_slots`: the momentum and velocity of one variable, which the fused Adam
  update (`keras3._fused_adam`) hands to TensorFlow's kernel. Keras 3's optimizer
  lists its variables, not which slot is whose. If it moves, the first step of a
  Keras 3 run with `train.optimizer = adam` fails (tests/test_dialects.py).
- `flatten_layers`, `build_from_batch`: every layer of a model, nested ones included
  (`model.layers` lists its direct children only), and what fit() builds from its
  first batch, built from another (`keras3_build.prebuild`); fit has no public way to
  be given a built model. If they move, every Keras 3 run fails before its first step.
- `reduce_logs_first_under_multi_worker`, `exact_epochs`: Keras 3's TensorFlow
  trainer, fixed (a step's logs under MultiWorkerMirrored), resumed (at the step
  after a backup's: fit has no initial step) and held to its epochs' steps under
  steps_per_execution > 1. If they move, two-worker Keras 3 runs stop at their first
  step, a resumed run repeats its epoch's first steps, or an epoch runs past its end
  (tests/test_preemption.py, tests/test_sigterm.py, tests/test_steps_per_execution.py).
- `input_signature`: the input signature `model.export` uses, for the project's own
  export archive (`keras3._export`, inference mode). If it moves, the export fails.
- `in_stateless_scope`, `tensorflow_value`, `variable_class`, `numpy_module`,
  `VariableOver`: Keras 3 variables' storage and updates on TensorFlow, which
  `keras3_ps` makes atomic and shard-aware under parameter servers. If they move,
  Keras 3 under ParameterServerStrategy fails (tests/test_keras3_ps.py).
- `loss_tracker`, `default_train_step`: the loss mean Keras' train_step updates, and
  that train_step, for `keras3_ps.Steps`' step over a table's shards.
- `checkpoint_children`, `set_checkpoint_children`, `OPTIMIZER_VARIABLES`,
  `OPTIMIZER_TRAINABLE_VARIABLES`: what a Keras 3 optimizer's checkpoint lists
  (TensorFlow's `_trackable_children`, under Keras' attribute names), which
  `keras3_slots` makes restorable into another number of shards
  (tests/test_resume_shards.py).

- `BackupAndRestore`: Keras 3's callback with its private hooks named: the restore
  and the save of its metadata file, the epoch it is in, the batch it resumes
  after. Keras 3 restores the epoch only; `keras3.Backup` records the step within
  it and the random generators' states beside Keras' own record. If they move, a
  resumed Keras 3 run repeats its epoch's first steps (tests/test_sigterm.py,
  tests/test_preemption.py).
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf
from keras.src.backend.common import stateless_scope as _stateless_scope
from keras.src.backend.tensorflow import core as _tf_core
from keras.src.backend.tensorflow import numpy as _tf_numpy
from keras.src.backend.tensorflow import trainer as _tf_trainer

# Keras' own, before `reduce_logs_first_under_multi_worker` replaces it.
_keras_reduce_per_replica = _tf_trainer.reduce_per_replica


# -- optimizers -------------------------------------------------------------------------

def adam_slots(adam: keras.optimizers.Adam, variable) -> tuple[Any, Any]:
    """(momentum, velocity): `adam`'s slots of `variable` (Keras 3.15 Adam keeps them in
    `_momentums` and `_velocities`, in the order of `_get_variable_index`)."""
    index = adam._get_variable_index(variable)
    return adam._momentums[index], adam._velocities[index]


def built_variables(optimizer) -> list:
    """The variables `optimizer` was built for, which `optimizer.apply(grads)` without
    variables updates (Keras 3.15 BaseOptimizer `_trainable_variables`)."""
    return list(optimizer._trainable_variables)


# The entries of a Keras 3.15 optimizer's checkpoint: all its variables, and the model
# variables it was built for (BaseOptimizer's attributes, as TensorFlow tracks them).
OPTIMIZER_VARIABLES = "_variables"
OPTIMIZER_TRAINABLE_VARIABLES = "_trainable_variables"


def checkpoint_children(obj) -> Callable[..., dict[str, Any]]:
    """`obj`'s own `_trackable_children(save_type, **kwargs)` (TensorFlow 2.21's
    Trackable): what its checkpoint saves, by name. The public checkpoint API
    saves what this gives, and has no way to change it."""
    return obj._trackable_children


def set_checkpoint_children(obj, children: Callable[..., dict[str, Any]]) -> None:
    """Give `obj` `children` as its `_trackable_children`, on this object only
    (set past Keras' attribute tracking, which would track the function)."""
    object.__setattr__(obj, "_trackable_children", children)


# -- building ---------------------------------------------------------------------------

def flatten_layers(model: keras.Model) -> list:
    """The model and every layer within it, nested ones included."""
    return list(model._flatten_layers())


def _built(iterator=None, data_batch=None) -> None:
    return None


def build_from_batch(model: keras.Model, data_batch) -> None:
    """Build what fit() and evaluate() build from their first batch (Keras 3.15
    Trainer `_symbolic_build`: the compiled loss and metrics, the optimizer) from
    `data_batch`, and make them build nothing more (`_maybe_symbolic_build`)."""
    model._symbolic_build(data_batch=data_batch)
    model._maybe_symbolic_build = _built


# -- the TensorFlow trainer ------------------------------------------------------------

def _reduce_per_replica(values, strategy, reduction):
    # Keras 3.15 reduces a step's logs (the metrics' results, the same on every
    # replica) with strategy.reduce("MEAN", v, axis=0) under MultiWorkerMirrored,
    # which fails on a scalar ("Invalid reduction dimension 0 for input with 0
    # dimensions"): every fit() of two workers stopped at its first step. The first
    # replica's logs are what "auto" gives on one host.
    if reduction == "auto" and _tf_trainer._collective_all_reduce_multi_worker(strategy):
        reduction = "first"
    return _keras_reduce_per_replica(values, strategy, reduction)


def reduce_logs_first_under_multi_worker() -> None:
    """Keras 3's step functions take their logs from the first replica under
    MultiWorkerMirrored (see `_reduce_per_replica`). Idempotent; for the process."""
    _tf_trainer.reduce_per_replica = _reduce_per_replica


@contextlib.contextmanager
def exact_epochs(first_step: Callable[[], int], stepwise: bool = False) -> Iterator[None]:
    """Within it, the next fit() numbers its first epoch's steps from `first_step()`
    (read when that epoch begins, after the callbacks' on_train_begin restored the
    backup), and runs each epoch's steps exactly; `stepwise`: one step per call of
    its train function. Keras 3.15's fit makes its training TFEpochIterator first,
    then any for evaluation, which are left as they are.

    Keras 3.15's fit runs whole executions of `steps_per_execution` steps
    (EpochIterator `_enumerate_iterator`): an epoch whose steps they do not divide ran
    past its end (33 steps of 32 at 3 a call), and a resumed epoch could start only
    where an execution does. An execution that would cross the first step or the
    epoch's end gets an iterator of its steps' batches alone, which Keras' train
    function runs one step a call (the `function` of `_make_function`, given an
    iterator that is not TensorFlow's); `stepwise`, every execution does. Several
    steps a call fail with several replicas (Mirrored, MultiWorkerMirrored: "You must
    feed a value for placeholder tensor", keras-team/keras#19246; the step's
    merge_call runs in the tf.cond of Keras' multi-step loop)."""
    original = _tf_trainer.TFEpochIterator

    class _Exact(original):
        def _enumerate_iterator(self):
            first = self._first_step() if self._first_step else 0
            self._first_step = None
            last = self.steps_per_epoch - 1 if self.steps_per_epoch else None
            # The skipped steps read no input (train_function does): the epoch's
            # input goes on from where the iterator is.
            for begin, end, iterator in super()._enumerate_iterator():
                if end < first:
                    continue
                if stepwise or begin < first or last is not None and end > last:
                    begin, end = max(begin, first), end if last is None else min(end, last)
                    iterator = itertools.islice(iterator, end - begin + 1)
                yield begin, end, iterator

    def make(*args, **kwargs):
        _tf_trainer.TFEpochIterator = original  # one, for training
        iterator = _Exact(*args, **kwargs)
        iterator._first_step = first_step
        return iterator

    _tf_trainer.TFEpochIterator = make
    try:
        yield
    finally:
        _tf_trainer.TFEpochIterator = original


def default_train_step() -> Callable:
    """TensorFlowTrainer.train_step: what a model that does not override it runs."""
    return _tf_trainer.TensorFlowTrainer.train_step


def loss_tracker(model: keras.Model):
    """The mean of the losses Keras' train_step reports as `loss` (Trainer._loss_tracker);
    a step of the project's own updates it as Keras' does."""
    return model._loss_tracker


# -- export -----------------------------------------------------------------------------

def input_signature(model: keras.Model):
    """The input signature `model.export` gives its `serve` endpoint."""
    from keras.src.export.export_utils import get_input_signature

    return get_input_signature(model)


# -- variables on TensorFlow ------------------------------------------------------------

def in_stateless_scope() -> bool:
    """Whether Keras traces statelessly now (its variables' updates are recorded, not made)."""
    return _stateless_scope.in_stateless_scope()


def tensorflow_value(variable: keras.Variable):
    """The TensorFlow variable a Keras 3 variable stores its value in (`_value`), or
    None before it is initialized; `variable.value` reads it (autocast included)."""
    return variable._value


def variable_class() -> type:
    """Keras 3's TensorFlow variable class, whose assign_add and assign_sub
    `keras3_ps.atomic_updates` replaces for the process."""
    return _tf_core.Variable


def numpy_module():
    """Keras 3's TensorFlow ops module, whose `take` `keras3_ps.atomic_updates` replaces."""
    return _tf_numpy


class VariableOver(keras.Variable):
    """A Keras 3 variable whose value is the TensorFlow variable `storage` itself, no
    copy (`keras3_ps.ShardVariable`, over one shard of a table). Keras 3.15 creates a
    variable's storage in `_initialize_with_initializer`, which this overrides; a
    public Keras 3 variable always makes storage of its own."""

    def __init__(self, storage, **kwargs):
        self._storage = storage
        super().__init__(initializer=lambda shape, dtype: None, **kwargs)

    def _initialize_with_initializer(self, initializer):
        self._value = self._storage


# -- backup -----------------------------------------------------------------------------

class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """Keras 3.15's BackupAndRestore, whose restore and save a subclass extends through
    `restored(metadata)` and `saving(metadata)`: its metadata file's contents (a dict,
    Keras' "epoch" and "batch" among them), read after Keras' restore and written after
    Keras' save. Only a task for which `_writes()` is true saves."""

    def _load_model(self):
        super()._load_model()
        if tf.io.gfile.exists(self._training_metadata_path):
            with tf.io.gfile.GFile(self._training_metadata_path) as f:
                metadata = json.load(f)
            # Keras 3.15 restores the epoch into the model's first epoch only: its own
            # count stays 0 until an epoch ends, and a save before then records epoch 0
            # (a run preempted again in the epoch it resumed would start over).
            self._current_epoch = metadata["epoch"]
            self.restored(metadata)

    def _save_model(self):
        if not self._writes():
            return
        super()._save_model()
        with tf.io.gfile.GFile(self._training_metadata_path) as f:
            metadata = json.load(f)
        self.saving(metadata)
        with tf.io.gfile.GFile(self._training_metadata_path, "w") as f:
            f.write(json.dumps(metadata))
        self._batches_seen_since_last_saving = 0  # the next, every_steps from this one

    def restored(self, metadata: dict) -> None:
        """After a restore: what the backup's metadata holds."""

    def saving(self, metadata: dict) -> None:
        """After a save: add to the metadata Keras wrote, which is then written back."""

    def _writes(self) -> bool:
        return True

    def save_now(self) -> None:
        """Save at once, as Keras does when a save is due."""
        self._save_model()

    @property
    def current_epoch(self) -> int:
        """The epoch Keras is in (from 0), as its restore set it."""
        return self._current_epoch

    def resume_after_batch(self, batch: int) -> None:
        """Make fit() go on after `batch` of the restored epoch (Keras restores 0)."""
        self._last_batch_seen = batch
