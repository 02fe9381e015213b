"""Synchronous parameter-server training with backup workers (`ps.mode = "sync"`).

TensorFlow 2's ParameterServerStrategy trains asynchronously only. This mode
brings back TF1's `SyncReplicasOptimizer` on top of it, with backup workers
(Chen et al., "Revisiting Distributed Synchronous SGD", 2016): each update
waits for the first N = workers - backup_workers gradients computed on the
current parameters and drops the rest, so a slow worker does not stall the
others. Step k:

- Workers run `contribute` (scheduled through the ClusterCoordinator, about
  one in flight per worker): read the parameter version k, compute the
  gradient of a batch of the worker's own shard, and push it, tagged k, into
  one `ConditionalAccumulator` per variable on that variable's ps task.
- The chief runs `_update`, whose ops are placed on the ps tasks: each
  accumulator's `take_grad(N)` waits for N gradients tagged k, averages those
  it holds (more than N if another arrived meanwhile) and moves on to k + 1,
  so a gradient tagged k that arrives later is dropped by the accumulator
  itself; the optimizer applies the averages where the variables live, then
  the version becomes k + 1. No gradient passes through the chief.

A "gate" accumulator on ps:0 counts, per worker, the contributions each update
took; every worker also counts what it pushed. Pushed minus taken is what was
dropped as stale. As in TF1, each accumulator takes the first N gradients *it*
receives: when two workers push at nearly the same moment, two variables can
average different workers' gradients for one step.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import time
import uuid
from collections.abc import Callable

import numpy as np
import tensorflow as tf
import tf_keras as keras

from app import tf_internal
from app.config import ConfigError
from app.state import backup as backups

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Straggler:
    """Worker `worker` sleeps until each of its steps took `factor` times as long."""

    worker: int
    factor: float


def straggle(values, is_slow: tf.Tensor, factor: float, started: tf.Tensor):
    """`values`, once a slow worker has slept (factor - 1) times the time since `started`."""
    def wait(ready: list[tf.Tensor]) -> tf.Tensor:
        with tf.control_dependencies(ready):
            seconds = (factor - 1.0) * (tf.timestamp() - started)
        return tf_internal.sleep(tf.cast(seconds * 1e6, tf.int64))

    return hold(values, is_slow, wait)


def hold(values, is_slow: tf.Tensor, wait: Callable[[list[tf.Tensor]], tf.Tensor]):
    """`values` (flattened), once `wait(values)`, an int64 tensor computed after them,
    has run where `is_slow`."""
    values = tf.nest.flatten(values)
    done = tf.cond(is_slow, lambda: wait(values), lambda: tf.constant(0, tf.int64))
    with tf.control_dependencies([done]):
        return [tf.identity(v) for v in values]


def with_worker_id(dataset_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset]):
    """`dataset_fn` whose batches also carry the index of the worker reading them
    (a ParameterServerStrategy dataset_fn: it runs on that worker)."""
    def fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        index = tf.distribute.coordinator.experimental_get_current_worker_index()
        worker = tf.cast(index, tf.int32)
        return dataset_fn(context).map(lambda features, labels: (features, labels, worker))
    return fn


def check_pairs(dataset_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset]) -> None:
    """ConfigError unless `dataset_fn`'s batches are (features, labels), which the sync
    step and the straggler's unpack. Asked on the chief before the coordinator traces
    `dataset_fn`: an error raised while it traces reaches the user as autograph's
    StagingError, a traceback."""
    spec = dataset_fn(tf.distribute.InputContext()).element_spec
    if not (isinstance(spec, tuple) and len(spec) == 2):
        raise ConfigError(
            "ps.mode = sync and debug.slow_worker train on (features, labels) batches, and "
            f"this task's training data yields {_elements(spec)}; use ps.mode = async "
            "without debug.slow_worker, or MultiWorkerMirrored")


def _elements(spec) -> str:
    if isinstance(spec, tuple) and len(spec) == 3:
        return "(features, labels, sample weights)"
    return f"{len(spec)} elements" if isinstance(spec, tuple) else "one element"


class StragglingModel(keras.Model):
    """A functional model whose train step lets one worker straggle: `debug.slow_worker`
    in asynchronous runs. Its batches carry the worker index (`with_worker_id`)."""

    straggler: Straggler

    @classmethod
    def wrap(cls, model: keras.Model, straggler: Straggler) -> StragglingModel:
        wrapped = cls(inputs=model.inputs, outputs=model.outputs, name=model.name)
        wrapped.straggler = straggler
        return wrapped

    def train_step(self, data):
        # Keras' own train step, with the straggler's sleep before the update.
        features, labels, worker = data
        started = tf.timestamp()
        with tf.GradientTape() as tape:
            predictions = self(features, training=True)
            loss = self.compute_loss(features, labels, predictions)
        grads = tape.gradient(loss, self.trainable_variables)
        grads = straggle(grads, worker == self.straggler.worker, self.straggler.factor, started)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return self.compute_metrics(features, labels, predictions, None)


class SyncTraining:
    """The accumulators, the version counter and the two functions of a sync run."""

    def __init__(self, coordinator: tf.distribute.coordinator.ClusterCoordinator,
                 model: keras.Model, loss_fn: keras.losses.Loss, num_workers: int,
                 backup_workers: int, straggler: Straggler | None = None):
        """`loss_fn` gives per-example losses (reduction NONE)."""
        self.model, self.loss_fn, self.straggler = model, loss_fn, straggler
        self.num_workers, self.required = num_workers, num_workers - backup_workers
        self.coordinator = coordinator
        self.variables = model.trainable_variables
        ps0 = self.variables[0].device
        # Accumulators live on the ps tasks under their shared names; a fresh suffix keeps
        # a new run from joining an earlier run's (on servers that outlived it).
        run = uuid.uuid4().hex[:12]
        with tf.device(ps0):
            # The parameters' version: the number of updates applied.
            self.version = tf.Variable(0, dtype=tf.int64, trainable=False, name="sync_version")
            self.pushed = tf.Variable(tf.zeros([num_workers], tf.int64), trainable=False,
                                      name="sync_pushed")
            # Contributions ended, counted after the gate's: see `poll`.
            self.ended = tf.Variable(tf.constant(0, tf.int64), trainable=False,
                                     name="sync_ended")
            self.gate = tf.compat.v1.ConditionalAccumulator(
                tf.float32, shape=[num_workers], reduction_type="SUM",
                shared_name=f"sync_gate_{run}")
        self.accumulators = []
        for i, var in enumerate(self.variables):
            with tf.device(var.device):
                self.accumulators.append(tf.compat.v1.ConditionalAccumulator(
                    var.dtype, shape=var.shape, shared_name=f"sync_grad_{i}_{run}"))
        self.contribute = tf.function(self._contribute)
        self.update = tf.function(self._update)
        self.poll = tf.function(self._poll)

    def _contribute(self, iterator) -> tf.Tensor:
        """On a worker: one gradient of the current parameters, pushed to the accumulators."""
        features, labels, worker = next(iterator)
        started = tf.timestamp()
        step = self.version.read_value()
        with tf.control_dependencies([step]), tf.GradientTape() as tape:
            predictions = self.model(features, training=True)
            loss = tf.reduce_mean(self.loss_fn(labels, predictions))
            if self.model.losses:  # regularizers
                loss += tf.add_n(self.model.losses)
        grads = tape.gradient(loss, self.variables)
        if self.straggler:
            grads = straggle(grads, worker == self.straggler.worker, self.straggler.factor,
                             started)
        pushes = [acc.apply_grad(tf.convert_to_tensor(g), local_step=step)
                  for acc, g in zip(self.accumulators, grads, strict=True)]
        mine = tf.one_hot(worker, self.num_workers)
        # Counted as pushed before the gate lets the update go: when `fit` reads
        # `pushed` after an update, every contribution that update took is in it.
        with tf.control_dependencies(pushes):
            counted = self.pushed.assign_add(tf.cast(mine, tf.int64))
        with tf.control_dependencies([counted]):
            gated = self.gate.apply_grad(mine, local_step=step)
        with tf.control_dependencies([gated]):
            ended = self.ended.assign_add(1)
        with tf.control_dependencies([ended]):
            return tf.identity(loss)

    def _poll(self) -> tuple[tf.Tensor, tf.Tensor]:
        """On ps:0: the contributions ended, then the gradients the gate holds for the
        current version. In that order, a fresh contribution counted as ended is also
        in the gate's count, so no worker that has pushed for this version looks idle."""
        ended = self.ended.read_value()
        with tf.control_dependencies([ended]):
            return ended, self.gate.num_accumulated(name="gate_num_accumulated")

    def resume_version(self) -> None:
        """After a restore: the accumulators, new, count time from 0; from the restored
        version on they take its gradients and drop older ones, as before the restart."""
        version = self.version.read_value()
        for accumulator in [*self.accumulators, self.gate]:
            accumulator.set_global_step(version)

    def _update(self) -> tf.Tensor:
        """On the ps tasks, driven by the chief: apply the mean of the first N gradients."""
        grads = [acc.take_grad(self.required) for acc in self.accumulators]
        taken = self.gate.take_grad(self.required)
        optimizer = self.model.optimizer
        optimizer.apply_gradients(zip(grads, self.variables, strict=True),
                                  skip_gradients_aggregation=True)
        with tf.control_dependencies([optimizer.iterations]):
            self.version.assign_add(1)
        return taken


