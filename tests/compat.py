"""The compatibility suite: every zoo task (tests/zoo.py in Keras 2, tests/zoo_keras3.py
in Keras 3) under every way of training.

Each case trains through `trainer.run` as `python -m app.train` would, then is
checked against Keras itself on one process: the run's last checkpoint restored
into a model built without a strategy must give, under Keras' own `evaluate`,
the headline metric the run reported (so evaluation saw every test example once
and computed Keras' formula), and the exported SavedModel must serve the raw
test features with the same predictions. A case is refused when the run stops
before training with a ConfigError (exit 2, one line); anything else is a bug.

The results are `docs/results/compatibility.json`, rendered to `docs/compatibility.md`
(`python -m tools.compatdoc`); tests/test_compat.py checks that each run gives the
recorded outcome. Run as a script, it is one worker of a MultiWorkerMirrored
pair (TF_CONFIG set) and prints its results as JSON.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
from typing import Any

import numpy as np
import tensorflow as tf

from app import config as cfg
from app import dialects, trainer
from app import task as tasks
from app.run import optimizers
from app.state.workdir import CHECKPOINT_DIR
from tools import compatdoc

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import zoo  # noqa: E402
import zoo_keras3  # noqa: E402

# Every case of both zoos: Keras 2's by their names, Keras 3's as "keras:<name>".
KERAS3 = "keras:"
CASES: dict[str, type] = {**zoo.CASES, **{KERAS3 + k: v for k, v in zoo_keras3.CASES.items()},
                          **{KERAS3 + k: v for k, v in zoo_keras3.MIXED_DIALECT.items()}}

# Keras 2's copies of the cases whose feature the project only hands to Keras (layers
# that compute alone: an application, recurrences, convolutions, dropout, hashing; an
# IntegerLookup, the StringLookup case's table with integer keys): `make test` trains
# these in Keras 3 alone, `make compat` (COMPAT_RECORD) in both Kerases. Together they
# take minutes of the suite in Keras 2, whose path through the project every other
# Keras 2 case trains.
SAME_IN_BOTH = ("ApplicationModel", "RecurrentModel", "ConvModel", "DropoutModel",
                "HashingModel", "IntegerLookupModel")
# The cases a test run trains: every one when recording.
CHECKED = [name for name in CASES if os.environ.get("COMPAT_RECORD") or name not in SAME_IN_BOTH]

WAYS = ("one_process", "mirrored", "multi_worker_mirrored", "ps_async", "ps_sync")

# The Keras 3 cases whose feature is a layer's own arithmetic (an application,
# recurrences, convolutions, attention): MultiWorkerMirrored differs from Mirrored,
# and synchronous parameter servers from asynchronous ones, only in how gradients
# and variables cross between processes, which every other case of those ways
# exercises (BatchNorm's statistics by BatchNormModel and SyncBatchNormModel).
# `make test` trains these under one process, Mirrored and asynchronous parameter
# servers; `make compat` (COMPAT_RECORD) under every way. Together they took 85 CPU
# seconds of those two ways' columns (`TEST_CPU_LOG`, docs/testing.md), the
# application alone 51.
COMPUTE_ALONE = tuple(KERAS3 + name for name in ("ApplicationModel", "RecurrentModel",
                                                 "ConvModel", "TransformerModel"))
BY_EXCHANGE = ("multi_worker_mirrored", "ps_sync")


def checked(way: str) -> list[str]:
    """The cases a test run trains `way`."""
    if os.environ.get("COMPAT_RECORD") or way not in BY_EXCHANGE:
        return CHECKED
    return [name for name in CHECKED if name not in COMPUTE_ALONE]
# The headline metric against Keras' evaluate of the same weights on one process.
TOLERANCE = 1e-4


def check(name: str, way: str, result: dict) -> None:
    """`result` is right in itself and is the outcome docs/results/compatibility.json records
    (with COMPAT_RECORD set: record it there instead)."""
    assert result["outcome"] in ("works", "refused"), result
    if result["outcome"] == "works" and "headline" in result:
        assert result["headline_error"] <= TOLERANCE, result
        assert result["test_examples"] == zoo.TEST
        assert result["export_error"] <= 1e-3, result  # float16 outputs under mixed precision
    if result["outcome"] == "refused":
        assert "\n" not in result["reason"] and "Traceback" not in result["reason"]
    if os.environ.get("COMPAT_RECORD"):
        compatdoc.record(name, way, result, CASES[name].__doc__)
        return
    want = compatdoc.load()["results"].get(name, {}).get(way)
    assert want is not None, (f"{name} under {way} is not in {compatdoc.RESULTS}: run "
                              "`make compat` to record it")
    assert result["outcome"] == want["outcome"], (result, want)
    if want["outcome"] == "refused":
        assert result["reason"] == want["reason"]


def task_name(name: str) -> str:
    """The `task.name` of case `name`."""
    return (f"zoo_keras3:{name.removeprefix(KERAS3)}" if name.startswith(KERAS3)
            else f"zoo:{name}")


def config_for(name: str, way: str) -> cfg.Config:
    overrides = [f"task.name={task_name(name)}", "train.epochs=1", "train.global_batch_size=16",
                 "eval.batch_size=16", "checkpoint.keep=1",
                 *(f"{k}={v}" for k, v in CASES[name].overrides.items())]
    if way == "ps_sync":
        overrides.append("ps.mode=sync")
    return cfg.load(None, overrides)


def run_case(name: str, way: str, workdir: pathlib.Path, *,
             strategy: tf.distribute.Strategy | None = None, cluster=None,
             check: bool = True) -> dict[str, Any]:
    """Train zoo case `name` the `way` given; its outcome and, if it trained and
    `check`, how it compares with Keras on one process."""
    task, config = tasks.create(config_for(name, way))
    try:
        metrics = trainer.run(config, workdir, strategy=strategy, task=task, cluster=cluster)
    except cfg.ConfigError as e:
        return {"outcome": "refused", "reason": str(e)}
    if not check:
        return {"outcome": "works"}
    return {"outcome": "works", **compare(task, config, workdir, metrics)}


def compare(task: zoo.Zoo, config: cfg.Config, workdir: pathlib.Path,
            metrics: dict[str, Any]) -> dict[str, Any]:
    """The run's headline and its export against Keras on one process."""
    restore_precision = dialects.set_precision(config.train.precision)
    try:
        model = task.build_model()
        test = task.eval_dataset("test", config.eval.batch_size)
        # A model with no Input is built at its first call: before the restore, which
        # matches the checkpoint's variables with the model's.
        model(next(iter(test))[0])  # (features, labels[, sample weights])
        # The run's optimizer, built: a Keras 3 model's checkpoint holds its optimizer,
        # which the restore matches with the model's.
        optimizer = optimizers.optimizer(config, task, 1, dialects.of(model, task))
        optimizer.build(model.trainable_variables)
        model.compile(optimizer=optimizer, loss=task.loss(), metrics=task.metrics(),
                      loss_weights=task.loss_weights(), weighted_metrics=task.weighted_metrics())
        latest = tf.train.latest_checkpoint(str(workdir / CHECKPOINT_DIR))
        tf.train.Checkpoint(model=model).restore(latest).expect_partial()
        keras_result = model.evaluate(test, verbose=0, return_dict=True)
        raw = tf.nest.map_structure(lambda a: a[:8], task.arrays("test")[0])
        exported = tf.saved_model.load(str(workdir / "export"))
        served = getattr(exported, "serve", exported)(raw)  # Keras 3's endpoint, or Keras 2's
        expected = task.serving_model(model)(raw, training=False)
    finally:
        restore_precision()
    export_error = max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
                       for a, b in zip(tf.nest.flatten(served), tf.nest.flatten(expected),
                                       strict=True))
    headline = f"test_{task.metric}"
    return {"headline": headline, "reported": metrics[headline],
            "keras": float(keras_result[task.metric]),
            "headline_error": abs(metrics[headline] - float(keras_result[task.metric])),
            "test_examples": metrics.get("num_test_examples"), "export_error": export_error}


def part(index: int, parts: int) -> list[str]:
    """Part `index` of `parts` of the checked cases, which one MultiWorkerMirrored pair
    trains (`main`)."""
    return checked("multi_worker_mirrored")[index::parts]


def main() -> int:
    """One worker of a MultiWorkerMirrored pair: the cases of part INDEX of PARTS
    (`compat.py WORKDIR INDEX PARTS`), in the same order as its peer."""
    from app import strategy as strategies
    from app.cluster import tf_config as clusters

    workdir, index, parts = pathlib.Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    cluster = clusters.read()
    strategy = strategies.create("auto", cluster, cfg.Config())
    results = {}
    for name in part(index, parts):
        results[name] = run_case(name, "multi_worker_mirrored", workdir / name,
                                 strategy=strategy, cluster=cluster, check=cluster.is_chief)
    print("RESULTS " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
