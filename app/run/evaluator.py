"""The `evaluator` task: Keras' SidecarEvaluator on the checkpoints in the shared workdir
(`app.dialects.keras2_sidecar`).

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

from app import data
from app import task as tasks
from app.config import Config
from app.dialects import keras2_sidecar
from app.state.workdir import METRICS_FILE, write_json

log = logging.getLogger(__name__)

EVAL_DIR = "eval"


def run(config: Config, workdir: pathlib.Path, *, task: tasks.Task | None = None,
        wait_for_metrics_s: float = 600.0) -> dict[str, Any]:
    """Evaluate training's checkpoints as they appear; return and record the `eval` section."""
    if task is None:
        task, config = tasks.create(config)
    # Keras 2 (tf_keras): the SidecarEvaluator is tf_keras' own.
    results = keras2_sidecar.evaluate_checkpoints(
        task.build_model(), task, data.exact(task.eval_dataset("test", config.eval.batch_size)),
        workdir, max_evaluations=config.train.epochs,
        log_dir=workdir / EVAL_DIR / "tensorboard")
    section: dict[str, Any] = {"evaluations": results}
    if task.eval_examples("test") is not None:
        section["num_test_examples"] = task.eval_examples("test")
    if results:
        last = results[-1]
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
