"""The evaluator task's evaluations, in tf_keras: its SidecarEvaluator on the
checkpoints training saves (`callbacks.EpochCheckpoint`), until the last epoch's
or until training has finished (`app.run.evaluator`)."""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import tf_keras as keras

from app.state.workdir import CHECKPOINT_DIR, METRICS_FILE

log = logging.getLogger(__name__)


def evaluate_checkpoints(model: keras.Model, task, dataset, workdir: pathlib.Path,
                         max_evaluations: int, log_dir: pathlib.Path) -> list[dict[str, Any]]:
    """Evaluate `model` on `dataset` at each new checkpoint in `workdir`, writing
    TensorBoard to `log_dir`; each evaluation's results, with its checkpoint."""
    # An optimizer of Keras' current type: the evaluator then restores the
    # training step from the checkpoint when it has one, and never demands it.
    model.compile(optimizer=keras.optimizers.Adam(), loss=task.loss(), metrics=task.metrics())
    record = _Record(workdir / CHECKPOINT_DIR, task.metric)
    Sidecar(
        model,
        data=dataset,
        checkpoint_dir=str(workdir / CHECKPOINT_DIR),
        max_evaluations=max_evaluations,
        callbacks=[keras.callbacks.TensorBoard(str(log_dir)), record],
        workdir=workdir,
    ).start()
    return record.results


class Sidecar(keras.utils.SidecarEvaluator):
    """SidecarEvaluator that also stops when training has finished.

    Keras' evaluator stops only after the checkpoint numbered `max_evaluations`;
    a run that ends earlier (fewer epochs after a restart, or a failure) would
    leave it waiting forever. Its `_timeout_fn` is called whenever no new
    checkpoint has come for 30 s; returning True there ends the loop.
    """

    def __init__(self, *args, workdir: pathlib.Path, **kwargs):
        super().__init__(*args, **kwargs)
        self.workdir = workdir

    def _timeout_fn(self) -> bool:
        finished = (self.workdir / METRICS_FILE).exists()
        if not finished:
            log.info("no new checkpoint in %s yet; training still running",
                     self.workdir / CHECKPOINT_DIR)
        return finished


class _Record(keras.callbacks.Callback):
    """Each evaluation's results, with the checkpoint it evaluated.

    SidecarEvaluator does not say which checkpoint it restored; the newest one
    when the evaluation begins is it, unless training saved another in the
    milliseconds between the restore and this callback.
    """

    def __init__(self, checkpoints: pathlib.Path, metric: str):
        super().__init__()
        self.checkpoints, self.metric = checkpoints, metric
        self.results: list[dict[str, Any]] = []
        self._current = ""

    def on_test_begin(self, logs=None):
        import tensorflow as tf

        self._current = tf.train.latest_checkpoint(str(self.checkpoints)) or ""

    def on_test_end(self, logs=None):
        name = pathlib.Path(self._current).name
        row = {"checkpoint": name, "epoch": int(name.rsplit("-", 1)[-1]) if name else 0,
               **{k: float(v) for k, v in (logs or {}).items()}}
        self.results.append(row)
        log.info("evaluated %s: %s %.4f, loss %.4f", row["checkpoint"], self.metric,
                 row.get(self.metric, float("nan")), row.get("loss", float("nan")))
