"""A task whose training examples are encoded images in TFRecord files, read by index.

MNIST's training images, each encoded as a PNG in a `tf.train.Example` beside its
label, in `files` TFRecord files written once under `records_dir` by
`app.data.write_records` (which writes each file's index). Training reads them by
index (`app.data.indexed_records`): each batch's records at their offsets, decoded,
then shifted and rotated per example with seeds from (train.seed, epoch, index), so
an example read again after a failure is the same image. The model is Keras' own
"Simple MNIST convnet" (keras.io/examples/vision/mnist_convnet), in Keras 3 or,
with `task.keras = "tf_keras"`, Keras 2.

    python -m app.train --set task.name=examples.mnist_png:MnistPng
    python -m launch.local --workers 2 --ps 1 --set task.name=examples.mnist_png:MnistPng
    python -m launch.local --workers 2 --ps 0 --set task.name=examples.mnist_png:MnistPng
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import pathlib

import numpy as np
import tensorflow as tf

from app import data
from app.task import Task, field
from app.tasks import idx

MNIST = pathlib.Path(__file__).resolve().parents[1] / "data" / "mnist"
SPEC = {"png": ([], tf.string), "label": ([], tf.int64)}


@dataclasses.dataclass(frozen=True)
class Params:
    # Where the PNG records are written on first use: storage every task can read.
    records_dir: str = "runs/mnist-png"
    files: int = field(24, above=0)
    # The first `train_examples` of MNIST's 60,000 training images.
    train_examples: int = field(60000, above=0, maximum=60000)
    test_examples: int = field(10000, above=0, maximum=10000)
    # Random shifts of up to this many pixels, and rotations of up to this many degrees.
    shift: int = field(2, minimum=0)
    rotate_degrees: float = field(10.0, minimum=0)
    keras: str = field("keras", choices=("keras", "tf_keras"))
    # Write the files sorted by label: the worst order a window can get
    # (docs/benchmarks.md measures what it costs).
    sorted_by_label: bool = False


class MnistPng(Task):
    Params = Params
    metric, higher_is_better = "accuracy", True

    def build_model(self):
        keras = importlib.import_module(self.params.keras)
        return keras.Sequential([
            keras.Input((28, 28, 1)),
            keras.layers.Rescaling(1 / 255),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(10, activation="softmax"),
        ])

    def train_source(self):
        files = write_png_records(pathlib.Path(self.params.records_dir), self.params.files,
                                  self.params.train_examples, self.params.sorted_by_label)
        return data.indexed_records(files, SPEC, decode, augment=self._augment)

    def _augment(self, batch, seeds):
        """Shift and rotate each image by amounts drawn from its own seed."""
        images, labels = batch
        shift, turn = self.params.shift, math.radians(self.params.rotate_degrees)
        angles = tf.map_fn(lambda s: tf.random.stateless_uniform([], s, -turn, turn),
                           seeds, fn_output_signature=tf.float32)
        moves = tf.map_fn(lambda s: tf.random.stateless_uniform(
            [2], s + 1, -shift, shift + 1, dtype=tf.int32), seeds, fn_output_signature=tf.int32)
        transforms = _rotate_then_shift(angles, tf.cast(moves, tf.float32))
        images = tf.raw_ops.ImageProjectiveTransformV3(
            images=tf.cast(images, tf.float32), transforms=transforms,
            output_shape=[28, 28], fill_value=0.0, interpolation="BILINEAR")
        return images, labels

    def eval_dataset(self, split, batch_size):
        if split != "test":
            return None
        images = idx.read(idx.find(MNIST, "t10k-images-idx3-ubyte"), 3)[:self.params.test_examples]
        labels = idx.read(idx.find(MNIST, "t10k-labels-idx1-ubyte"), 1)[:self.params.test_examples]
        return data.from_arrays(images[..., None], labels.astype(np.int64)).batch(batch_size)

    def eval_examples(self, split):
        return self.params.test_examples if split == "test" else None

    def loss(self):
        return importlib.import_module(self.params.keras).losses.SparseCategoricalCrossentropy()

    def metrics(self):
        keras = importlib.import_module(self.params.keras)
        return [keras.metrics.SparseCategoricalAccuracy(name="accuracy")]


def decode(features):
    """A batch of PNG records as (images uint8 [n, 28, 28, 1], labels)."""
    images = tf.map_fn(lambda png: tf.io.decode_png(png, channels=1), features["png"],
                       fn_output_signature=tf.TensorSpec([28, 28, 1], tf.uint8))
    return images, features["label"]


def _rotate_then_shift(angles, moves):
    """Projective transforms (ImageProjectiveTransformV3's 8 numbers) that rotate each
    28 x 28 image about its centre, then shift it."""
    cos, sin = tf.cos(angles), tf.sin(angles)
    centre = 13.5
    dx = centre - cos * centre + sin * centre - moves[:, 0]
    dy = centre - sin * centre - cos * centre - moves[:, 1]
    zeros = tf.zeros_like(angles)
    return tf.stack([cos, -sin, dx, sin, cos, dy, zeros, zeros], axis=1)


def write_png_records(directory: pathlib.Path, files: int, examples: int,
                      sorted_by_label: bool = False) -> list[pathlib.Path]:
    """MNIST's first `examples` training images as PNGs with their labels, in `files`
    TFRecord files, in MNIST's order or sorted by label; written unless there already
    (each file is whole or absent)."""
    order = "-by-label" if sorted_by_label else ""
    paths = [directory / f"train-{k:05d}-of-{files:05d}-{examples}{order}.tfrecord"
             for k in range(files)]
    if all(records_ready(p) for p in paths):
        return paths
    directory.mkdir(parents=True, exist_ok=True)
    images = idx.read(idx.find(MNIST, "train-images-idx3-ubyte"), 3)[:examples]
    labels = idx.read(idx.find(MNIST, "train-labels-idx1-ubyte"), 1)[:examples]
    if sorted_by_label:
        by_label = np.argsort(labels, kind="stable")
        images, labels = images[by_label], labels[by_label]
    bounds = np.linspace(0, examples, files + 1).astype(int)
    for path, lo, hi in zip(paths, bounds[:-1], bounds[1:], strict=True):
        if not records_ready(path):
            pngs = [tf.io.encode_png(image[..., None]).numpy() for image in images[lo:hi]]
            data.write_records(path, {"png": np.array(pngs, dtype=object),
                                      "label": labels[lo:hi].astype(np.int64)})
    return paths


def records_ready(path: pathlib.Path) -> bool:
    return path.with_name(path.name + ".index").exists()
