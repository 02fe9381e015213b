import json

import pytest
import tensorflow as tf
from tf_keras.src.utils import sidecar_evaluator

from app import config as cfg
from app import trainer
from app.planning import memory as plan_memory
from app.run import evaluator
from tests.conftest import tiny_task

SETTINGS = ["train.epochs=2", "train.global_batch_size=32", "eval.test_every_epoch=false",
            "train.verbose=0"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    config = cfg.load(None, SETTINGS)
    metrics = trainer.run(config, workdir, strategy=tf.distribute.get_strategy(),
                          task=tiny_task(config))
    return workdir, metrics


@pytest.fixture
def fast_timeout(monkeypatch):
    """Keras waits 30 s for a new checkpoint before asking whether to stop."""
    monkeypatch.setattr(sidecar_evaluator, "_CHECKPOINT_TIMEOUT_SEC", 1)


def test_evaluates_the_last_checkpoint_like_the_chief(finished_run):
    workdir, metrics = finished_run
    config = cfg.load(None, SETTINGS)
    section = evaluator.run(config, workdir, task=tiny_task(config))
    assert section["checkpoint"] == "ckpt-2" and section["epoch"] == 2
    # The same weights on the same 101 test images as the chief's own final evaluation.
    assert section["test_accuracy"] == pytest.approx(metrics["test_accuracy"], abs=1e-6)
    assert section["test_loss"] == pytest.approx(metrics["test_loss"], rel=1e-4)
    written = json.loads((workdir / "metrics.json").read_text())
    assert written["eval"] == section and written["test_accuracy"] == metrics["test_accuracy"]
    assert any((workdir / "eval" / "tensorboard").rglob("events.out.tfevents.*"))


def test_stops_when_training_finished_short_of_its_epochs(finished_run,
                                                          fast_timeout):
    workdir, _ = finished_run
    # Asked for 5 epochs, training stopped after 2: without metrics.json as the
    # signal, Keras' evaluator would wait for ckpt-5 forever.
    config = cfg.load(None, [*SETTINGS, "train.epochs=5"])
    section = evaluator.run(config, workdir, task=tiny_task(config))
    assert section["epoch"] == 2


def test_without_metrics_the_section_is_kept_in_eval_json(tmp_path, fast_timeout):
    config = cfg.load(None, SETTINGS)
    trainer.run(config, tmp_path, strategy=tf.distribute.get_strategy(), task=tiny_task(config))
    (tmp_path / "metrics.json").unlink()  # as if the chief had died after its last checkpoint
    section = evaluator.run(config, tmp_path, task=tiny_task(config), wait_for_metrics_s=0.1)
    assert json.loads((tmp_path / "eval" / "eval.json").read_text()) == {"eval": section}


def test_an_evaluator_that_cannot_hold_the_model_is_refused_before_building_it():
    # Tables of 618 MiB (scale 0.3): with TensorFlow's own 700 MiB, over 1 GiB.
    tables = ["task.name=recommender", "task.table_scale=0.3"]
    with pytest.raises(cfg.ConfigError) as e:
        plan_memory.check_evaluator(cfg.load(None, [*tables, "runtime.memory_limit_gib=1"]))
    assert str(e.value).startswith(
        "the evaluator task would peak at 1.5 GiB, over runtime.memory_limit_gib = 1 GiB: "
        "it restores each checkpoint into a whole model of its own. Evaluate on the workers "
        "instead"), e.value
    plan_memory.check_evaluator(cfg.load(None, [*tables, "runtime.memory_limit_gib=2"]))


def test_the_evaluator_task_sets_its_runtime_before_it_builds_a_model(tmp_path, monkeypatch):
    from app import strategy, train

    spec = {"chief": ["h:1"], "worker": ["h:2"]}
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": spec,
                                                "task": {"type": "evaluator", "index": 0}}))
    for name in ("TF_ENABLE_ONEDNN_OPTS", "TF_CPU_ALLOCATOR_USE_BFC"):  # main sets them
        monkeypatch.setenv(name, "")
    calls = []
    monkeypatch.setattr(strategy, "configure_runtime", lambda runtime: calls.append(
        ("runtime", runtime.intra_op_threads, runtime.thread_spinning)))
    monkeypatch.setattr(plan_memory, "check_evaluator", lambda config: calls.append("check"))
    monkeypatch.setattr(evaluator, "run", lambda config, workdir: calls.append("run") or {})
    assert train.main(["--workdir", str(tmp_path), "--set", "runtime.intra_op_threads=1",
                       "--set", "runtime.thread_spinning=false"]) == 0
    assert calls == [("runtime", 1, False), "check", "run"]
