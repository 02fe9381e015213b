"""One runner per strategy kind: everything that differs between ways of distributing.

The trainer calls the same few methods whichever runner it has (torchtitan's
`TrainSpec`, Lightning Fabric's `Strategy`):

- `SingleHost`: the default strategy or MirroredStrategy on one host;
- `MultiWorker`: MultiWorkerMirroredStrategy, every worker runs the loop;
- `AsyncPS`: ParameterServerStrategy with Keras fit through a ClusterCoordinator;
- `SyncPS`: ParameterServerStrategy with the synchronous loop of app/distribute/ps/sync.py.

Each owns its config checks, the batch its input pipelines build, who writes
outputs, exact evaluation, the fit loop, what is exported and its extra metrics.
`create` is the one place that asks which strategy there is.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from app import dialects, indexed, tf_internal
from app import strategy as strategies
from app.cluster import markers, memory
from app.cluster.tf_config import TaskLost, lost_peers, lost_ps
from app.config import Config, ConfigError
from app.distribute.ps import coordinated, exchange
from app.distribute.ps import straggler as stragglers
from app.distribute.ps import sync as sync_ps
from app.distribute.ps import variables as ps_variables
from app.run import callbacks as project_callbacks
from app.state.workdir import BACKUP_DIR
from app.task import Task
from app.units import human_size

log = logging.getLogger(__name__)

Evaluate = Callable[[tf.data.Dataset], dict[str, float]]
DatasetFn = Callable[[tf.distribute.InputContext], tf.data.Dataset]


class SingleHost:
    """The default strategy or MirroredStrategy: one process trains and writes."""

    resumable = True  # fit() resumes from BackupAndRestore's state

    def __init__(self, strategy: tf.distribute.Strategy, config: Config):
        self.strategy, self.config = strategy, config
        self.name = strategies.describe(strategy)
        self.all_reduces = self.name == "MirroredStrategy"
        self.coordinator = None
        self.dialect = None  # the task's Keras (app.dialects), once `build` has seen its model
        # (source, order) when the task's examples are read by index (`read_by_index`).
        self.reading: tuple[indexed.Source, indexed.Order] | None = None
        self._first_step: tf.Variable | None = None

    # -- checks and sizes -------------------------------------------------------------

    def check(self) -> None:
        """Refuse settings this kind of run cannot honour, before anything is written."""
        self._refuse(self.config.ps.mode != "async", "ps.mode = sync is "
                     "parameter-server training and this run has no ps tasks ({name}); give "
                     "TF_CONFIG chief, worker and ps jobs, or use ps.mode = async")
        self._refuse(self.config.debug.slow_worker >= 0,
                     f"debug.slow_worker = {self.config.debug.slow_worker} slows a worker of a "
                     "parameter-server cluster, and this run has none ({name}); set it to -1")
        self._refuse(self.config.ps.compression != "none",
                     f"ps.compression = {self.config.ps.compression} compresses the gradients "
                     "workers push to ps tasks, and this run has none ({name}); set it to none")
        self._refuse(self.config.ps.read_compression != "none",
                     f"ps.read_compression = {self.config.ps.read_compression} compresses the "
                     "variables workers read from ps tasks, and this run has none ({name}); "
                     "set it to none")
        self._refuse(self.config.ps.read_every != 1,
                     f"ps.read_every = {self.config.ps.read_every} reads the variables from ps "
                     "tasks less often, and this run has none ({name}); set it to 1")
        self._check_all_reduce_and_batch()

    def _check_all_reduce_and_batch(self) -> None:
        """What every kind checks: all-reduce compression needs an all-reduce, and the
        global batch must split over the replicas."""
        self._refuse(self.config.sync.compression != "none" and not self.all_reduces,
                     f"sync.compression = {self.config.sync.compression} compresses the "
                     "all-reduce of MultiWorkerMirrored and Mirrored runs, and this run has "
                     "none ({name}); set it to none")
        strategies.check_batch(self.config.train.global_batch_size, self.num_replicas)

    def _refuse(self, refused: bool, message: str) -> None:
        if refused:
            raise ConfigError(message.format(name=self.name))

    @property
    def num_replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def batches_scheduled_on(self):
        """The ClusterCoordinator a batch of fit() only is scheduled on when it ends (the
        throughput callback joins it once, after its warm-up), or None: a batch that
        ends has run."""
        return self.coordinator

    @property
    def num_workers(self) -> int:
        return 1

    @property
    def num_ps(self) -> int:
        return 0

    @property
    def shape(self) -> dict[str, Any]:
        """The cluster this run trains on, as recorded beside its backup (workdir.SHAPE_FILE)."""
        return {"strategy": self.name, "workers": self.num_workers, "ps": self.num_ps,
                "replicas": self.num_replicas}

    @property
    def input_batch(self) -> int:
        """The global batch the input pipelines split (`get_per_replica_batch_size`)."""
        return self.config.train.global_batch_size

    @property
    def writes(self) -> bool:
        """Whether this process writes the run's results where the user looks."""
        return True

    def outdir(self, workdir: pathlib.Path) -> pathlib.Path:
        return workdir if self.writes else pathlib.Path(tempfile.mkdtemp(prefix="outputs-"))

    @contextlib.contextmanager
    def guard(self, workdir: pathlib.Path) -> Iterator[None]:
        """Turn the failures of this kind of run into the errors users act on."""
        yield

    # -- the run -----------------------------------------------------------------------

    def build(self, task: Task, make_optimizer: Callable[[Any], Any]) -> Any:
        """The task's model, its variables created under the strategy, compiled with
        `make_optimizer(dialect)`, in the Keras the model is written in."""
        with self.strategy.scope():
            model = task.build_model()
            self.dialect = dialects.of(model, task)
            self.dialect.check_runner(self.config.debug, task,
                                      parameter_servers=self.coordinator is not None,
                                      synchronous_ps=self.synchronous_ps)
            model = self.wrap(model)
            optimizer = make_optimizer(self.dialect)
            dialects.check_optimizer(optimizer, self.dialect, task)
            self.dialect.compile(model, optimizer, task, self.config.train)
            self.build_optimizer(model, task)  # slots now, for placement
        return model

    def build_optimizer(self, model, task: Task) -> None:
        self.dialect.build_optimizer(model, self.train_fn(task), self.slot_device())

    # Whether a step this kind of run runs again (after a worker died) may have been
    # applied already, when it reads a task's examples by index (app.indexed).
    reruns_applied_steps = False
    # Whether its input pipelines read examples from files a window ahead
    # (indexed.dataset), rather than a batch at a time inside each step.
    reads_ahead = True
    # Whether updates are ps.mode = sync's, in that loop's own step (app/distribute/ps/sync.py).
    synchronous_ps = False

    def read_by_index(self, source: indexed.Source, order: indexed.Order) -> None:
        """Train on `source`'s examples in `order`, from the step the backup restores."""
        self.reading = (source, order)
        # Read by the input pipelines when they start, once fit() restored the backup
        # (`_FirstStep`); on the CPU, beside them, outside the strategy's scope.
        with tf.device("/cpu:0"):
            self._first_step = tf.Variable(0, dtype=tf.int64, trainable=False)

    def train_fn(self, task: Task) -> DatasetFn:
        """The task's training input at the batch this kind of run splits."""
        if self.reading:
            source, order = self.reading
            return functools.partial(indexed.dataset, source, order,
                                     first_step=self._first_step.read_value)
        return functools.partial(task.train_dataset, global_batch_size=self.input_batch)

    def slot_device(self) -> contextlib.AbstractContextManager:
        """Where the optimizer's slots get their initial values."""
        return contextlib.nullcontext()

    def wrap(self, model) -> Any:
        return model

    def report(self) -> list[str]:
        """Lines for the log once the model is built (where its variables live)."""
        return []

    def evaluator(self, model, task: Task) -> Evaluate:
        """evaluate(dataset) -> {"loss": ..., metric: ...}, every example exactly once."""
        return lambda dataset: self.dialect.evaluate(model, dataset)

    def fit(self, model, dataset_fn: DatasetFn, callbacks: list, steps_per_epoch: int,
            workdir: pathlib.Path) -> Any:
        """Train; `callbacks` hold the backup fit() resumes from (in `workdir`)."""
        if self.reading:  # after the backup's callback, which restores the step
            callbacks = [*callbacks, _FirstStep(self._first_step, self.dialect)]
        return self.dialect.fit(model, dataset_fn, self.strategy, callbacks,
                                self.config.train.epochs, steps_per_epoch,
                                _verbose(self.config.train.verbose))

    def serving(self, model) -> Any:
        """The trained model to export."""
        return model

    def metrics(self, model) -> dict[str, Any]:
        """What metrics.json records about this kind of run beyond the common fields."""
        return {}

    def finish(self, outdir: pathlib.Path, workdir: pathlib.Path) -> None:
        if outdir != workdir:
            shutil.rmtree(outdir, ignore_errors=True)