@dataclasses.dataclass
class _Progress:
    """What fit() counts on the chief: contributions scheduled, updates taken per worker."""

    scheduled: int
    taken: np.ndarray


def fit(training: SyncTraining, dataset_fn, *, epochs: int, steps_per_epoch: int,
        callbacks: list[keras.callbacks.Callback], verbose: str | int = 0,
        backup: SyncBackup | None = None) -> tuple[keras.callbacks.History, dict]:
    """Train `epochs` x `steps_per_epoch` synchronous updates; Keras callbacks (and
    its progress bar, by `verbose` as in fit()) run as in fit(). With `backup`, an
    interrupted run goes on from it, and it is saved as `keras2_backup.Backup` saves
    fit()'s: at each epoch's end, every `backup.every_steps` steps, and after
    SIGTERM, when fit() raises `preemption.Preempted`.

    Returns the history and the sync figures of metrics.json.
    """
    if verbose == "auto":
        verbose = 2  # one line per epoch, as fit() does under a coordinator
    coordinator = training.coordinator
    strategy = coordinator.strategy
    iterator = iter(coordinator.create_per_worker_dataset(
        lambda: strategy.distribute_datasets_from_function(with_worker_id(dataset_fn))))
    history = keras.callbacks.History()
    callback_list = keras.callbacks.CallbackList(
        [*callbacks, history], add_progbar=verbose != 0, model=training.model, epochs=epochs,
        steps=steps_per_epoch, verbose=verbose)
    first_epoch, first_step, taken = (backup.restore() if backup
                                      else (0, 0, np.zeros(training.num_workers)))
    # Nothing is in flight yet (after a restart too: `ended` is not in the backup).
    progress = _Progress(scheduled=int(training.ended.numpy()), taken=taken)
    callback_list.on_train_begin()
    for epoch in range(first_epoch, epochs):
        callback_list.on_epoch_begin(epoch)
        losses = _train_epoch(training, iterator, callback_list, progress, backup, epoch,
                              range(first_step if epoch == first_epoch else 0, steps_per_epoch))
        logs = {"loss": float(np.mean([loss.fetch() for loss in losses]))}
        callback_list.on_epoch_end(epoch, logs)
        if backup:
            backup.epoch_done(epoch, progress.taken)
    coordinator.join()  # the contributions still running end as dropped
    callback_list.on_train_end()
    if backup:
        backup.delete()
    pushed = training.pushed.numpy()
    return history, {
        "contributions": [int(t) for t in progress.taken],
        "pushed": [int(p) for p in pushed],
        "stale_dropped": int(pushed.sum() - progress.taken.sum()),
    }


