"""A task written the way a user would: tabular regression on data it writes itself.

Train it from the project directory (or from any directory that holds this file,
with `task.name = "regression:Regression"`):

    python -m app.train --config examples/regression.toml
    python -m launch.local --workers 2 --ps 1 --config examples/regression.toml
    python -m launch.local --workers 2 --ps 0 --config examples/regression.toml

The data: `files` TFRecord files of `examples_per_file` examples, each 8
features drawn at random and a target from a fixed nonlinear function plus
noise, written once to `data_dir` (the same bytes every time, so tasks that
write them at once cannot disagree). With at least one file per worker, each
worker reads its own files (`data.shard_policy = auto` or `file`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib

import numpy as np
import tensorflow as tf
import tf_keras as keras

from app import data
from app.task import Task, field

FEATURES = 8
SPEC = {"x": ([FEATURES], tf.float32), "y": ([1], tf.float32)}


@dataclasses.dataclass(frozen=True)
class Params:
    data_dir: str = "runs/regression-data"
    files: int = field(8, above=0)
    examples_per_file: int = field(2000, above=0)
    test_examples: int = field(2000, above=0)
    noise: float = field(0.1, minimum=0)
    hidden: int = field(64, above=0)


class Regression(Task):
    """Predict y from 8 features; the headline metric is test mean absolute error."""

    Params = Params
    metric, higher_is_better = "mae", False

    def build_model(self) -> keras.Model:
        inputs = keras.Input((FEATURES,), name="features")
        x = keras.layers.Dense(self.params.hidden, activation="relu")(inputs)
        x = keras.layers.Dense(self.params.hidden, activation="relu")(x)
        return keras.Model(inputs, keras.layers.Dense(1, dtype="float32")(x))

    def train_dataset(self, context, global_batch_size):
        files, by_record = self.shard_files(self._files("train"), context)
        examples = data.read_records(files, SPEC).map(lambda e: (e["x"], e["y"]))
        if by_record:  # fewer files than workers: every worker reads all, keeps its share
            examples = self.shard(examples, context)
        return data.batches(examples, context.get_per_replica_batch_size(global_batch_size),
                            seed=self.pipeline_seed(context), shuffle_buffer=10_000)

    def eval_dataset(self, split, batch_size):
        if split != "test":
            return None
        files = tf.data.Dataset.from_tensor_slices(self._files("test"))
        return data.read_records(files, SPEC).map(lambda e: (e["x"], e["y"])).batch(batch_size)

    def train_examples(self):
        return self.params.files * self.params.examples_per_file

    def eval_examples(self, split):
        return self.params.test_examples if split == "test" else None

    def loss(self):
        return keras.losses.MeanSquaredError()

    def metrics(self):
        return [keras.metrics.MeanAbsoluteError(name="mae")]

    def _files(self, split: str) -> list[str]:
        """The split's file names, written first if they are not there yet."""
        p = self.params
        directory = pathlib.Path(p.data_dir)
        counts = [p.examples_per_file] * p.files if split == "train" else [p.test_examples]
        paths = [directory / f"{split}-{i:03d}-of-{len(counts):03d}.tfrecord"
                 for i in range(len(counts))]
        for i, (path, count) in enumerate(zip(paths, counts, strict=True)):
            if not path.exists():
                seed = (self.seed, 0 if split == "train" else 1, i)
                _write(path, *_examples(np.random.default_rng(seed), count, p.noise))
        return [str(path) for path in paths]


def _examples(rng: np.random.Generator, count: int, noise: float):
    x = rng.normal(size=(count, FEATURES)).astype(np.float32)
    y = np.sin(x[:, 0]) + x[:, 1] * x[:, 2] + 0.5 * x[:, 3] ** 2 - x[:, 4] + 0.3 * x[:, 5]
    y += noise * rng.normal(size=count)
    return x, y.astype(np.float32)[:, None]


def _write(path: pathlib.Path, x: np.ndarray, y: np.ndarray) -> None:
    """Write atomically: a task that reads the file sees all of it or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    data.write_records(partial, {"x": x, "y": y})
    os.replace(partial, path)