class _FirstStep(project_callbacks.Callback):
    """Sets where by-index input pipelines start: the optimizer's step once the backup
    is restored (0 in a fresh run). Keras makes its iterator after on_train_begin."""

    def __init__(self, first_step: tf.Variable, dialect):
        super().__init__()
        self.first_step, self.dialect = first_step, dialect

    def on_train_begin(self, logs=None):
        step = self.dialect.tf_variable(self.model.optimizer.iterations)
        self.first_step.assign(tf.cast(step.read_value(), tf.int64))


def _stopped(workdir: pathlib.Path) -> str:
    """What a lost task's error tells the user to do."""
    return (f"training stopped (exit code {TaskLost.exit_code}). Restart it with the lost task "
            "(launch.local --max-restarts, or the cluster's restart policy; both retry "
            f"{TaskLost.exit_code}): it resumes from {workdir / BACKUP_DIR}")


class MultiWorker(SingleHost):
    """MultiWorkerMirroredStrategy: every worker runs the same loop and takes part in
    every collective, saving included; only the chief writes where the user looks."""

    def __init__(self, strategy, config, cluster=None):
        super().__init__(strategy, config)
        self.cluster, self.all_reduces = cluster, True

    @property
    def num_workers(self) -> int:
        if self.cluster is None:
            return 1
        return len(self.cluster.jobs.get("chief", ())) + self.cluster.num_workers  # a chief trains

    @property
    def writes(self) -> bool:
        return self.cluster is None or self.cluster.is_chief

    @contextlib.contextmanager
    def guard(self, workdir):
        try:
            yield
        except tf.errors.UnavailableError as e:
            if self.cluster is None:
                raise
            # A peer that stops answering mid-collective (dead, or cut off) fails every
            # worker's step: synchronous training cannot go on without it.
            raise TaskLost(f"{lost_peers(e.message, self.cluster)} became unreachable during "
                           f"an all-reduce; {_stopped(workdir)}") from None

    def metrics(self, model):
        # The same on every worker, if synchronous training kept its promise.
        digest = weights_digest(model)
        log.info("weights sha256 %s", digest)
        return {"weights_sha256": digest}


