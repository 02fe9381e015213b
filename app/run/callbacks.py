"""Keras callbacks of a training run, and the list `fit` gets.

The project's own callbacks speak to both Kerases (`Callback`); the backup and
TensorBoard callbacks are each dialect's own (`app.dialects`).
"""

from __future__ import annotations

import json
import logging
import pathlib
import time
from collections.abc import Callable

import tensorflow as tf

from app.config import Config
from app.state.workdir import BACKUP_DIR, CHECKPOINT_DIR, HISTORY_FILE, write_json

log = logging.getLogger(__name__)

# How often a held run (debug.hold_at_step) looks for its release file.
HOLD_POLL_S = 0.05


class Callback:
    """A callback both Kerases' CallbackLists take: the hooks of `keras.callbacks.Callback`
    (Keras 3) and of `tf_keras.callbacks.Callback` (Keras 2), all doing nothing, and
    `model` and `params` once the list sets them."""

    # tf_keras asks whether to pass its logs as tensors, and which batch hooks to call.
    _supports_tf_logs = False

    def __init__(self):
        self.model = None
        self.params: dict = {}

    def set_model(self, model) -> None:
        self.model = model

    def set_params(self, params: dict) -> None:
        self.params = params

    # tf_keras refuses, under ParameterServerStrategy, a callback with batch hooks
    # unless it takes its logs as tensors (`_supports_tf_logs`): only hooks a class
    # defines count.
    def _implements_train_batch_hooks(self) -> bool:
        return self._defines("on_batch_begin", "on_batch_end", "on_train_batch_begin",
                             "on_train_batch_end")

    def _implements_test_batch_hooks(self) -> bool:
        return self._defines("on_test_batch_begin", "on_test_batch_end")

    def _implements_predict_batch_hooks(self) -> bool:
        return self._defines("on_predict_batch_begin", "on_predict_batch_end")

    def _defines(self, *hooks: str) -> bool:
        return any(hasattr(type(self), hook) for hook in hooks)

    def __getattr__(self, name: str):
        # on_train_begin, on_test_batch_end, ...: every hook a class does not define.
        if name.startswith("on_"):
            return _nothing
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def _nothing(*args, **kwargs) -> None:
    return None


_nothing._is_default = True  # Keras 3 runs the batch hooks of such callbacks asynchronously


def for_training(config: Config, workdir: pathlib.Path, outdir: pathlib.Path,
                 model, throughput: Throughput, evaluations: list[Evaluation],
                 resumable: bool = True, dialect=None) -> list:
    """The callbacks of a run, in order: throughput stops its clock first; the
    evaluations add their results to the epoch's logs before the history record,
    the backup, TensorBoard and History see them (an epoch's backup is taken
    after its evaluations and history row: a run killed in between goes on from
    the backup before, and redoes the row); the step log comes after the
    backup, so a step it reports is saved when a backup was due there. Only
    fit() resumes through `Backup` (`resumable`); sync_ps.fit keeps its own."""
    backup_dir = workdir / BACKUP_DIR
    every = config.debug.log_every_steps
    cbs: list = [
        throughput,
        *evaluations,
        HistoryRecord(backup_dir / HISTORY_FILE),
        # Resumes an interrupted run; emptied when fit() ends.
        *([dialect.backup(backup_dir, config.checkpoint.every_steps)] if resumable else []),
        EpochCheckpoint(model, outdir / CHECKPOINT_DIR, keep=config.checkpoint.keep),
        dialect.tensorboard(outdir / "tensorboard"),
        *([StepLog(every, config.debug.hold_at_step, config.debug.hold_file)]
          if every or config.debug.hold_at_step else []),
    ]
    return cbs


def earlier_history(cbs: list) -> list[dict[str, float]]:
    """metrics.json's history rows of the epochs an interrupted run finished before
    this run resumed it (Keras' History holds this run's epochs only)."""
    return next((cb.earlier for cb in cbs if isinstance(cb, HistoryRecord)), [])


def history_row(epoch: int, logs: dict) -> dict[str, float]:
    """One epoch of metrics.json's history: its number from 1, then its logs."""
    return {"epoch": epoch + 1, **{k: round(float(logs[k]), 6) for k in sorted(logs)}}


class HistoryRecord(Callback):
    """Each epoch's history row, kept in the workdir until training ends, so that
    a resumed run's metrics.json covers the epochs before it too (`earlier`)."""

    def __init__(self, path: pathlib.Path):
        super().__init__()
        self.path = path
        self.earlier: list[dict[str, float]] = []
        self._rows: list[dict[str, float]] = []
        self._first: int | None = None

    def _writes(self) -> bool:
        # One writer, the task that writes the backup (MultiWorkerMirrored: worker 0).
        return self.model.distribute_strategy.extended.should_checkpoint

    def on_train_begin(self, logs=None):
        self._rows = json.loads(self.path.read_text()) if self.path.exists() else []
        self._first = None
        # A run resumed from a backup of its last epoch's end trains no epoch: all of them
        # are earlier (a SIGTERM that reached the chief as that epoch ended).
        self.earlier = list(self._rows)

    def on_epoch_begin(self, epoch, logs=None):
        if self._first is None:
            # Rows of the epochs this run redoes (written before their backup) go.
            self._first = epoch
            self.earlier = [row for row in self._rows if row["epoch"] <= epoch]
            self._rows = list(self.earlier)

    def on_epoch_end(self, epoch, logs=None):
        self._rows.append(history_row(epoch, logs or {}))
        if self._writes():
            self.path.parent.mkdir(parents=True, exist_ok=True)  # before the first backup
            write_json(self.path, self._rows)

    def on_train_end(self, logs=None):
        if self._writes():
            self.path.unlink(missing_ok=True)


