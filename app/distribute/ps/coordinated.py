"""The project's training loop on a ClusterCoordinator, for either Keras.

Keras 3's `fit` has no ParameterServerStrategy (keras-team/keras#18624), and
tf_keras' `fit` under one schedules steps that each read the next element of a
per-worker iterator: a step the coordinator runs again after a worker failed
reads another batch, and a recovered worker starts its dataset over. Here each
closure (`train.steps_per_execution` steps, as tf_keras' fit runs them) is
scheduled with the global number of its first step when the task gives its
examples by index (`app.indexed`): wherever and however often it runs, its steps
train on the same batches, each read in the step. Otherwise (a task with only a
`train_dataset`) each step reads the next element of the worker's iterator, as
Keras does.

A closure the coordinator runs again, after its worker failed, runs all its steps
again, whichever of them had been applied: the rerun window is one closure.
The backup (`LoopBackup`) is saved once every scheduled closure has run, so the
position it records is exact and is the whole state of the input.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from app import indexed, tf_internal
from app.config import PSConfig, TrainConfig
from app.state import backup as backups

log = logging.getLogger(__name__)

# schedule(first, count): a closure of the `count` steps from global step `first`.
Schedule = Callable[[int, int], Any]


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

    def step_done(self, epoch: int, done: int, steps: int = 1) -> None:
        """`steps` more steps are scheduled; `done` of epoch `epoch` in all."""
        self.steps_run(steps)
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


@dataclasses.dataclass(frozen=True)
class Closures:
    """How each scheduled closure runs its steps: the settings of `train` and `ps` that
    shape the loop, read once by the runner and passed unchanged, through a dialect's
    `fit_coordinated`, to `fit`."""

    steps: int = 1  # train.steps_per_execution: steps a closure (fewer at an epoch's end)
    read_every: int = 1  # ps.read_every: its steps read the variables once every this many
    half_reads: bool = False  # ps.read_compression = "fp16": those reads cross as float16
    unroll: bool = True  # ps.unroll: its steps traced one after another, not as a loop

    @classmethod
    def of(cls, train: TrainConfig, ps: PSConfig) -> Closures:
        return cls(train.steps_per_execution, ps.read_every, ps.read_compression == "fp16",
                   ps.unroll)

    @property
    def reads_fewer(self) -> bool:
        """Whether a step may read the variables other than as float32, every step."""
        return self.read_every > 1 or self.half_reads


ONE_STEP = Closures()  # a step a closure, reading float32: the defaults of train and ps


def fit(model, train: Callable[[Any], Any], coordinator, keras, *, epochs: int,
        steps_per_epoch: int, callbacks: list, verbose, backup: LoopBackup,
        dataset_fn=None, reading: tuple[indexed.Source, indexed.Order] | None = None,
        with_worker: bool = False, workers: int = 1, closures: Closures = ONE_STEP,
        variables: list | None = None):
    """Train `epochs` x `steps_per_epoch` steps of `train(batch)` (the model's train
    step), `closures.steps` of them in each closure scheduled on a free worker
    (fewer at an epoch's end), each batch read by index (`reading`) or from the
    worker's iterator of `dataset_fn`. `keras` is the model's Keras, whose callbacks
    see what they see under tf_keras' fit with a coordinator: a batch ends when it is
    scheduled (the last step of a closure), an epoch once all of its steps have run.
    `with_worker`: the batch also carries the index of the worker that trains on it (a
    straggler's train step needs it). `workers`: how many there are. `variables`: the
    model's, which a closure's steps read from the ps tasks as `closures` says
    (`tf_internal.variable_reads`)."""
    if verbose == "auto":
        verbose = 2  # one line per epoch, as fit() does under a coordinator
    strategy = coordinator.strategy
    loop = functools.partial(_loop, variables=variables,
                             every=closures.read_every if closures.steps > 1 else 1,
                             half=closures.half_reads, most=UNROLLED_AT_MOST)
    # A closure's number of steps: a Python int traces them one after another (`_loop`;
    # in a loop of groups beyond UNROLLED_AT_MOST), once for each number a closure runs;
    # a tensor, as a loop traced once.
    count_arg = int if closures.unroll else (lambda count: tf.constant(count, tf.int64))
    schedule = (_by_index(train, coordinator, *reading, with_worker, loop, count_arg)
                if reading else _by_iterator(train, coordinator, dataset_fn, loop, count_arg))
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
                    closures.steps, closures_ahead(closures.steps) * workers)
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


# The most steps of a closure traced one after another: a closure of more steps, with
# ps.unroll, runs them as a loop over groups of at most this many, each group unrolled,
# so that a large train.steps_per_execution costs no more tracing than this many steps.
# (Keras 3's TensorFlow trainer has the same split: `unrolled_steps_per_execution`.)
UNROLLED_AT_MOST = 8


def _loop(count: int | tf.Tensor, step: Callable[[int | tf.Tensor], Any],
          variables: list | None, every: int, half: bool = False,
          most: int = UNROLLED_AT_MOST) -> None:
    """`step(i)` for i in range(count), in a closure's traced function: one step after
    another for a Python int `count` of at most `most`, as a loop for a tensor, and for a
    larger int as a loop over groups of at most `most` steps (whole runs of `every`),
    each unrolled; with `every` > 1, in runs of `every` steps that each read `variables`
    from the ps tasks once; with `half`, each read of them crosses as float16.

    Unrolled, the steps' updates and the reads after them are ordered as in the loop:
    TensorFlow orders a function's ops on the same variable as they were traced."""
    unrolled = isinstance(count, int)
    if unrolled and count > most:
        group = max(every, most - most % every)  # a run of `every` is never split
        groups, rest = divmod(count, group)
        for g in tf.range(tf.constant(groups, tf.int64)):
            _loop(group, lambda i, first=g * group: step(first + i), variables, every, half,
                  most=group)
        if rest:
            _loop(rest, lambda i, first=groups * group: step(first + i), variables, every,
                  half, most=group)
        return
    steps, least = (range, min) if unrolled else (tf.range, tf.minimum)
    if every > 1 and variables:
        for start in steps(0, count, every):
            with tf_internal.variable_reads(variables, half=half):  # read where this run begins
                for i in steps(start, least(start + every, count)):
                    step(i)
        return
    # Every step reads: as float16 with `half`, else as TensorFlow does.
    reads = (tf_internal.variable_reads(variables, cache=False, half=True) if half and variables
             else contextlib.nullcontext())
    with reads:
        for i in steps(count):
            step(i)


def _by_iterator(train, coordinator, dataset_fn, loop, count_arg) -> Schedule:
    strategy = coordinator.strategy
    iterator = iter(coordinator.create_per_worker_dataset(
        lambda: strategy.distribute_datasets_from_function(dataset_fn)))

    @tf.function
    def steps(iterator, count):
        def step(_):
            strategy.run(train, args=(next(iterator),))  # nothing returned: see _epochs

        loop(count, step)

    return lambda first, count: coordinator.schedule(steps, args=(iterator, count_arg(count)))


def _by_index(train, coordinator, source: indexed.Source, order: indexed.Order,
              with_worker: bool, loop, count_arg) -> Schedule:
    strategy = coordinator.strategy
    # What `source.read` reads from, made once on each worker: a per-worker iterator
    # whose every element is the same, so it has no position to lose.
    loaded = (iter(coordinator.create_per_worker_dataset(
        lambda: indexed.loaded_dataset(source))) if source.load else None)

    @tf.function
    def steps(first, count, loaded):
        data = None if loaded is None else next(loaded)

        def step(i):
            batch = indexed.batch(source, order, data, first + i)
            if with_worker:
                worker = tf.distribute.coordinator.experimental_get_current_worker_index()
                batch = (*batch, tf.cast(worker, tf.int32))
            strategy.run(train, args=(batch,))  # nothing returned: see _epochs

        loop(count, step)

    return lambda first, count: coordinator.schedule(
        steps, args=(tf.constant(first, tf.int64), count_arg(count), loaded))


# Steps scheduled ahead of the oldest closure still running, per worker: enough to
# keep every worker busy, in at least 2 closures (one running, one waiting). The
# coordinator's queue takes 262,144, so without a bound a whole epoch is scheduled at
# once and a SIGTERM is heard only at its end, when the grace period a scheduler gives
# (30 s in Kubernetes) may be long over. The loop waits for the oldest closure with
# `RemoteValue.fetch`, which copies the closure's outputs from its worker: a worker
# that died after its closure had run would fail that copy, out of the coordinator's
# recovery (UnavailableError on the chief). So a closure returns nothing; the epoch's
# metrics are read from their variables, on the ps tasks.
AHEAD_PER_WORKER = 4


def closures_ahead(steps_per_execution: int) -> int:
    """Closures scheduled ahead per worker, at `steps_per_execution` steps each."""
    return max(2, -(-AHEAD_PER_WORKER // steps_per_execution))


def _epochs(model, schedule: Schedule, join, callback_list, backup: LoopBackup,
            epochs: range, first_step: int, steps_per_epoch: int, per_closure: int,
            ahead: int) -> None:
    """`epochs`, the first from `first_step`: closures of `per_closure` steps (fewer at
    an epoch's end) `schedule`d with their first global step, at most `ahead` of them
    running, each epoch `join`ed."""
    callback_list.on_train_begin()
    running: collections.deque = collections.deque()
    for epoch in epochs:
        model.reset_metrics()
        callback_list.on_epoch_begin(epoch)
        index = first_step if epoch == epochs.start else 0
        while index < steps_per_epoch:
            count = min(per_closure, steps_per_epoch - index)
            callback_list.on_train_batch_begin(index)
            running.append(schedule(epoch * steps_per_epoch + index, count))
            if len(running) > ahead:
                running.popleft().fetch()
            index += count
            if index < steps_per_epoch:  # the last one is saved with its epoch
                backup.step_done(epoch, index, count)
            # After the backup, as under tf_keras' fit: a step logged is saved when a
            # backup was due there (callbacks.for_training). Keras passes the last step.
            callback_list.on_train_batch_end(index - 1, None)
        join()
        running.clear()
        logs = {name: float(np.asarray(value))
                for name, value in model.get_metrics_result().items()}
        callback_list.on_epoch_end(epoch, logs)
        backup.epoch_done(epoch, steps_per_epoch)
        if model.stop_training:
            break