# tf_keras 2.21 refuses the policy under ParameterServerStrategy: float16 needs loss
# scaling, which its LossScaleOptimizer cannot do there (policy.py, base_layer.py).
MIXED_FLOAT16 = ("the mixed_float16 policy (train.precision, or a layer's dtype) needs loss "
                 "scaling, which Keras does not support under {name}; use train.precision = "
                 "mixed_bfloat16 (no loss scaling) or float32, or a Mirrored or "
                 "MultiWorkerMirrored strategy")


class AsyncPS(SingleHost):
    """ParameterServerStrategy: the chief runs Keras fit, whose steps a
    ClusterCoordinator schedules on the workers; variables live on the ps tasks."""

    # The coordinator runs a dead worker's step again, whose update may have landed.
    reruns_applied_steps = True
    reads_ahead = False

    def __init__(self, strategy, config, cluster):
        super().__init__(strategy, config)
        if cluster is None:
            raise ValueError("a parameter-server run needs its cluster "
                             "(app.cluster.tf_config.Cluster)")
        self.cluster = cluster
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
        self._workers, self._ps = cluster.num_workers, cluster.num_ps
        self.straggler = self._straggler()
        self.placement: ps_variables.Placement | None = None
        self.steps = None  # what the dialect's build_coordinated readied

    def check(self) -> None:
        # ps.* and debug.slow_worker are this kind's own settings: only the shared checks.
        self._refuse(self.config.train.precision == "mixed_float16", MIXED_FLOAT16)
        self._refuse(self.config.train.deterministic,
                     "train.deterministic = true repeats a synchronous run bit for bit across "
                     "a resume; under {name} the workers' updates reach the ps tasks in "
                     "whatever order they finish, so no run repeats. Set it to false, or train "
                     "with MultiWorkerMirrored (no ps tasks)")
        every, steps = self.config.ps.read_every, self.config.train.steps_per_execution
        # A closure reads the variables at its first step, so m > k reads as m = k would,
        # and at k = 1 (the default) every step reads whatever m says. Checked here, not
        # with the config: a run without ps tasks, or a synchronous one, refuses m > 1
        # itself, and the advice to raise k would lead only to that refusal.
        self._refuse(every > steps,
                     f"ps.read_every = {every} reads the variables once every {every} steps "
                     "of a closure, and a closure runs train.steps_per_execution = "
                     f"{steps}: set train.steps_per_execution to {every} or more, or "
                     f"ps.read_every to {steps} or less")
        self._check_all_reduce_and_batch()

    def _straggler(self) -> stragglers.Straggler | None:
        index = self.config.debug.slow_worker
        if index < 0:
            return None
        if index >= self._workers:
            raise ConfigError(f"debug.slow_worker = {index} is not a worker of this cluster "
                              f"(0 to {self._workers - 1})")
        return stragglers.Straggler(index, self.config.debug.slow_factor)

    @property
    def num_workers(self) -> int:
        return self._workers

    @property
    def num_ps(self) -> int:
        return self._ps

    @contextlib.contextmanager
    def guard(self, workdir):
        try:
            yield
        except tf.errors.OpError as e:
            # tf_keras' fit may raise a step cancelled behind the one that failed.
            failure = coordinated.failure_behind(self.coordinator, e)
            # The coordinator stops at the first unreachable ps (its variables are gone);
            # carrying on is impossible, waiting is pointless. A ps restarted on its
            # address (a pod restarts in seconds) before a step reached it answers, but
            # without the variables it held: as lost.
            unreachable = isinstance(failure, tf.errors.UnavailableError)
            if unreachable or (isinstance(failure, tf.errors.OpError)
                               and tf_internal.is_ps_failure(failure)):
                what = ("became unreachable" if unreachable
                        else "failed or was restarted: its variables are gone")
                raise TaskLost(
                    f"parameter server {lost_ps(failure.message, self.cluster.jobs['ps'])} "
                    f"{what}; {_stopped(workdir)}") from None
            if isinstance(failure, tf.errors.CancelledError):
                # No other error kept: TensorFlow cancels steps when a connection between
                # the tasks fails mid-step. A network partition is transient: a retry,
                # not a failure.
                said = (failure.message.strip().splitlines() or ["no message"])[0]
                raise TaskLost(
                    f"TensorFlow's ClusterCoordinator cancelled the training steps ({said}), "
                    "as it does when a connection between the tasks fails; "
                    f"{_stopped(workdir)}") from None
            if failure is e:
                raise
            raise failure from e

    def build(self, task, make_optimizer):
        try:
            model = super().build(task, make_optimizer)
        except ValueError as e:  # a layer of the task's own with a mixed_float16 policy
            if "Mixed precision is not supported" not in str(e):
                raise
            raise ConfigError(MIXED_FLOAT16.format(name=self.name)) from None
        self.placement = ps_variables.placement(
            self.dialect.variables(model, model.optimizer), self._ps)
        return model

    def build_optimizer(self, model, task):
        self.steps = self.dialect.build_coordinated(model, task, self.train_fn(task),
                                                    self.slot_device())

    @property
    def resumable(self) -> bool:
        # By index, both Kerases train in the project's loop, with its own backup.
        return self.dialect.resumes_by_callback(by_index=self.reading is not None)

    def slot_device(self):
        # Keras' optimizers compute each slot's initial value eagerly, as a tensor
        # of the variable's shape, before creating the slot beside its variable
        # (Adagrad's accumulators, Adam's zeros): on the chief, one table shard
        # at a time (256 MiB more chief memory with the recommender's tables 8x).
        # Made on a ps task, the value goes from there to its slot's task.
        return tf.device("/job:ps/replica:0/task:0/device:CPU:0")

    def report(self):
        return self.placement.report()

    def wrap(self, model):
        return stragglers.StragglingModel.wrap(model, self.straggler) if self.straggler else model

    def evaluator(self, model, task):
        return self.dialect.ps_evaluator(model, self.coordinator, self._workers)

    def fit(self, model, dataset_fn, callbacks, steps_per_epoch, workdir):
        if self.straggler:
            stragglers.check_pairs(dataset_fn)
        dataset_fn = per_worker(dataset_fn, self._workers)
        if self.straggler:  # its train step needs to know which worker reads the batch
            dataset_fn = stragglers.with_worker_id(dataset_fn)
        return self.dialect.fit_coordinated(
            model, self.steps, self.coordinator, dataset_fn, callbacks, self.config.train.epochs,
            steps_per_epoch, _verbose(self.config.train.verbose), workdir / BACKUP_DIR,
            self.config.checkpoint.every_steps, reading=self.reading,
            with_worker=self.straggler is not None, workers=self._workers,
            closures=coordinated.Closures.of(self.config.train, self.config.ps))

    def serving(self, model):
        # The trained model itself: saved under the strategy, each ShardedVariable is
        # written shard by shard by the ps task that holds it (TF's MultiDeviceSaver
        # places each save op with its variable), and the SavedModel's serving graph
        # reads one whole variable per table (ShardedVariable's saving variable),
        # restored from those slices when TensorFlow Serving loads it. The chief
        # traces the functions and never holds a table.
        return model

    def finish(self, outdir, workdir):
        super().finish(outdir, workdir)
        # Last, after metrics.json: the ps and worker tasks stop only once told, as a
        # chief that merely went away is waited for (app.cluster.serving.serve).
        markers.tell_finished(self.cluster)

    def metrics(self, model):
        figures = {"ps_bytes": self.placement.ps_bytes, "ps_balance": self.placement.balance,
                   "ps_partitioner": self.config.ps.partitioner, "mode": self.config.ps.mode,
                   "backup_workers": 0}
        if self.straggler:
            figures["slow_worker"] = self.straggler.worker
            figures["slow_factor"] = self.straggler.factor
        return figures


