"""The project's training loop on a ClusterCoordinator, for either Keras.

Keras 3's `fit` has no ParameterServerStrategy (keras-team/keras#18624), and
tf_keras' `fit` under one schedules steps that each read the next element of a
per-worker iterator: a step the coordinator runs again after a worker failed
reads another batch, and a recovered worker starts its dataset over. Here each
step is scheduled with its global step number when the task gives its examples
by index (`app.indexed`): wherever and however often it runs, it trains on the
same batch. Otherwise (a task with only a `train_dataset`) it reads the next
element of the worker's iterator, as Keras does.

The backup (`LoopBackup`) is saved once every scheduled step has run, so the
position it records is exact and is the whole state of the input.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from app import indexed
from app.state import backup as backups

log = logging.getLogger(__name__)


class LoopBackup(backups.Backup):
    """The backup of a run of this loop, in <workdir>/backup/chief: the model, the
    optimizer (slots and step), and the position (epoch, step). Keras'
    BackupAndRestore restores its own fit() only. Saved by the chief once every
    step scheduled so far has run, so the position is exact; each ps task writes
    its own variables (tf.train.Checkpoint)."""

    def __init__(self, coordinator, model, backup_dir: pathlib.Path, every_steps: int = 0):
        super().__init__(backup_dir / "chief", every_steps)
        self.coordinator = coordinator
        self.track(model=model, optimizer=model.optimizer)

    def step_done(self, epoch: int, done: int) -> None:
        self.steps_run()
        self.at(epoch, done)
        self.stop_if_asked()
        if self.due():
            self.save()

    def epoch_done(self, epoch: int, steps: int) -> None:
        self.write(epoch + 1, 0)
        self.at(epoch, steps)  # said as its last step, as the other backups say
        self.stop_if_saved_and_asked()

    def write(self, epoch: int, step: int) -> None:
        self.coordinator.join()  # every step scheduled so far has run
        super().write(epoch, step)


def fit(model, train: Callable[[Any], Any], coordinator, keras, *, epochs: int,
        steps_per_epoch: int, callbacks: list, verbose, backup: LoopBackup,
        dataset_fn=None, reading: tuple[indexed.Source, indexed.Order] | None = None,
        with_worker: bool = False, workers: int = 1):
    """Train `epochs` x `steps_per_epoch` steps of `train(batch)` (the model's train
    step), each scheduled on a free worker, its batch read by index (`reading`) or
    from the worker's iterator of `dataset_fn`. `keras` is the model's Keras, whose
    callbacks see what they see under tf_keras' fit with a coordinator: a batch ends
    when it is scheduled, an epoch once all of its steps have run. `with_worker`:
    the batch also carries the index of the worker that trains on it (a straggler's
    train step needs it). `workers`: how many there are."""
    if verbose == "auto":
        verbose = 2  # one line per epoch, as fit() does under a coordinator
    strategy = coordinator.strategy
    schedule = (_by_index(train, coordinator, *reading, with_worker) if reading
                else _by_iterator(train, coordinator, dataset_fn))
    history = keras.callbacks.History()
    callback_list = keras.callbacks.CallbackList(
        [*callbacks, history], add_progbar=verbose != 0, model=model, epochs=epochs,
        steps=steps_per_epoch, verbose=verbose)
    first_epoch, first_step = backup.restore()
    model.stop_training = False
    try:
        with strategy.scope():  # tf_keras builds its compiled metrics at the first trace
            _epochs(model, schedule, coordinator.join, callback_list, backup,
                    range(first_epoch, epochs), first_step, steps_per_epoch,
                    AHEAD_PER_WORKER * workers)
    except BaseException as e:
        failure = failure_behind(coordinator, e)
        # Nothing scheduled may run on after this run, into the next one's restore.
        with contextlib.suppress(Exception):
            coordinator.join()
        if failure is e:
            raise
        raise failure from e
    callback_list.on_train_end()
    backup.delete()
    return history


def failure_behind(coordinator, error: BaseException) -> BaseException:
    """The error to report for `error`, raised while `coordinator` ran steps.

    When a step fails for good, TensorFlow's ClusterCoordinator cancels the steps
    behind it, and waiting on one of those raises CancelledError ("The
    corresponding function is cancelled"), which names no cause. The failed
    step's error stays with the coordinator until `done()` (or `join()`) raises it:
    that is the one to report. A network partition showed it: worker 1's reads of
    ps:0 failed while it was cut off, TensorFlow counted them as ps:0's failure,
    and the chief died of the CancelledError (exit 1), where ps:0's
    UnavailableError is a lost task (exit 203, retried).
    """
    if not isinstance(error, tf.errors.CancelledError):
        return error
    try:
        coordinator.done()  # raises the failed step's error, without waiting for the rest
    except Exception as first:  # whatever the failed step raised
        return first
    return error


def _by_iterator(train, coordinator, dataset_fn) -> Callable[[int], Any]:
    strategy = coordinator.strategy
    iterator = iter(coordinator.create_per_worker_dataset(
        lambda: strategy.distribute_datasets_from_function(dataset_fn)))

    @tf.function
    def step(iterator):
        strategy.run(train, args=(next(iterator),))  # nothing returned: see _epochs

    return lambda _: coordinator.schedule(step, args=(iterator,))


def _by_index(train, coordinator, source: indexed.Source, order: indexed.Order,
              with_worker: bool) -> Callable[[int], Any]:
    strategy = coordinator.strategy
    # What `source.read` reads from, made once on each worker: a per-worker iterator
    # whose every element is the same, so it has no position a failure could lose.
    loaded = (iter(coordinator.create_per_worker_dataset(
        lambda: indexed.loaded_dataset(source))) if source.load else None)

    @tf.function
    def step(global_step, loaded):
        batch = indexed.batch(source, order, None if loaded is None else next(loaded),
                              global_step)
        if with_worker:
            worker = tf.distribute.coordinator.experimental_get_current_worker_index()
            batch = (*batch, tf.cast(worker, tf.int32))
        strategy.run(train, args=(batch,))  # nothing returned: see _epochs

    return lambda k: coordinator.schedule(step, args=(tf.constant(k, tf.int64), loaded))


# Steps scheduled ahead of the oldest one still running, per worker: enough to keep
# every worker busy. The coordinator's queue takes 262,144, so without a bound a whole
# epoch is scheduled at once and a SIGTERM is heard only at its end, when the grace
# period a scheduler gives (30 s in Kubernetes) may be long over. The loop waits for
# the oldest step with `RemoteValue.fetch`, which copies the step's outputs from its
# worker: a worker that died after its step had run would fail that copy, out of the
# coordinator's recovery (UnavailableError on the chief). So a step returns nothing;
# the epoch's metrics are read from their variables, on the ps tasks.
AHEAD_PER_WORKER = 4


def _epochs(model, schedule: Callable[[int], Any], join, callback_list, backup: LoopBackup,
            epochs: range, first_step: int, steps_per_epoch: int, ahead: int) -> None:
    """`epochs`, the first from `first_step`: each step `schedule`d with its global
    number, at most `ahead` of them running, each epoch `join`ed."""
    callback_list.on_train_begin()
    running: collections.deque = collections.deque()
    for epoch in epochs:
        model.reset_metrics()
        callback_list.on_epoch_begin(epoch)
        for index in range(first_step if epoch == epochs.start else 0, steps_per_epoch):
            callback_list.on_train_batch_begin(index)
            running.append(schedule(epoch * steps_per_epoch + index))
            if len(running) > ahead:
                running.popleft().fetch()
            if index + 1 < steps_per_epoch:  # the last one is saved with its epoch
                backup.step_done(epoch, index + 1)
            # After the backup, as under tf_keras' fit: a step logged is saved when a
            # backup was due there (callbacks.for_training).
            callback_list.on_train_batch_end(index, None)
        join()
        running.clear()
        logs = {name: float(np.asarray(value))
                for name, value in model.get_metrics_result().items()}
        callback_list.on_epoch_end(epoch, logs)
        backup.epoch_done(epoch, steps_per_epoch)
        if model.stop_training:
            break