def _train_epoch(training: SyncTraining, iterator, callback_list: keras.callbacks.CallbackList,
                 progress: _Progress, backup: SyncBackup | None, epoch: int,
                 steps: range) -> list:
    """The updates `steps` of `epoch`; the RemoteValues of the losses computed for them."""
    losses = []
    for step in steps:
        callback_list.on_train_batch_begin(step)
        _gather(training, iterator, progress, losses)
        progress.taken += training.update().numpy()
        callback_list.on_train_batch_end(step, {})
        if backup and step + 1 < steps.stop:  # the last one is saved with its epoch
            backup.step_done(epoch, step + 1, progress.taken)
    return losses


def _gather(training: SyncTraining, iterator, progress: _Progress, losses: list,
            poll_s: float = 0.001) -> None:
    """Return once the current version has the gradients its update needs, keeping one
    contribution in flight per worker that has not yet pushed one for this version.

    The contributions still running (a straggler's) count, so the queue never grows.
    The count is taken again while waiting: the coordinator hands a closure to
    whichever worker asks first, so a straggler that ends a stale contribution just
    after this step's closures were queued can take the one meant for an idle fast
    worker, and the update would wait for the straggler.

    The update's `take_grad` would wait by itself, but blocking on a ps task from the
    chief stalls that task's requests from the workers in a multi-process cluster
    (the pushes it waits for), so the chief polls.
    """
    while True:
        ended, accumulated = (int(value) for value in training.poll())
        if accumulated >= training.required:
            return
        short = training.num_workers - (progress.scheduled - ended) - accumulated
        for _ in range(short):
            losses.append(training.coordinator.schedule(training.contribute, args=(iterator,)))
        progress.scheduled += max(short, 0)
        time.sleep(poll_s)