class SyncPS(AsyncPS):
    """ParameterServerStrategy in `ps.mode = sync`: each update averages the first
    `workers - backup_workers` contributions, each a run of the model's own train step
    on a worker (app/distribute/ps/sync.py); a global batch is the examples of one
    update, split over those workers."""

    resumable = False  # its own loop and backup (sync_ps.SyncBackup), not BackupAndRestore's
    # By index, each contribution trains on a numbered part of a global batch, and an
    # update never takes a part twice, a contribution run again included (sync_ps.ByIndex).
    reruns_applied_steps = False
    synchronous_ps = True

    def __init__(self, strategy, config, cluster):
        super().__init__(strategy, config, cluster)
        self.figures: dict[str, Any] = {}
        self.training: sync_ps.SyncTraining | None = None  # once `build` made the model

    def check(self) -> None:
        backup, steps = self.config.ps.backup_workers, self.config.train.steps_per_execution
        self._refuse(backup >= self._workers,
                     f"ps.backup_workers = {backup} must be less than the number of workers "
                     f"({self._workers}): each update needs at least one gradient")
        self._refuse(self.config.ps.read_every != 1,
                     f"ps.read_every = {self.config.ps.read_every} is for ps.mode = async: "
                     "each step of the synchronous loop reads the variables; set it to 1, or "
                     "use ps.mode = async")
        # The chief applies each update between contributions (sync.fit), so a closure
        # of several steps would wait inside itself for updates it holds back.
        self._refuse(steps != 1,
                     f"train.steps_per_execution = {steps} runs {steps} steps a scheduled "
                     "closure; in ps.mode = sync a closure is one worker's contribution to an "
                     "update the chief applies between closures: set it to 1, or use "
                     "ps.mode = async")
        super().check()
        strategies.check_batch(self.config.train.global_batch_size, self.required,
                               "the workers each update waits for (workers - "
                               "ps.backup_workers)")

    @property
    def required(self) -> int:
        return self._workers - self.config.ps.backup_workers

    @property
    def input_batch(self) -> int:
        # Each worker's batch is 1/required of an update's examples; the input
        # pipeline splits its global batch over one replica.
        return self.config.train.global_batch_size // self.required

    def wrap(self, model):
        return model  # the straggler sleeps in sync_ps's contributions

    @property
    def batches_scheduled_on(self):
        # A batch is an update, applied when it ends. A join mid-epoch would wait for
        # the contributions that wait for the next update.
        return None

    def build(self, task, make_optimizer):
        model = super().build(task, make_optimizer)
        # Out of the strategy's scope: the exchange's slots go beside their variables.
        train, path = self.dialect.sync_steps(model, self.steps, task)
        parts = self.reading[1].steps_per_epoch * self.required if self.reading else 0
        push_dtype = tf.float16 if self.config.ps.compression == "fp16" else None
        self._check_slots(model, path.tf_variable, push_dtype)
        self.training = sync_ps.SyncTraining(model, train, self.coordinator, path, sync_ps.Settings(
            self._workers, self.config.ps.backup_workers, self.straggler,
            push_dtype=push_dtype, parts=parts,
            half_reads=self.config.ps.read_compression == "fp16"))
        # Before training: a step whose update cannot be deferred is refused in one line.
        self.training.check(self.train_fn(task)(tf.distribute.InputContext()).element_spec,
                            task)
        return model

    def _check_slots(self, model, tf_variable, push_dtype) -> None:
        """Before the slots are made: a ConfigError if a ps task's would not fit
        runtime.memory_limit_gib beside its variables; a warning for each sharded
        variable (a table), whose sparse gradients the slots hold dense."""
        slots = exchange.slot_bytes(model.trainable_variables, self._workers, tf_variable,
                                    push_dtype)
        scale = "" if push_dtype is None else ", as float16"
        for variable in model.trainable_variables:
            shards = getattr(tf_variable(variable), "variables", None)
            if shards and len(shards) > 1:
                nbytes = sum(s.shape.num_elements() for s in shards) * (
                    push_dtype or shards[0].dtype).size
                log.warning(
                    "ps.mode = sync holds the gradients of %s (sharded over %d ps tasks) "
                    "dense: %d workers' slots of %s each (%s in all%s), where ps.mode = async "
                    "sends only the rows a batch looks up",
                    getattr(variable, "path", variable.name), len(shards), self._workers,
                    human_size(nbytes), human_size(self._workers * nbytes), scale)
        limit_gib = self.config.runtime.memory_limit_gib
        if not limit_gib:
            return
        held: dict[str, int] = {}
        for variable in self.dialect.variables(model, model.optimizer):
            for part in getattr(variable, "variables", [variable]):
                held[part.device] = held.get(part.device, 0) + (
                    part.shape.num_elements() * part.dtype.size)
        for device, nbytes in sorted(slots.items()):
            total = memory.BASELINE_BYTES + held.get(device, 0) + nbytes
            if total > limit_gib * memory.GIB:
                spec = tf.DeviceSpec.from_string(device)
                raise ConfigError(
                    f"ps.mode = sync needs {human_size(nbytes)} of gradient slots on "
                    f"{spec.job}:{spec.task} ({self._workers} workers' dense copies of its "
                    f"trainable variables{scale}), {human_size(total)} with TensorFlow and its "
                    f"variables, over runtime.memory_limit_gib = {limit_gib:g} GiB; add ps "
                    "tasks, set ps.compression = \"fp16\", raise the limit, or train with "
                    "ps.mode = \"async\"")

    def report(self):
        held = self.training.exchange.slot_bytes()
        return [*super().report(),
                f"sync slots ({self._workers} workers' gradients beside each trainable "
                "variable): " + ", ".join(f"{tf.DeviceSpec.from_string(d).job}:"
                                          f"{tf.DeviceSpec.from_string(d).task} {human_size(b)}"
                                          for d, b in sorted(held.items()))]

    def fit(self, model, dataset_fn, callbacks, steps_per_epoch, workdir):
        source = (sync_ps.ByIndex(self.coordinator, *self.reading, self.required)
                  if self.reading else
                  sync_ps.Pipelines(self.coordinator, per_worker(dataset_fn, self._workers)))
        history, self.figures = sync_ps.fit(
            self.training, source, self.dialect.keras,
            epochs=self.config.train.epochs, steps_per_epoch=steps_per_epoch,
            callbacks=callbacks, verbose=_verbose(self.config.train.verbose),
            backup=sync_ps.SyncBackup(self.training, workdir / BACKUP_DIR,
                                      self.config.checkpoint.every_steps))
        return history

    def metrics(self, model):
        return {**super().metrics(model), "backup_workers": self.config.ps.backup_workers,
                **self.figures}


