"""Keras callbacks of a training run, and the list `fit` gets."""

from __future__ import annotations

import logging
import pathlib
import time

import tensorflow as tf
import tf_keras as keras

from app.config import Config
from app.workdir import BACKUP_DIR

log = logging.getLogger(__name__)


def for_training(config: Config, workdir: pathlib.Path, model: keras.Model,
                 throughput: Throughput, test_ds: tf.data.Dataset | None,
                 ) -> list[keras.callbacks.Callback]:
    """The callbacks of a run, in order: test results join the epoch's logs
    before TensorBoard and History record them."""
    cbs: list[keras.callbacks.Callback] = [
        # Resumes an interrupted run from its last epoch; deleted when fit() ends.
        keras.callbacks.BackupAndRestore(str(workdir / BACKUP_DIR)),
        throughput,
    ]
    if test_ds is not None:
        cbs.append(TestEvaluation(test_ds))
    cbs += [
        EpochCheckpoint(model, workdir / "checkpoints", keep=config.checkpoint.keep),
        keras.callbacks.TensorBoard(str(workdir / "tensorboard"), update_freq="epoch"),
    ]
    return cbs


class Throughput(keras.callbacks.Callback):
    """Steady-state training examples per second.

    Counts only the time between consecutive batch ends inside an epoch, so
    the first `warmup_steps` (tracing, pipeline fill), each epoch's start and
    the validation after it are left out.
    """

    def __init__(self, global_batch_size: int, warmup_steps: int = 20):
        super().__init__()
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
        now = time.perf_counter()
        done = batch + 1  # Keras passes the index of the last step run.
        new_steps = done - self._done_in_epoch
        if self._last is not None and self._seen >= self.warmup_steps:
            self.seconds += now - self._last
            self.steps += new_steps
        self._seen += new_steps
        self._last, self._done_in_epoch = now, done

    def examples_per_sec(self) -> float:
        if not self.seconds:
            return 0.0  # Too few steps past the warm-up to measure.
        return round(self.steps * self.global_batch_size / self.seconds, 1)


class TestEvaluation(keras.callbacks.Callback):
    """Evaluates the test set after each epoch and adds `test_*` to the epoch's logs."""

    def __init__(self, dataset: tf.data.Dataset):
        super().__init__()
        self.dataset = dataset

    def on_epoch_end(self, epoch, logs=None):
        results = self.model.evaluate(self.dataset, verbose=0, return_dict=True)
        if logs is not None:
            logs.update({f"test_{name}": value for name, value in results.items()})
        log.info("epoch %d: test accuracy %.4f, test loss %.4f",
                 epoch + 1, results["accuracy"], results["loss"])


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
