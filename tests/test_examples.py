"""The example tasks (examples/regression.py, examples/mnist_png.py: a user's own code)
under every strategy: the headline metric lands in metrics.json and the export serves
raw features."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import tf_keras as keras

from app import config as cfg
from app import strategy, trainer
from app import task as tasks
from tests.conftest import one_device_reduction_mirrored

CONFIG = "examples/regression.toml"


def small(tmp_path, *overrides: str) -> list[str]:
    return [f"task.data_dir={tmp_path / 'data'}", "task.files=4", "task.examples_per_file=256",
            "task.test_examples=256", "train.epochs=2", "train.verbose=0", *overrides]


def check(metrics: dict, strategy_name: str) -> None:
    assert metrics["strategy"] == strategy_name
    assert metrics["task"] == "examples.regression:Regression"
    assert metrics["metric"] == "test_mae" and metrics["higher_is_better"] is False
    assert metrics["num_test_examples"] == 256
    # The target's spread is about 1.5; a model that learnt nothing is near 1.1 off.
    assert 0 < metrics["test_mae"] < 0.9, metrics["test_mae"]


@pytest.mark.parametrize("name, replicas", [("default", 1), ("mirrored", 2)])
def test_trains_on_one_host(tmp_path, name, replicas):
    task, config = tasks.create(cfg.load(CONFIG, small(tmp_path)))
    # Mirrored over the 2 logical CPUs, summed without collective ops (conftest).
    chosen = one_device_reduction_mirrored() if name == "mirrored" else strategy.create(name)
    metrics = trainer.run(config, tmp_path / "run", strategy=chosen, task=task)
    check(metrics, strategy.describe(chosen))
    assert metrics["num_replicas"] == replicas
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["test_mae"] == (
        metrics["test_mae"])
    model = keras.models.load_model(tmp_path / "run" / "export")
    x = np.random.default_rng(0).normal(size=(3, 8)).astype(np.float32)
    assert model.predict(x, verbose=0).shape == (3, 1)  # raw features in, a value out


@pytest.mark.slow
def test_trains_on_two_multi_worker_mirrored_processes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    args = [a for s in small(tmp_path, "task.examples_per_file=512") for a in ("--set", s)]
    result = subprocess.run(
        [sys.executable, "-m", "launch.local", "--workers", "2", "--ps", "0", "--config", CONFIG,
         *args, "--workdir", str(tmp_path / "run")],
        env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    check(metrics, "MultiWorkerMirroredStrategy")
    assert metrics["num_workers"] == 2


def test_the_readme_task_trains_in_keras3_as_written(tmp_path, monkeypatch):
    """The task of the README's "Train your own model", copied as a user would."""
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## Train your own model", 1)[1]
    (tmp_path / "my_task.py").write_text(section.split("```python\n", 1)[1].split("```", 1)[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    task, config = tasks.create(cfg.load(None, ["task.name=my_task:MyTask", "train.epochs=2",
                                                "train.verbose=0"]))
    metrics = trainer.run(config, tmp_path / "run", task=task)
    assert (metrics["keras"], metrics["metric"]) == ("keras", "test_mae")
    assert metrics["input"] == "by_index"
    assert 0 < metrics["test_mae"] < 0.9, metrics["test_mae"]  # it learnt (spread about 1.5)
    assert (tmp_path / "run" / "model.keras").exists()


def test_the_task_by_index_of_docs_tasks_md_trains_as_written(tmp_path, monkeypatch):
    """docs/tasks.md's example of a task that gives its examples by index."""
    page = (pathlib.Path(__file__).parents[1] / "docs" / "tasks.md").read_text()
    section = page.split("## Training examples by index", 1)[1]
    (tmp_path / "numbered_doc.py").write_text(
        section.split("```python\n", 1)[1].split("```", 1)[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    task, config = tasks.create(cfg.load(None, [
        "task.name=numbered_doc:Numbered", "task.examples=512", "train.epochs=1",
        "train.verbose=0", "train.global_batch_size=16"]))
    metrics = trainer.run(config, tmp_path / "run", task=task)
    assert metrics["input"] == "by_index" and metrics["steps"] == 512 // 16


def test_the_task_in_files_of_docs_tasks_md_trains_as_written(tmp_path, monkeypatch):
    """docs/tasks.md's task whose examples are in TFRecord files, read at their offsets."""
    page = (pathlib.Path(__file__).parents[1] / "docs" / "tasks.md").read_text()
    section = page.split("### Examples in files of any size", 1)[1]
    (tmp_path / "files_doc.py").write_text(section.split("```python\n", 1)[1].split("```", 1)[0])
    monkeypatch.syspath_prepend(str(tmp_path))
    task, config = tasks.create(cfg.load(None, [
        "task.name=files_doc:FromFiles", f"task.data_dir={tmp_path / 'data'}", "task.files=3",
        "task.per_file=1000", "train.epochs=2", "train.verbose=0", "train.learning_rate=0.01"]))
    metrics = trainer.run(config, tmp_path / "run", task=task)
    assert metrics["input"] == "by_index" and metrics["steps"] == 2 * (3000 // 32)
    assert metrics["test_accuracy"] > 0.8, metrics["test_accuracy"]  # chance: 0.5
    assert len(list((tmp_path / "data").glob("*.tfrecord.index"))) == 3


def png(tmp_path, keras: str) -> list[str]:
    """examples/mnist_png.py on 1,536 of MNIST's images in 3 files: 48 steps of 32."""
    return [f"task.records_dir={tmp_path.parent / 'png'}", "task.files=3",
            "task.train_examples=1536", "task.test_examples=512", f"task.keras={keras}",
            "train.epochs=1", "train.verbose=0", "data.shard_examples=256",
            "data.window_shards=2", "task.name=examples.mnist_png:MnistPng"]


def check_png(metrics: dict, keras: str) -> None:
    assert metrics["input"] == "by_index" and metrics["keras"] == keras, metrics
    assert metrics["steps"] == 48 and metrics["num_test_examples"] == 512
    assert metrics["test_accuracy"] > 0.5, metrics["test_accuracy"]  # it learnt (chance: 0.1)


@pytest.mark.parametrize("name, keras", [("default", "keras"), ("mirrored", "tf_keras")])
def test_encoded_images_in_files_train_by_index_on_one_host(tmp_path, name, keras):
    task, config = tasks.create(cfg.load(None, png(tmp_path, keras)))
    chosen = one_device_reduction_mirrored() if name == "mirrored" else strategy.create(name)
    check_png(trainer.run(config, tmp_path / "run", strategy=chosen, task=task), keras)


@pytest.mark.slow
@pytest.mark.parametrize("ps, keras", [(1, "keras"), (0, "tf_keras")])
def test_encoded_images_in_files_train_by_index_on_a_cluster(tmp_path, ps, keras):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    args = [a for s in png(tmp_path, keras) for a in ("--set", s)]
    result = subprocess.run(
        [sys.executable, "-m", "launch.local", "--workers", "2", "--ps", str(ps), *args,
         "--workdir", str(tmp_path / "run")], env=env, capture_output=True, text=True,
        timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    check_png(metrics, keras)
    assert metrics["num_workers"] == 2 and metrics["num_ps"] == ps