def create(config: Config, cluster=None, strategy: tf.distribute.Strategy | None = None
           ) -> SingleHost:
    """The runner for `strategy`, or for the strategy the config and cluster imply."""
    strategy = strategy or strategies.create(config.runtime.strategy, cluster, config)
    kind = strategies.describe(strategy)
    if kind == "ParameterServerStrategy":
        return (SyncPS if config.ps.mode == "sync" else AsyncPS)(strategy, config, cluster)
    if kind == "MultiWorkerMirroredStrategy":
        return MultiWorker(strategy, config, cluster)
    return SingleHost(strategy, config)


def per_worker(dataset_fn: DatasetFn, num_workers: int) -> DatasetFn:
    """`dataset_fn` with an InputContext of one pipeline per worker.

    Under ParameterServerStrategy the InputContext is always one pipeline, id 0,
    and every worker would read the same data. The public way to know which
    worker a dataset_fn runs on is `experimental_get_current_worker_index()`, a
    value captured when the function runs on that worker.
    """
    def fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        index = tf.distribute.coordinator.experimental_get_current_worker_index()
        return dataset_fn(tf.distribute.InputContext(
            num_input_pipelines=num_workers, input_pipeline_id=index,
            num_replicas_in_sync=context.num_replicas_in_sync))
    return fn


def weights_digest(model) -> str:
    digest = hashlib.sha256()
    for array in model.get_weights():
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()[:16]


def _verbose(setting: str) -> str | int:
    return setting if setting == "auto" else int(setting)
