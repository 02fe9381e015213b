"""The task interface: finding a task by name, its parameters, a user's own task end
to end, and the exports that serve raw input."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from app import config as cfg
from app import strategy, trainer
from app import task as tasks
from app.tasks.mnist import Mnist

# A task as a user writes it in their own directory: a logistic regression on two
# features whose label is whether their sum is positive.
USER_TASK = '''
import dataclasses
import numpy as np
import tf_keras as keras
from app import data
from app.task import Task, field


@dataclasses.dataclass(frozen=True)
class Params:
    examples: int = field(512, above=0)


class Sums(Task):
    Params = Params
    metric, higher_is_better = "accuracy", True

    def _arrays(self, seed):
        x = np.random.default_rng(seed).normal(size=(self.params.examples, 2))
        return x.astype("float32"), (x.sum(axis=1) > 0).astype("float32")

    def build_model(self):
        inputs = keras.Input((2,))
        return keras.Model(inputs, keras.layers.Dense(1, activation="sigmoid")(inputs))

    def train_dataset(self, context, global_batch_size):
        examples = self.shard(data.from_arrays(*self._arrays(0)), context)
        return data.batches(examples, context.get_per_replica_batch_size(global_batch_size),
                            seed=self.pipeline_seed(context), shuffle_buffer=512)

    def eval_dataset(self, split, batch_size):
        return data.from_arrays(*self._arrays(1)).batch(batch_size) if split == "test" else None

    def train_examples(self):
        return self.params.examples

    def loss(self):
        return keras.losses.BinaryCrossentropy()

    def metrics(self):
        return [keras.metrics.BinaryAccuracy(name="accuracy")]


NotATask = 3
'''


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    (tmp_path / "my_tasks.py").write_text(USER_TASK)
    (tmp_path / "broken.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("my_tasks", "broken"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("name, message", [
    ("nope", "task.name = 'nope' is neither a built-in task (mnist, recommender) nor an "
             "import path like "
             "'my_package.my_module:MyTask'"),
    ("no_such_module_xyz:Task", "task.name = 'no_such_module_xyz:Task': no module named "
                                "'no_such_module_xyz' in the current directory ("),
    ("my_tasks:Missing", "task.name = 'my_tasks:Missing': module my_tasks has no 'Missing'; "
                         "its tasks are Sums"),
    ("my_tasks:NotATask", "task.name = 'my_tasks:NotATask' is a int, not a subclass of "
                          "app.task.Task"),
    ("my_tasks:Params", "task.name = 'my_tasks:Params' is a type, not a subclass of "
                        "app.task.Task"),
    ("broken:Task", "task.name = 'broken:Task': importing broken failed: module "
                    "'no_such_dependency_xyz' it imports is not installed"),
    ("my_tasks:", "task.name = 'my_tasks:' is neither a built-in task"),
])
def test_every_way_a_task_name_can_be_wrong_is_explained(user_dir, name, message):
    with pytest.raises(cfg.ConfigError) as e:
        tasks.find(name)
    assert str(e.value).startswith(message)


def test_a_users_task_is_found_with_its_parameters(user_dir):
    task, config = tasks.create(cfg.load(None, ["task.name=my_tasks:Sums", "task.examples=64"]))
    assert type(task).__name__ == "Sums" and task.params.examples == 64
    assert config.task.params == {"examples": 64}  # resolved: written to config.toml
    with pytest.raises(cfg.ConfigError, match=r"unknown key 'task.model'; keys of \[task\] are "
                                              r"examples"):
        tasks.create(cfg.load(None, ["task.name=my_tasks:Sums", "task.model=cnn"]))


@pytest.mark.slow
def test_a_users_task_trains_end_to_end_from_its_own_directory(user_dir):
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "PYTHONPATH")}
    result = subprocess.run(
        [sys.executable, "-m", "app.train", "--set", "task.name=my_tasks:Sums",
         "--set", "task.examples=2048", "--set", "train.epochs=2", "--set", "train.verbose=0",
         "--set", "train.learning_rate=0.1",
         "--workdir", "run"], cwd=user_dir, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((user_dir / "run" / "metrics.json").read_text())
    assert metrics["task"] == "my_tasks:Sums" and metrics["metric"] == "test_accuracy"
    assert metrics["test_accuracy"] > 0.9  # a linear boundary, learnt
    assert result.stdout.strip().splitlines()[-1].startswith(
        f"test_accuracy={metrics['test_accuracy']:.4f} ")


def test_the_mnist_export_serves_raw_pixels(tmp_path, tiny_datasets):
    config = cfg.load(None, ["train.epochs=1", "train.verbose=0", "task.model=mlp"])
    task = Mnist.from_arrays(*tiny_datasets, Mnist.Params(model="mlp"))
    trainer.run(config, tmp_path, strategy=strategy.create("default"), task=task)
    served = tf.saved_model.load(str(tmp_path / "export")).signatures["serving_default"]
    images, _ = tiny_datasets[2]
    (spec,) = served.structured_input_signature[1].values()
    assert spec.dtype == tf.uint8  # raw pixels in
    logits = list(served(tf.constant(images[:5])).values())[0].numpy()
    model = keras.models.load_model(tmp_path / "export")
    np.testing.assert_allclose(logits, model.predict(images[:5], verbose=0), rtol=1e-5)


def test_steps_per_epoch_is_needed_for_an_unbounded_task(tmp_path):
    class Endless(Mnist):
        def train_examples(self):
            return None

        def train_source(self):  # a pipeline only, without end
            return None

    config = cfg.load(None, ["train.epochs=1"])
    with pytest.raises(cfg.ConfigError) as e:
        trainer.run(config, tmp_path, strategy=strategy.create("default"),
                    task=Endless.from_arrays((np.zeros((8, 28, 28, 1), np.uint8),
                                              np.zeros(8, np.int64)), None, None))
    assert str(e.value) == ("task mnist reads training data without end; set "
                            "train.steps_per_epoch (e.g. --set train.steps_per_epoch=1000)")
