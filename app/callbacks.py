"""Keras callbacks of a training run, and the list `fit` gets."""

from __future__ import annotations

import logging
import pathlib
import time
from collections.abc import Callable

import tensorflow as tf
import tf_keras as keras

from app.config import Config
from app.workdir import BACKUP_DIR, CHECKPOINT_DIR

log = logging.getLogger(__name__)


def for_training(config: Config, workdir: pathlib.Path, outdir: pathlib.Path,
                 model: keras.Model, throughput: Throughput, evaluations: list[Evaluation],
                 resumable: bool = True) -> list[keras.callbacks.Callback]:
    """The callbacks of a run, in order: throughput stops its clock before the
    backup and the evaluations, whose results join the epoch's logs before TensorBoard and
    History record them. Only fit() can resume (`resumable`): the backup restores its loop."""
    cbs: list[keras.callbacks.Callback] = [
        throughput,
        # Resumes an interrupted run from its last epoch; emptied when fit() ends.
        *([keras.callbacks.BackupAndRestore(str(workdir / BACKUP_DIR))] if resumable else []),
        *evaluations,
        EpochCheckpoint(model, outdir / CHECKPOINT_DIR, keep=config.checkpoint.keep),
        keras.callbacks.TensorBoard(str(outdir / "tensorboard"), update_freq="epoch"),
    ]
    return cbs


class Throughput(keras.callbacks.Callback):
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


class Evaluation(keras.callbacks.Callback):
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


class EpochCheckpoint(keras.callbacks.Callback):
    """`tf.train.CheckpointManager` checkpoints of the model after each epoch.

    Written as `tf.train.Checkpoint(model=...)`, the layout SidecarEvaluator
    reads; the manager keeps the newest `keep`.
    """

    def __init__(self, model: keras.Model, directory: pathlib.Path, keep: int):
        super().__init__()
        self.manager = tf.train.CheckpointManager(
            tf.train.Checkpoint(model=model), str(directory), max_to_keep=keep)

    def on_epoch_end(self, epoch, logs=None):
        path = self.manager.save(checkpoint_number=epoch + 1)
        log.debug("checkpoint %s", path)
