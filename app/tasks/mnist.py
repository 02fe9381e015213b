"""MNIST digit classification: the classic distributed-MNIST CNN, or an MLP.

`task.source` picks the data: "mnist" streams the IDX files (the bundled copy,
or `task.dir`) with tf.data, so every worker reads the files itself and no
image is baked into a graph; "tfds:<name>" reads a prepared
tensorflow-datasets dataset; "synthetic" generates random images from the
example index, for throughput measurements. Images stay uint8 all the way:
the model scales them, so the exported model serves raw pixels.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from app import data, dialects, indexed
from app.config import ConfigError, field
from app.task import Task
from app.tasks import ctr_data, idx

BUNDLED = pathlib.Path(__file__).resolve().parents[2] / "data" / "mnist"
SHAPE, CLASSES = (28, 28, 1), 10


@dataclasses.dataclass(frozen=True)
class Params:
    """The `[task]` keys of the MNIST task."""

    # "cnn": the classic distributed-MNIST network (two 5x5 conv/pool blocks,
    # dense 1024, dropout); "mlp": a 512-128-128 fully connected stack.
    model: str = field("cnn", choices=("cnn", "mlp"))
    # Dropout rate before the CNN's last layer (the MLP has none).
    dropout: float = field(0.5, minimum=0, below=1)
    # "mnist" (IDX files in `dir`), "tfds:<name>" or "synthetic".
    source: str = "mnist"
    # Directory of the IDX files (or tensorflow-datasets' data_dir); empty means
    # the copy bundled with the project.
    dir: str = ""
    # Use only the first N training examples (0 = all), for smoke runs; the
    # validation examples are then held out of those N. More than the source has
    # is refused (the synthetic source has as many as this asks).
    train_examples: int = field(0, minimum=0)
    # Use only the first N test examples (0 = all), for smoke runs: test
    # accuracy is then over N images, and metrics.json says so.
    test_examples: int = field(0, minimum=0)
    # Held out from the end of the training set for per-epoch validation, as the
    # classic MNIST examples did (55,000 train / 5,000 validation).
    validation_examples: int = field(5000, minimum=0)
    # Examples in the training shuffle buffer (0 = no shuffle).
    shuffle_buffer: int = field(60000, minimum=0)
    # Random translation of up to this many pixels in each direction (0 = off).
    augment_shift: int = field(0, minimum=0)
    # Rounds of a 5x5 convolution over every training image in the input
    # pipeline, its result discarded: a stand-in for CPU-heavy preprocessing
    # (decoding, augmentation) whose cost is this knob. 0 = none. The
    # input-bound benchmark (tools/bench_input.py) sets it.
    preprocess_rounds: int = field(0, minimum=0)
    # The Keras the model is written in: "tf_keras" (Keras 2) or "keras" (Keras 3).
    keras: str = field("tf_keras", choices=dialects.NAMES)

    def __post_init__(self):
        name = self.source
        if name not in ("mnist", "synthetic") and not (name.startswith("tfds:") and len(name) > 5):
            raise ConfigError(f"task.source = {name!r} is not one of mnist, synthetic, "
                              "tfds:<name> (e.g. tfds:fashion_mnist)")


Source = Callable[[], tf.data.Dataset]


@dataclasses.dataclass(frozen=True)
class Splits:
    """How to make each split's dataset of (uint8 image, int64 label), and its size.

    Functions, not datasets: a dataset_fn builds its pipeline where it runs (on a
    worker, under parameter servers), so it must not capture one built here.
    """

    train: Source
    num_train: int
    validation: Source | None
    num_validation: int
    test: Source
    num_test: int
    # The training split by index (its first `num_train` examples), if it can be read so.
    train_by_index: indexed.Source | None = None


class Mnist(Task):
    """Ten-class digit classification; the headline metric is test accuracy."""

    Params = Params
    metric, higher_is_better = "accuracy", True

    @classmethod
    def from_arrays(cls, train: tuple[np.ndarray, np.ndarray],
                    validation: tuple[np.ndarray, np.ndarray] | None,
                    test: tuple[np.ndarray, np.ndarray], params: Params | None = None,
                    **kwargs) -> Mnist:
        """The task on in-memory (images, labels) arrays: tests, notebooks."""
        task = cls(params, **kwargs)

        def split(arrays):
            if arrays is None:
                return None, 0
            return (lambda: data.from_arrays(*arrays)), len(arrays[1])

        task._splits = Splits(*split(train), *split(validation), *split(test),
                              data.indexed_arrays(*train))
        return task

    _splits: Splits | None = None

    @property
    def splits(self) -> Splits:
        if self._splits is None:
            self._splits = _subset(_load(self.params, self.seed), self.params)
        return self._splits

    @property
    def keras(self):
        return dialects.module(self.params.keras)

    def build_model(self):
        if self.params.model == "mlp":
            return mlp(self.keras, SHAPE, CLASSES)
        return cnn(self.keras, SHAPE, CLASSES, self.params.dropout)

    def train_dataset(self, context, global_batch_size):
        p = self.params
        shift, rounds = p.augment_shift, p.preprocess_rounds

        def augment(images, labels):
            images = random_shift(images, shift) if shift else images
            return (preprocess(images, rounds) if rounds else images), labels

        return data.batches(
            self.shard(self.splits.train(), context),
            context.get_per_replica_batch_size(global_batch_size),
            seed=self.pipeline_seed(context), shuffle_buffer=p.shuffle_buffer,
            augment=augment if shift or rounds else None)

    def train_source(self) -> indexed.Source | None:
        # tensorflow-datasets' files are read through tfds.load, a pipeline.
        source = self.splits.train_by_index
        if source is None:
            return None
        p = self.params
        shift, rounds = p.augment_shift, p.preprocess_rounds

        def augment(batch, seeds):
            images, labels = batch
            images = random_shift(images, shift, seeds) if shift else images
            return (preprocess(images, rounds) if rounds else images), labels

        return dataclasses.replace(source, size=self.splits.num_train,
                                   augment=augment if shift or rounds else None)

    def eval_dataset(self, split, batch_size):
        source = self.splits.validation if split == "validation" else self.splits.test
        return None if source is None else source().batch(batch_size).prefetch(2)

    def train_examples(self) -> int:
        return self.splits.num_train

    def eval_examples(self, split):
        return self.splits.num_validation if split == "validation" else self.splits.num_test

    def loss(self):
        return self.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def metrics(self):
        return [self.keras.metrics.SparseCategoricalAccuracy(name="accuracy")]


def _load(params: Params, seed: int) -> Splits:
    if params.source == "synthetic":
        train = params.train_examples or 60000
        return Splits(functools.partial(_synthetic, train, seed), train, None, 0,
                      functools.partial(_synthetic, 10000, seed + 1), 10000,
                      indexed.Source(train, functools.partial(_synthetic_batch, seed)))
    if params.source.startswith("tfds:"):
        return _tfds(params.source[len("tfds:"):], params.dir)
    directory = pathlib.Path(params.dir) if params.dir else BUNDLED
    return Splits(*_idx(directory, "train"), None, 0, *_idx(directory, "t10k"),
                  _idx_by_index(directory, "train"))


def _subset(splits: Splits, params: Params) -> Splits:
    """The first `train_examples` / `test_examples`, validation cut from the train end."""
    train, num_train = splits.train, splits.num_train
    test, num_test = splits.test, splits.num_test
    if params.train_examples > num_train:
        # Not quietly all of them: a run asked for N examples (a benchmark's steps times its
        # batch) would train fewer steps than it was asked to, and say nothing.
        raise ConfigError(
            f"task.train_examples ({params.train_examples}) is more than the "
            f"{num_train} training examples of task.source {params.source!r}; lower it, "
            f"or set it to 0 for all of them")
    if params.train_examples and params.train_examples < num_train:
        train, num_train = _take(train, 0, params.train_examples), params.train_examples
    if params.test_examples and params.test_examples < num_test:
        test, num_test = _take(test, 0, params.test_examples), params.test_examples
    held = params.validation_examples
    if not held:
        return Splits(train, num_train, None, 0, test, num_test, splits.train_by_index)
    if held >= num_train:
        raise ConfigError(
            f"task.validation_examples ({held}) must be smaller than the training set "
            f"({num_train} examples); lower it or set it to 0")
    cut = num_train - held
    # By index, the training examples are the first `cut` (Mnist.train_source).
    return Splits(_take(train, 0, cut), cut, _take(train, cut, num_train), held, test, num_test,
                  splits.train_by_index)


def _take(source: Source, start: int, stop: int) -> Source:
    return lambda: source().skip(start).take(stop - start)


def _idx(directory: pathlib.Path, prefix: str) -> tuple[Source, int]:
    """One split streamed from its IDX files (checked first: a broken copy is named)."""
    images_path, labels_path = idx.paths(directory, prefix)
    count, shape, image_header, label_header = idx.check_pair(images_path, labels_path)

    def records(path: pathlib.Path, size: int, header: int) -> tf.data.Dataset:
        return tf.data.FixedLengthRecordDataset(
            str(path), size, header_bytes=header,
            compression_type="GZIP" if path.suffix == ".gz" else "")

    def decode(images: tf.Tensor, labels: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        return (tf.reshape(tf.io.decode_raw(images, tf.uint8), (-1, *shape, 1)),
                tf.cast(tf.io.decode_raw(labels, tf.uint8)[:, 0], tf.int64))

    def source() -> tf.data.Dataset:
        # Decoded a block of records at a time: a map call per record costs several
        # times the CPU, which a 2-core host takes from training (and each
        # MultiWorkerMirrored worker decodes every record before it shards them).
        return tf.data.Dataset.zip((
            records(images_path, int(np.prod(shape)), image_header),
            records(labels_path, 1, label_header))).batch(1024).map(decode).unbatch()

    return source, count


def _idx_by_index(directory: pathlib.Path, prefix: str) -> indexed.Source:
    """One split's IDX files by index: each reading process loads them whole, once
    (47 MB for MNIST's training images)."""
    images_path, labels_path = idx.paths(directory, prefix)
    count, shape, image_header, label_header = idx.check_pair(images_path, labels_path)

    def contents(path: pathlib.Path, header: int) -> tf.Tensor:
        raw = tf.io.read_file(str(path))
        if path.suffix == ".gz":
            raw = tf.io.decode_compressed(raw, "GZIP")
        return tf.io.decode_raw(tf.strings.substr(raw, header, tf.strings.length(raw) - header),
                                tf.uint8)

    def load():
        return (tf.reshape(contents(images_path, image_header), (count, *shape, 1)),
                tf.cast(contents(labels_path, label_header), tf.int64))

    def read(loaded, indices):
        images, labels = loaded
        return tf.gather(images, indices), tf.gather(labels, indices)

    return indexed.Source(count, read, load)


def _synthetic_batch(seed: int, loaded, indices: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """The synthetic examples `indices`: each pixel and label 64 hash bits of (seed,
    index, position) (ctr_data.hash64), a batch in a few elementwise ops. Drawn one
    example at a time (a stateless random op each), the input cost a single process
    a tenth of its examples/s."""
    pixels = int(np.prod(SHAPE))
    keys = ctr_data.hash64(tf.constant(ctr_data.key(seed), tf.uint64),
                           tf.cast(indices, tf.uint64))
    positions = tf.cast(tf.range(pixels + 1, dtype=tf.int64), tf.uint64)
    bits = ctr_data.hash64(keys[:, None], positions[None, :])
    images = tf.cast(tf.bitwise.right_shift(bits[:, :pixels], tf.constant(56, tf.uint64)),
                     tf.uint8)
    labels = tf.cast(tf.bitwise.right_shift(bits[:, pixels], tf.constant(33, tf.uint64)),
                     tf.int64) % CLASSES
    return tf.reshape(images, (-1, *SHAPE)), labels


def _synthetic(n: int, seed: int) -> tf.data.Dataset:
    """Random MNIST-shaped examples made from their index: no data to ship."""
    return (tf.data.Dataset.range(n).batch(1024)
            .map(functools.partial(_synthetic_batch, seed, None)).unbatch())


def _tfds(name: str, data_dir: str) -> Splits:
    import tensorflow_datasets as tfds

    try:
        info = tfds.builder(name, data_dir=data_dir or None).info
    except Exception as e:  # tfds raises many types; the user needs the message either way
        raise ConfigError(
            f"task.source = 'tfds:{name}' could not be loaded ({type(e).__name__}: {e}); "
            "prepare it with `tfds build` and set task.dir, or use task.source = mnist") from None
    # tfds datasets read their own files: rebuilt by tfds.load where the pipeline runs.
    def source(split: str) -> Source:
        return lambda: tfds.load(name, split=split, as_supervised=True,
                                 data_dir=data_dir or None)

    return Splits(source("train"), info.splits["train"].num_examples, None, 0,
                  source("test"), info.splits["test"].num_examples)


def preprocess(images: tf.Tensor, rounds: int) -> tf.Tensor:
    """`images` unchanged, after `rounds` 5x5 convolutions of them: CPU work per image
    that no optimizer removes, since the result takes part in the output (as 0)."""
    x = tf.cast(images, tf.float32)
    kernel = tf.fill([5, 5, 1, 1], 1.0 / 25)
    for _ in range(rounds):
        x = tf.nn.conv2d(x, kernel, strides=1, padding="SAME")
    nothing = tf.minimum(tf.abs(tf.reduce_sum(x)), 0.0)  # always 0, never folded
    return images + tf.cast(nothing, images.dtype)


def random_shift(images: tf.Tensor, max_shift: int, seeds: tf.Tensor | None = None
                 ) -> tf.Tensor:
    """Translate each image of a batch by up to `max_shift` pixels, filling with zeros;
    by `seeds` (int64 [batch, 2], one per image: app.indexed) when given.

    Whole pixels only, done with two gathers over a padded batch: an order of
    magnitude cheaper per image than a per-example map or an interpolating
    affine transform, which matters on a 2-core host where input competes with
    training for the same cores.
    """
    shape = tf.shape(images)
    batch, height, width = shape[0], shape[1], shape[2]
    s = max_shift
    padded = tf.pad(images, [[0, 0], [s, s], [s, s], [0, 0]])
    if seeds is None:
        offsets = tf.random.uniform([2, batch], 0, 2 * s + 1, dtype=tf.int32)
    else:
        offsets = tf.transpose(tf.map_fn(
            lambda seed: tf.random.stateless_uniform([2], seed, 0, 2 * s + 1, tf.int32),
            seeds, fn_output_signature=tf.int32))
    rows = offsets[0][:, None] + tf.range(height)[None, :]
    cols = offsets[1][:, None] + tf.range(width)[None, :]
    shifted = tf.gather(padded, rows, axis=1, batch_dims=1)
    return tf.gather(shifted, cols, axis=2, batch_dims=1)


def _scaled_input(keras, input_shape) -> tuple:
    """Raw uint8 pixels in, floats in [0, 1] out: the export serves raw images."""
    inputs = keras.Input(shape=tuple(input_shape), dtype="uint8", name="image")
    return inputs, keras.layers.Rescaling(1 / 255)(inputs)


def cnn(keras, input_shape, num_classes: int, dropout: float):
    """The classic distributed-MNIST network: two 5x5 conv/pool blocks, dense 1024, dropout,
    in `keras` (either Keras: the same layers)."""
    layers = keras.layers
    inputs, x = _scaled_input(keras, input_shape)
    x = layers.Conv2D(32, 5, padding="same", activation="relu")(x)
    x = layers.MaxPooling2D()(x)
    x = layers.Conv2D(64, 5, padding="same", activation="relu")(x)
    x = layers.MaxPooling2D()(x)
    x = layers.Flatten()(x)
    x = layers.Dense(1024, activation="relu")(x)
    x = layers.Dropout(dropout)(x)
    # float32 logits under a mixed-precision policy, so the loss is computed in full precision.
    return keras.Model(inputs, layers.Dense(num_classes, dtype="float32")(x), name="cnn")


def mlp(keras, input_shape, num_classes: int):
    """The classic multi-GPU tower example's fully connected 512-128-128 stack."""
    layers = keras.layers
    inputs, x = _scaled_input(keras, input_shape)
    x = layers.Flatten()(x)
    for units in (512, 128, 128):
        x = layers.Dense(units, activation="relu")(x)
    return keras.Model(inputs, layers.Dense(num_classes, dtype="float32")(x), name="mlp")
