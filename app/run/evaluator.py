"""The `evaluator` task: Keras' SidecarEvaluator on the checkpoints in the shared workdir.

Training saves `checkpoints/ckpt-<epoch>` after every epoch
(`callbacks.EpochCheckpoint`). The evaluator evaluates each new one on the
test set, writes its own TensorBoard under `eval/tensorboard`, stops after
the last epoch's checkpoint (or once training has written metrics.json and
no new checkpoint comes), and adds its figures to metrics.json as `eval`.
It takes no part in the training cluster: no server, nothing to wait for.
"""

from __future__ import annotations

import json
import logging
import pathlib
import time
from typing import Any

import tf_keras as keras

from app import data
from app import task as tasks
from app.config import Config
from app.state.workdir import CHECKPOINT_DIR, METRICS_FILE, write_json

log = logging.getLogger(__name__)

EVAL_DIR = "eval"


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


def run(config: Config, workdir: pathlib.Path, *, task: tasks.Task | None = None,
        wait_for_metrics_s: float = 600.0) -> dict[str, Any]:
    """Evaluate training's checkpoints as they appear; return and record the `eval` section."""
    if task is None:
        task, config = tasks.create(config)
    model = task.build_model()
    # An optimizer of Keras' current type: the evaluator then restores the
    # training step from the checkpoint when it has one, and never demands it.
    model.compile(optimizer=keras.optimizers.Adam(), loss=task.loss(), metrics=task.metrics())
    record = _Record(workdir / CHECKPOINT_DIR, task.metric)
    Sidecar(
        model,
        data=data.exact(task.eval_dataset("test", config.eval.batch_size)),
        checkpoint_dir=str(workdir / CHECKPOINT_DIR),
        max_evaluations=config.train.epochs,
        callbacks=[keras.callbacks.TensorBoard(str(workdir / EVAL_DIR / "tensorboard")), record],
        workdir=workdir,
    ).start()
    section: dict[str, Any] = {"evaluations": record.results}
    if task.eval_examples("test") is not None:
        section["num_test_examples"] = task.eval_examples("test")
    if record.results:
        last = record.results[-1]
        section.update(checkpoint=last["checkpoint"], epoch=last["epoch"],
                       **{f"test_{k}": v for k, v in last.items()
                          if k not in ("checkpoint", "epoch")})
    add_to_metrics(workdir, "eval", section, wait_s=wait_for_metrics_s)
    return section


def add_to_metrics(workdir: pathlib.Path, key: str, value: Any, wait_s: float) -> None:
    """Add `key` to metrics.json once training has written it; replace the file atomically.

    The chief writes metrics.json once, after its own final evaluation and
    export, which usually ends after the evaluator's last evaluation. If it
    never comes, the section goes to `eval.json` instead, so nothing is lost.
    """
    path = workdir / METRICS_FILE
    deadline = time.monotonic() + wait_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(1.0)
    if not path.exists():
        fallback = workdir / EVAL_DIR / "eval.json"
        fallback.parent.mkdir(parents=True, exist_ok=True)
        write_json(fallback, {key: value})
        log.warning("training wrote no %s within %.0f s; wrote %s", METRICS_FILE, wait_s,
                    fallback)
        return
    metrics = json.loads(path.read_text())
    metrics[key] = value
    write_json(path, metrics)