class SyncBackup(backups.Backup):
    """The backup of a sync run, where BackupAndRestore keeps fit()'s
    (<workdir>/backup/chief): the parameters and the optimizer's slots and step,
    the version counter, the pushed and taken counts, and the position (epoch,
    step). Keras' BackupAndRestore cannot serve here: it restores fit()'s loop
    only, and knows nothing of the version counter.

    Saved by the chief alone, right after an update: the parameters then are
    those of the version saved, whatever contributions are still running.
    """

    def __init__(self, training: SyncTraining, backup_dir: pathlib.Path, every_steps: int = 0):
        super().__init__(backup_dir / "chief", every_steps)
        self.training = training
        # On the chief (no strategy scope): the position, the updates taken per worker.
        self._taken = tf.Variable(tf.zeros([training.num_workers], tf.int64), trainable=False,
                                  name="backup_taken")
        self.taken = np.zeros(training.num_workers)  # so far, as of the position
        self.track(model=training.model, version=training.version, pushed=training.pushed,
                   taken=self._taken)

    def restore(self) -> tuple[int, int, np.ndarray]:
        """Restore the last backup, if there is one: (epoch, step) to go on from, and
        the updates taken so far per worker. From here on SIGTERM means save and stop."""
        epoch, step = super().restore()
        return epoch, step, self._taken.numpy().astype(np.float64)  # the gate counts in float32

    def resumed(self, path: str) -> None:
        self.training.resume_version()
        log.info("resumed from %s: epoch %d, step %d, version %d", path,
                 int(self._epoch.numpy()) + 1, int(self._step.numpy()),
                 int(self.training.version.numpy()))

    def step_done(self, epoch: int, done: int, taken: np.ndarray) -> None:
        """After update `done` of `epoch` (not its last): save if due, or on SIGTERM."""
        self.steps_run()
        self.at(epoch, done)
        self.taken = taken
        self.stop_if_asked()
        if self.due():
            self.save()

    def epoch_done(self, epoch: int, taken: np.ndarray) -> None:
        self.at(epoch + 1, 0)
        self.taken = taken
        self.save()
        self.stop_if_saved_and_asked()

    def write(self, epoch: int, step: int) -> None:
        self._taken.assign(self.taken.astype(np.int64))
        super().write(epoch, step)
