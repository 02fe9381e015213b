"""A task whose examples are numbered and whose model counts how often it trained on
each: metrics.json then says what an epoch saw (tests/test_data_service.py,
experiments/visitation.py).

The training data is the numbers 0 .. PASSES * examples - 1 in order: numbers
below `examples` are the first epoch's examples, the rest stand for the epochs
after it, read early when a failure lost batches in flight. A `Visits` layer
adds 1 per training example to a variable on the parameter servers (or the
replicas), so a step counts only where its update was applied.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import tensorflow as tf
import tf_keras as keras

from app import data, indexed
from app.config import field
from app.task import Task

PASSES = 4


@dataclasses.dataclass(frozen=True)
class Params:
    # Examples in one epoch.
    examples: int = field(4096, above=0)
    # Floating-point operations per example (a matmul chain), so that steps take time.
    width: int = field(64, above=0)


class Visits(keras.layers.Layer):
    """Counts the examples of each training batch, by number; passes them on as floats."""

    def __init__(self, size: int, **kwargs):
        super().__init__(**kwargs)
        self.size = size

    def build(self, input_shape):
        # Summed over replicas (Mirrored, MultiWorkerMirrored): each adds its own examples.
        self.counts = self.add_weight("counts", shape=(self.size,), initializer="zeros",
                                      trainable=False, aggregation=tf.VariableAggregation.SUM)

    def call(self, ids, training=None):
        if training:
            ones = tf.ones_like(ids, tf.float32)
            self.counts.scatter_add(tf.IndexedSlices(ones, ids))
        return tf.cast(ids % 1000, tf.float32)[:, None] / 1000.0

    def get_config(self):
        return {**super().get_config(), "size": self.size}


class Numbered(Task):
    Params = Params

    def build_model(self):
        ids = keras.Input((), dtype=tf.int64)
        x = Visits(PASSES * self.params.examples, name="visits")(ids)
        x = keras.layers.Dense(self.params.width, activation="relu")(x)
        x = keras.layers.Dense(self.params.width, activation="relu")(x)
        return keras.Model(ids, keras.layers.Dense(1)(x))

    def _examples(self, count: int) -> tf.data.Dataset:
        ids = tf.data.Dataset.range(count)
        return ids.map(lambda i: (i, tf.cast(i % 7, tf.float32)))

    def train_dataset(self, context, global_batch_size):
        dataset = self.shard(self._examples(PASSES * self.params.examples), context)
        return dataset.batch(context.get_per_replica_batch_size(global_batch_size),
                             drop_remainder=True).prefetch(2)

    def eval_dataset(self, split, batch_size):
        return self._examples(256).batch(batch_size) if split == "test" else None

    def train_examples(self):
        return self.params.examples

    def loss(self):
        return keras.losses.MeanSquaredError()

    def report(self, model, test):
        counts = model.get_layer("visits").counts.numpy()
        return visits(counts, self.params.examples)


class IndexedNumbered(Numbered):
    """Numbered, its examples given by index (`Task.train_source`): the first epoch's
    are its permutation of 0 .. examples - 1, the next epoch's another."""

    def train_source(self):
        return indexed.Source(self.params.examples, read=_numbered)


def _numbered(loaded, indices):
    return indices, tf.cast(indices % 7, tf.float32)


@dataclasses.dataclass(frozen=True)
class RecordsParams(Params):
    # Where the TFRecord files are (written there by the first process that needs
    # them): a directory every task of the run can read.
    records_dir: str = ""
    files: int = field(3, above=0)
    # Floats of padding per record, to make the data set as large as wanted.
    pad_floats: int = field(0, minimum=0)


class RecordsNumbered(Numbered):
    """Numbered, its examples in TFRecord files (`data.write_records`) read by index
    (`data.indexed_records`): at offsets, a window at a time."""

    Params = RecordsParams

    def train_source(self):
        paths = write_numbered(pathlib.Path(self.params.records_dir), self.params.examples,
                               self.params.files, self.params.pad_floats)
        spec = {"id": ([], tf.int64), "pad": ([self.params.pad_floats], tf.float32)}
        return data.indexed_records(paths, spec, lambda f: _numbered(None, f["id"]))


def write_numbered(directory: pathlib.Path, examples: int, files: int,
                   pad_floats: int = 0) -> list[pathlib.Path]:
    """The numbers 0 .. examples - 1 in `files` TFRecord files, in order, each with
    `pad_floats` floats; written unless there already."""
    directory.mkdir(parents=True, exist_ok=True)
    bounds = np.linspace(0, examples, files + 1).astype(int)
    paths = []
    for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        path = directory / f"numbered-{k:05d}-of-{files:05d}.tfrecord"
        if not path.with_name(path.name + ".index").exists():
            ids = np.arange(lo, hi, dtype=np.int64)
            pad = np.broadcast_to(np.float32(0.5), (hi - lo, pad_floats))
            data.write_records(path, {"id": ids, "pad": pad})
        paths.append(path)
    return paths


class PythonNumbered(Numbered):
    """Numbered, its examples made by Python code (which a tf.data worker cannot run)."""

    def _examples(self, count):
        return super()._examples(count).map(
            lambda i, y: (tf.py_function(lambda v: v, [i], tf.int64), y))


def visits(counts: np.ndarray, examples: int) -> dict[str, int]:
    """How many of the first epoch's examples were trained on 0, 1 and 2+ times, how
    many examples of later epochs were trained on, and the fewest and most visits of
    one of the first epoch's (by index every epoch reads those)."""
    first = counts[:examples]
    return {"visits_0": int((first == 0).sum()), "visits_1": int((first == 1).sum()),
            "visits_2plus": int((first >= 2).sum()),
            "visits_later": int((counts[examples:] > 0).sum()),
            "visits_min": int(first.min()), "visits_max": int(first.max())}
