"""Synchronous parameter-server training with backup workers (`ps.mode = "sync"`).

TensorFlow 2's ParameterServerStrategy trains asynchronously only. This mode
brings back TF1's `SyncReplicasOptimizer` on top of it, with backup workers
(Chen et al., "Revisiting Distributed Synchronous SGD", 2016): each update
averages the first N = workers - backup_workers contributions computed on the
current parameters and drops the rest, so a slow worker does not stall the
others.

A contribution is one run of the model's own `train_step` on a worker, scheduled
through the ClusterCoordinator as the asynchronous loop schedules its steps. Its
optimizer update is deferred, as `SyncReplicasOptimizer` deferred it: while the
step is traced, the dialect makes the optimizer's one update path (Keras 3's
`optimizer.apply`, tf_keras' `apply_gradients`) deposit the gradients into the
worker's slots on the ps tasks, tagged with the version the worker read before
its forward pass (`exchange.Exchange`, which says why each update is exact). The
chief applies the mean with the real optimizer: its clipping, weight decay,
moving averages and `iterations`, where the variables live.

What a contribution writes itself, as in the asynchronous mode: the model's
non-trainable state (BatchNormalization's moving statistics, the random layers'
generators) and the training metrics, dropped contributions included. A step
whose update cannot be deferred to one synchronous update is refused before
training (`deferral.check`): one that applies its optimizer twice or not at all, applies
another optimizer, applies it inside a conditional or a loop, or writes a
trainable variable itself.

The chief keeps workers + 1 contributions outstanding: a worker that has
contributed to the current version waits inside its next one (`Exchange.wait_turn`)
and computes on the next version as soon as it exists. So nothing may join the
coordinator while an epoch runs (it would wait for contributions that wait for the
next update): `SyncTraining.drain` is the join.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from app import indexed, tf_internal
from app.distribute.ps import deferral
from app.distribute.ps.exchange import PART_PENDING, PART_TAKEN, Exchange
from app.distribute.ps.straggler import Straggler, straggle
from app.state import backup as backups

log = logging.getLogger(__name__)

# Where the version and the workers' marks live (the strategy's first ps task).
PS0 = "/job:ps/replica:0/task:0/device:CPU:0"


@dataclasses.dataclass(frozen=True)
class Settings:
    """A sync run's shape: its workers, the backups an update does not wait for, a
    straggler (`debug.slow_worker`), the dtype gradients travel in, and how many parts
    an epoch has when contributions read their examples by index (`ByIndex`)."""

    num_workers: int
    backup_workers: int = 0
    straggler: Straggler | None = None
    push_dtype: tf.DType | None = None
    parts: int = 0  # of an epoch, when contributions read their examples by index
    half_reads: bool = False  # ps.read_compression = "fp16": reads cross as float16

    @property
    def required(self) -> int:
        return self.num_workers - self.backup_workers


class SyncTraining:
    """The exchange on the ps tasks and the functions of a sync run: a worker's
    contribution, the chief's update and its poll."""

    def __init__(self, model, train: Callable[[Any], Any], coordinator, path: deferral.UpdatePath,
                 settings: Settings):
        """`train(batch)`: the model's train step, as the asynchronous loop runs it."""
        self.model, self.train, self.coordinator = model, train, coordinator
        self.path, self.settings = path, settings
        self.exchange = Exchange(settings.num_workers, settings.required, PS0,
                                 model.trainable_variables, path.tf_variable,
                                 settings.push_dtype, settings.parts)
        self.update = tf.function(self._update)
        self.poll = tf.function(self._poll)
        # What a contribution reads as float16 (ps.read_compression), as the asynchronous
        # loop's `variables`: the TensorFlow variables of the model's trainable ones.
        self.half_read = ([path.tf_variable(v) for v in model.trainable_variables]
                          if settings.half_reads else [])

    # -- a worker's contribution -------------------------------------------------------------

    def contribute(self, read: Callable[[], Any], part: tf.Tensor | None = None) -> None:
        """Inside a function a worker runs: one contribution, on the batch `read()` gives
        (part `part` of the epoch, if numbered), once the worker's turn comes (deposited
        unless the chief drains meanwhile)."""
        exchange = self.exchange
        worker = tf.cast(tf.distribute.coordinator.experimental_get_current_worker_index(),
                         tf.int32)
        turn = exchange.wait_turn(worker)
        with tf.control_dependencies([turn]):
            trace = self._contribute(worker, read, part)
        after = [trace.deposited] if trace.deposited is not None else []
        if part is not None:
            after.append(exchange.finish(part, trace.deposited))
        with tf.control_dependencies(after):
            exchange.ended.assign_add(1, read_value=False)

    def _contribute(self, worker: tf.Tensor, read: Callable[[], Any],
                    part: tf.Tensor | None = None) -> deferral.Trace:
        """Read the version, run the train step on `read()`, deposit its gradients."""
        version, started = self.exchange.version.read_value(), tf.timestamp()
        trace = deferral.Trace(tf.compat.v1.get_default_graph())
        deposit = functools.partial(self._deposit, trace, version, worker, started, part)

        def step(batch):
            # Every read of the model's variables comes after the version's (see
            # exchange), and the deposit's look at `draining` too. Here, in the replica's
            # thread: TensorFlow's mirrored_run traces `strategy.run`'s function in a
            # thread of its own, where the caller's control dependencies do not reach.
            with tf.control_dependencies([version]):
                return self.train(batch)

        with tf.control_dependencies([version]):
            batch = read()
        # Float16 reads (as the asynchronous loop's): each made where the step reads,
        # so after the version's read as every other.
        reads = (tf_internal.variable_reads(self.half_read, cache=False, half=True)
                 if self.half_read else contextlib.nullcontext())
        with self.path.deferred(self.model.optimizer, deposit, trace.others.append), reads:
            self.coordinator.strategy.run(step, args=(batch,))
        return trace

    def _deposit(self, trace: deferral.Trace, version, worker, started, part, grads: list,
                 variables: list) -> None:
        trace.applies += 1
        graph = tf.compat.v1.get_default_graph()
        trace.in_control_flow |= tf_internal.in_control_flow(graph, trace.graph)
        known = [self.exchange.knows(v) for v in variables]
        trace.unknown += [deferral.name(v) for v, k in zip(variables, known, strict=True) if not k]
        grads = [g for g, k in zip(grads, known, strict=True) if k]
        variables = [v for v, k in zip(variables, known, strict=True) if k]
        straggler = self.settings.straggler
        if straggler:
            grads = straggle(grads, worker == straggler.worker, straggler.factor, started)
        done = self.exchange.deposit(grads, variables, version, worker, part)
        # In a nested function (a train_step of its own under tf.function) the deposit's
        # op stays there: the contribution is then counted as ended without waiting for it.
        trace.deposited = done if graph is trace.graph else None

    def check(self, batch_spec, task) -> None:
        """A ConfigError, before training, if the model's train step has an optimizer
        update that cannot be deferred to one synchronous update."""
        deferral.check(*self.trace(batch_spec), self.model, self.path, task)

    def trace(self, batch_spec):
        """(what it did with the optimizer, the traced function) of one contribution on
        batches of `batch_spec`, traced on the chief and never run."""
        traces = []
        probe = tf.function(lambda batch: traces.append(
            self._contribute(tf.constant(0, tf.int32), lambda: batch)))
        with self.coordinator.strategy.scope(), deferral.quiet(tf.get_logger()):
            concrete = probe.get_concrete_function(batch_spec)
        return traces[-1], concrete

    # -- the chief ---------------------------------------------------------------------------

    def _update(self, then_drain: tf.Tensor) -> tf.Tensor:
        """Apply the mean of the first N contributions to the current version; with
        `then_drain`, the last before `drain`."""
        return self.exchange.update(
            lambda grads, variables: self.path.apply(self.model.optimizer, grads, variables),
            then_drain)

    def _poll(self) -> tuple[tf.Tensor, tf.Tensor]:
        """(contributions to the current version, contributions ended), on ps:0."""
        with tf.device(PS0):
            return self.exchange.ready(), self.exchange.ended.read_value()

    def drain(self) -> None:
        """Wait for every contribution scheduled to end; those that have not begun end
        without running (none is waited for by an update)."""
        self.exchange.draining.assign(True)
        try:
            self.coordinator.join()
        finally:
            self.exchange.draining.assign(False)