class StepLog(Callback):
    """Logs `step S` every `every` steps (0 = never), S counted from the run's
    first step (a resumed run goes on counting); under a ClusterCoordinator,
    steps scheduled. The fault tests kill a task at a step read from it.

    Past step `hold_at` (0 = never), it waits until the file `hold_file` exists:
    under a ClusterCoordinator the chief schedules steps far ahead of the workers,
    so a task killed at a logged step may be killed after the run needed it last.
    """

    def __init__(self, every: int, hold_at: int = 0, hold_file: str = ""):
        super().__init__()
        self._supports_tf_logs = True  # batch hooks under ParameterServerStrategy
        self.every, self.hold_at, self.hold_file = every, hold_at, pathlib.Path(hold_file)
        self._epoch = self._begin = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self._begin = batch

    def on_train_batch_end(self, batch, logs=None):
        before = self._epoch * self.params["steps"] + self._begin
        after = self._epoch * self.params["steps"] + batch + 1
        if self.every and after // self.every > before // self.every:
            log.info("step %d", after)
        if before < self.hold_at <= after and not self.hold_file.exists():
            log.info("holding at step %d until %s exists (debug.hold_file)", after,
                     self.hold_file)
            while not self.hold_file.exists():
                time.sleep(HOLD_POLL_S)
            log.info("hold released")


class Throughput(Callback):
    """Steady-state training examples per second.

    Counts only the time between consecutive batch ends inside an epoch, so
    the first `warmup_steps` (tracing, pipeline fill), each epoch's start and
    the validation after it are left out.

    Under a ClusterCoordinator, a batch "ends" when it is scheduled, not run.
    There the clock starts once the first `warmup_steps` have *run* (the
    coordinator is joined once, at that step) and stops at the epoch's end,
    when fit() has joined it again, before any evaluation.
    """

    def __init__(self, global_batch_size: int, warmup_steps: int = 20, coordinator=None):
        super().__init__()
        self.coordinator = coordinator
        # Allows batch hooks under ParameterServerStrategy; `logs` are never read.
        self._supports_tf_logs = True
        self.global_batch_size = global_batch_size
        self.warmup_steps = warmup_steps
        self.seconds = 0.0
        self.steps = 0
        self._seen = 0
        self._last: float | None = None
        self._done_in_epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._last, self._done_in_epoch = None, 0

    def on_train_batch_end(self, batch, logs=None):
        if self.coordinator is not None:
            self._scheduled(batch + 1, self.coordinator)
            return
        now = time.perf_counter()
        done = batch + 1  # Keras passes the index of the last step run.
        new_steps = done - self._done_in_epoch
        if self._last is not None and self._seen >= self.warmup_steps:
            self.seconds += now - self._last
            self.steps += new_steps
        self._seen += new_steps
        self._last, self._done_in_epoch = now, done

    def _scheduled(self, done: int, coordinator) -> None:
        first_call = self._done_in_epoch == 0
        if self._last is None and (first_call and self._seen >= self.warmup_steps
                                   or self._seen + done >= self.warmup_steps):
            if first_call:  # nothing ran yet this epoch: count this call's steps too
                self._last, self._start_step = time.perf_counter(), 0
            else:
                coordinator.join()
                self._last, self._start_step = time.perf_counter(), done
        self._done_in_epoch = done

    def on_epoch_end(self, epoch, logs=None):
        if self.coordinator is None:
            return
        if self._last is not None:
            self.seconds += time.perf_counter() - self._last
            self.steps += self._done_in_epoch - self._start_step
        self._seen += self._done_in_epoch

    def examples_per_sec(self) -> float:
        if not self.seconds:
            return 0.0  # Too few steps past the warm-up to measure.
        return round(self.steps * self.global_batch_size / self.seconds, 1)


class Evaluation(Callback):
    """Evaluates a dataset after each epoch and adds `<prefix>*` to the epoch's logs."""

    def __init__(self, dataset: tf.data.Dataset,
                 evaluate: Callable[[tf.data.Dataset], dict[str, float]], prefix: str,
                 metric: str = "loss"):
        super().__init__()
        self.dataset, self.evaluate, self.prefix = dataset, evaluate, prefix
        self.metric = metric  # the task's headline, logged first

    def on_epoch_end(self, epoch, logs=None):
        results = self.evaluate(self.dataset)
        if logs is not None:
            logs.update({f"{self.prefix}{name}": value for name, value in results.items()})
        names = dict.fromkeys([self.metric, "loss", *results])
        log.info("epoch %d: %s", epoch + 1, ", ".join(
            f"{self.prefix}{name} {results[name]:.4f}" for name in names if name in results))


class EpochCheckpoint(Callback):
    """`tf.train.CheckpointManager` checkpoints of the model after each epoch.

    Written as `tf.train.Checkpoint(model=...)`, the layout SidecarEvaluator
    reads; the manager keeps the newest `keep`.
    """

    def __init__(self, model, directory: pathlib.Path, keep: int):
        super().__init__()
        self.manager = tf.train.CheckpointManager(
            tf.train.Checkpoint(model=model), str(directory), max_to_keep=keep)

    def on_epoch_end(self, epoch, logs=None):
        path = self.manager.save(checkpoint_number=epoch + 1)
        log.debug("checkpoint %s", path)