# -- the loop ------------------------------------------------------------------------------


class Pipelines:
    """Contributions read the next batch of their worker's own pipeline (`dataset_fn`,
    one per worker): no part of an epoch is tied to a contribution."""

    parts = 0

    def __init__(self, coordinator, dataset_fn):
        strategy = coordinator.strategy
        self.iterator = iter(coordinator.create_per_worker_dataset(
            lambda: strategy.distribute_datasets_from_function(dataset_fn)))

    def args(self, part: int | None) -> tuple:
        return (self.iterator,)

    def read(self, iterator) -> Any:
        return next(iterator)

    def part(self, iterator) -> None:
        return None


class ByIndex:
    """Contributions read their examples by index (`app.indexed`): contribution j of
    epoch e trains on part j of the epoch, the (j % N)-th N-th of global batch j // N
    (N = the contributions an update takes), its examples those of the same global
    batch under any other strategy. A part whose contribution was dropped is handed
    out again, so every example trains once per epoch (`Exchange.dropped`)."""

    def __init__(self, coordinator, source: indexed.Source, order: indexed.Order,
                 required: int):
        # The global batches' order, cut into parts: the same permutation and positions.
        self.source, self.order = source, dataclasses.replace(
            order, batch=order.batch // required, steps_per_epoch=order.steps_per_epoch * required)
        self.parts = self.order.steps_per_epoch
        self.loaded = (iter(coordinator.create_per_worker_dataset(
            lambda: indexed.loaded_dataset(source))) if source.load else None)

    def args(self, part: int) -> tuple:
        return (tf.constant(part, tf.int64), self.loaded)

    def read(self, part: tf.Tensor, loaded) -> Any:
        return indexed.batch(self.source, self.order, None if loaded is None else next(loaded),
                             part)

    def part(self, part: tf.Tensor, loaded) -> tf.Tensor:
        return part % self.parts  # its number within the epoch


def fit(training: SyncTraining, source: Pipelines | ByIndex, keras, *, epochs: int,
        steps_per_epoch: int, callbacks: list, verbose, backup: SyncBackup) -> tuple[Any, dict]:
    """Train `epochs` x `steps_per_epoch` synchronous updates, `keras`' callbacks (and
    its progress bar, by `verbose` as in fit()) called as under fit(): a batch is an
    update. Each contribution reads its batch from `source`. An interrupted run goes on
    from `backup`, saved as the asynchronous loop's is.

    Returns the history and the figures of metrics.json.
    """
    if verbose == "auto":
        verbose = 2  # one line per epoch, as fit() does under a coordinator
    model, coordinator = training.model, training.coordinator

    @tf.function
    def contribution(*inputs):
        training.contribute(lambda: source.read(*inputs), source.part(*inputs))

    history = keras.callbacks.History()
    callback_list = keras.callbacks.CallbackList(
        [*callbacks, history], add_progbar=verbose != 0, model=model, epochs=epochs,
        steps=steps_per_epoch, verbose=verbose)
    first_epoch, first_step = backup.restore()
    model.stop_training = False

    def schedule(part: int | None) -> None:
        # In the strategy's scope, as the first trace of tf_keras' train step must be;
        # the update is not (Keras applies from the default replica context there).
        with coordinator.strategy.scope():
            coordinator.schedule(contribution, args=source.args(part))

    parts = _Parts(training.exchange, source.parts) if source.parts else None
    try:
        _epochs(training, _Scheduler(training, schedule, parts), callback_list, backup,
                range(first_epoch, epochs), first_step, steps_per_epoch)
    except BaseException:
        # Nothing scheduled may run on after this run, into the next one's restore.
        with contextlib.suppress(Exception):
            training.drain()
        raise
    callback_list.on_train_end()
    backup.delete()
    pushed, taken = training.exchange.pushed.numpy(), training.exchange.taken.numpy()
    return history, {"contributions": [int(t) for t in taken],
                     "pushed": [int(p) for p in pushed],
                     "stale_dropped": int(pushed.sum() - taken.sum())}


def _epochs(training: SyncTraining, schedule: _Scheduler, callback_list, backup: SyncBackup,
            epochs: range, first_step: int, steps_per_epoch: int) -> None:
    model = training.model
    callback_list.on_train_begin()
    for epoch in epochs:
        model.reset_metrics()
        callback_list.on_epoch_begin(epoch)
        first = first_step if epoch == epochs.start else 0
        schedule.begin(epoch, resumed=first > 0)
        for index in range(first, steps_per_epoch):
            callback_list.on_train_batch_begin(index)
            schedule.until_ready()
            training.update(tf.constant(index + 1 == steps_per_epoch))
            callback_list.on_train_batch_end(index, None)
            # After the callbacks: a SIGTERM during them saves this update, and stops.
            if index + 1 < steps_per_epoch:  # the last one is saved with its epoch
                backup.step_done(epoch, index + 1)
        training.drain()  # the epoch's metrics count every contribution it scheduled
        schedule.drained()
        logs = {name: float(np.asarray(value))
                for name, value in model.get_metrics_result().items()}
        callback_list.on_epoch_end(epoch, logs)
        backup.epoch_done(epoch)
        if model.stop_training:
            break


class _Parts:
    """The chief's queue of an epoch's parts to hand out (`ByIndex`): every part not
    taken yet, then the ones whose contribution was dropped, as they are."""

    def __init__(self, exchange: Exchange, per_epoch: int):
        self.exchange, self.per_epoch = exchange, per_epoch
        self.dropped = tf.function(exchange.dropped)
        self.epoch, self.pending, self.copies = 0, collections.deque(), 0

    def begin(self, epoch: int, resumed: bool) -> None:
        """A new epoch: every part pending; resumed mid-epoch, those the backup does not
        hold as taken."""
        states = self.exchange.parts.numpy() if resumed else np.zeros(self.per_epoch, np.int32)
        taken = states == PART_TAKEN
        self.exchange.parts.assign(np.where(taken, PART_TAKEN, PART_PENDING).astype(np.int32))
        self.epoch, self.pending = epoch, collections.deque(np.flatnonzero(~taken).tolist())

    def next(self) -> int | None:
        """The number of the next part to hand out (over all epochs): a pending one, else
        one whose contribution was dropped, else a copy of one still out with its
        contribution, as a backup worker's (None once none is out). The chief asks only
        while an update is short of contributions, so a copy goes out only at an epoch's
        tail, where every part left is out, perhaps with the slow worker: without it the
        update would wait for that worker. The first of a part's contributions to come
        is the one an update takes, the others are dropped (`Exchange._waited`)."""
        if not self.pending:
            self.pending.extend(self.dropped().numpy().tolist())
        if self.pending:
            return self.epoch * self.per_epoch + self.pending.popleft()
        out = np.flatnonzero(self.exchange.parts.numpy() == PART_PENDING)
        if not out.size:
            return None
        self.copies += 1
        return self.epoch * self.per_epoch + int(out[self.copies % out.size])


def poll_pause(took: Sequence[float], waited: float, poll_s: float) -> float:
    """How long the chief sleeps before its next poll, `waited` s into a wait for an
    update's contributions, the recent waits having taken `took` s: half the time left
    until the shortest of them, at least `poll_s` (all of it `poll_s` with none yet).

    Each poll costs the chief and ps:0 the CPU the workers need: a function called on
    ps:0 and two fetches. Polling every `poll_s` all through each wait, 100 updates at
    batch 512 took 24.6 CPU s on the chief and 32.5 on the ps tasks; this way 16.3 and
    26.5, and the updates came 1.25 times as fast (docs/benchmarks.md). A wait as long
    as the recent ones takes a dozen polls or so, and ends as soon. One shorter than
    all of them ends up to half the shortest late, and the next are shorter."""
    if not took:
        return poll_s
    return max(poll_s, (min(took) - waited) / 2)


class _Scheduler:
    """Keeps workers + 1 contributions outstanding until the current version has the
    contributions its update needs: every worker has one to run (or to wait in) and
    one more is queued for the first to finish. The chief polls: blocking on a ps task
    from the chief stalls that task's requests from the workers in a multi-process
    cluster (the deposits it waits for)."""

    def __init__(self, training: SyncTraining, schedule: Callable[[int | None], Any],
                 parts: _Parts | None, poll_s: float = 0.001):
        self.training, self.schedule, self.parts, self.poll_s = training, schedule, parts, poll_s
        self.scheduled = int(training.exchange.ended.numpy())
        self.outstanding = training.settings.num_workers + 1
        self.took: collections.deque[float] = collections.deque(maxlen=8)  # recent waits, s

    def begin(self, epoch: int, resumed: bool) -> None:
        if self.parts:
            self.parts.begin(epoch, resumed)

    def until_ready(self) -> None:
        required = self.training.settings.required
        coordinator = self.training.coordinator
        started = time.monotonic()
        while True:
            ready, ended = (int(value) for value in self.training.poll())
            if ready >= required:
                self.took.append(time.monotonic() - started)
                return
            coordinator.done()  # raises the error of a contribution that failed
            for _ in range(self.outstanding - (self.scheduled - ended)):
                part = self.parts.next() if self.parts else None
                if self.parts and part is None:
                    break
                self.schedule(part)
                self.scheduled += 1
            time.sleep(poll_pause(self.took, time.monotonic() - started, self.poll_s))

    def drained(self) -> None:
        self.scheduled = int(self.training.exchange.ended.numpy())


class SyncBackup(backups.Backup):
    """The backup of a sync run, where BackupAndRestore keeps fit()'s
    (<workdir>/backup/chief): the parameters and the optimizer's slots and step,
    the version, the pushed and taken counts, and the position (epoch, step).
    Keras' BackupAndRestore cannot serve here: it restores fit()'s loop only, and
    knows nothing of the version.

    Saved by the chief alone, right after an update: the parameters then are
    those of the version saved, whatever contributions are still running.
    """

    def __init__(self, training: SyncTraining, backup_dir: pathlib.Path, every_steps: int = 0):
        super().__init__(backup_dir / "chief", every_steps)
        exchange = training.exchange
        self.training = training
        self.track(model=training.model, optimizer=training.model.optimizer,
                   version=exchange.version, pushed=exchange.pushed, taken=exchange.taken,
                   parts=exchange.parts)

    def resumed(self, path: str) -> None:
        log.info("resumed from %s: epoch %d, step %d, version %d", path,
                 int(self._epoch.numpy()) + 1, int(self._step.numpy()),
                 int(self.training.exchange.version.numpy()))

    def step_done(self, epoch: int, done: int) -> None:
        """After update `done` of `epoch` (not its last): save if due, or on SIGTERM."""
        self.steps_run()
        self.at(epoch, done)
        self.stop_if_asked()
        if self.due():
            self.save()

    def epoch_done(self, epoch: int) -> None:
        self.at(epoch + 1, 0)
        self.save()
        self.stop_if_saved_and_asked()
