"""Datasets and the input pipeline.

Sources (`load`) give in-memory uint8 images and integer labels. The training
pipeline is a `dataset_fn(input_context)`: each input pipeline (one per worker
under the multi-worker strategies) reads its own shard, batched at the
per-replica size, so every strategy uses it unchanged through
`DatasetCreator`.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable

import numpy as np
import tensorflow as tf

from app import idx
from app.config import ConfigError, DataConfig

BUNDLED_MNIST = pathlib.Path(__file__).resolve().parent.parent / "data" / "mnist"


@dataclasses.dataclass(frozen=True)
class Split:
    images: np.ndarray  # uint8, [N, height, width, channels]
    labels: np.ndarray  # int64, [N]

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, start: int, stop: int | None = None) -> Split:
        return Split(self.images[start:stop], self.labels[start:stop])


@dataclasses.dataclass(frozen=True)
class Datasets:
    train: Split
    validation: Split | None
    test: Split
    num_classes: int

    @property
    def image_shape(self) -> tuple[int, ...]:
        return tuple(self.train.images.shape[1:])


def load(data: DataConfig, seed: int = 0) -> Datasets:
    """Load the source named by `data.name`, then subset and split it as configured."""
    if data.name == "mnist":
        train, test, num_classes = _mnist(pathlib.Path(data.dir) if data.dir else BUNDLED_MNIST)
    elif data.name == "synthetic":
        train, test, num_classes = _synthetic(data.train_examples or 60000, seed)
    elif data.name.startswith("tfds:"):
        train, test, num_classes = _tfds(data.name[len("tfds:"):], data.dir)
    else:
        raise ConfigError(f"data.name = {data.name!r} is not one of mnist, synthetic, tfds:<name>")
    return _split(train, test, num_classes, data)


def _split(train: Split, test: Split, num_classes: int, data: DataConfig) -> Datasets:
    if data.train_examples:
        train = train.take(0, data.train_examples)
    if data.test_examples:
        test = test.take(0, data.test_examples)
    validation = None
    if data.validation_examples:
        if data.validation_examples >= len(train):
            raise ConfigError(
                f"data.validation_examples ({data.validation_examples}) must be smaller than "
                f"the training set ({len(train)} examples); lower it or set it to 0")
        cut = len(train) - data.validation_examples
        train, validation = train.take(0, cut), train.take(cut)
    return Datasets(train=train, validation=validation, test=test, num_classes=num_classes)


def _mnist(directory: pathlib.Path) -> tuple[Split, Split, int]:
    splits = []
    for prefix in ("train", "t10k"):
        images, labels = idx.read_pair(directory, prefix)
        splits.append(Split(images[..., np.newaxis], labels.astype(np.int64)))
    return splits[0], splits[1], 10


def _synthetic(num_train: int, seed: int) -> tuple[Split, Split, int]:
    """Random MNIST-shaped tensors, for throughput measurements only."""
    rng = np.random.default_rng(seed)

    def split(n: int) -> Split:
        return Split(rng.integers(0, 256, (n, 28, 28, 1), dtype=np.uint8),
                     rng.integers(0, 10, n, dtype=np.int64))

    return split(num_train), split(10000), 10


def _tfds(name: str, data_dir: str) -> tuple[Split, Split, int]:
    import tensorflow_datasets as tfds

    try:
        (train, test), info = tfds.load(
            name, split=["train", "test"], as_supervised=True, batch_size=-1,
            with_info=True, data_dir=data_dir or None)
    except Exception as e:  # tfds raises many types; the user needs the message either way
        raise ConfigError(
            f"data.name = 'tfds:{name}' could not be loaded ({type(e).__name__}: {e}); "
            "prepare it with `tfds build` and set data.dir, or use data.name = mnist") from None
    splits = [Split(*(np.asarray(t) for t in tfds.as_numpy(s))) for s in (train, test)]
    return splits[0], splits[1], info.features["label"].num_classes


def preprocess(images: tf.Tensor, labels: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """uint8 pixels to floats in [0, 1]."""
    return tf.cast(images, tf.float32) / 255.0, labels


def random_shift(images: tf.Tensor, max_shift: int, seed: int | None = None) -> tf.Tensor:
    """Translate each image of a batch by up to `max_shift` pixels, filling with zeros.

    Whole pixels only, done with two gathers over a padded batch: an order of
    magnitude cheaper per image than a per-example map or an interpolating
    affine transform, which matters on a 2-core host where input competes with
    training for the same cores.
    """
    shape = tf.shape(images)
    batch, height, width = shape[0], shape[1], shape[2]
    s = max_shift
    padded = tf.pad(images, [[0, 0], [s, s], [s, s], [0, 0]])
    offsets = tf.random.uniform([2, batch], 0, 2 * s + 1, dtype=tf.int32, seed=seed)
    rows = offsets[0][:, None] + tf.range(height)[None, :]
    cols = offsets[1][:, None] + tf.range(width)[None, :]
    shifted = tf.gather(padded, rows, axis=1, batch_dims=1)
    return tf.gather(shifted, cols, axis=2, batch_dims=1)


def train_dataset_fn(split: Split, global_batch_size: int, *, seed: int = 0,
                     shuffle_buffer: int = 60000, augment_shift: int = 0,
                     shard_policy: str = "auto",
                     ) -> Callable[[tf.distribute.InputContext], tf.data.Dataset]:
    """A `dataset_fn(input_context)` for training: sharded, shuffled, repeated, batched.

    `shard_policy` (DataConfig.shard_policy): "auto" or "data" give each input
    pipeline a disjoint shard; "off" gives every pipeline the whole set.
    """

    def dataset_fn(input_context: tf.distribute.InputContext) -> tf.data.Dataset:
        batch = input_context.get_per_replica_batch_size(global_batch_size)
        ds = tf.data.Dataset.from_tensor_slices((split.images, split.labels))
        if shard_policy != "off":
            # Shard before shuffling, so each input pipeline owns a fixed, disjoint part.
            ds = ds.shard(input_context.num_input_pipelines, input_context.input_pipeline_id)
        if shuffle_buffer:
            ds = ds.shuffle(shuffle_buffer, seed=seed + input_context.input_pipeline_id,
                            reshuffle_each_iteration=True)
        # Keras keeps one iterator for the whole of fit() with a DatasetCreator.
        ds = ds.repeat().batch(batch, drop_remainder=True)
        ds = ds.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE)
        if augment_shift:
            ds = ds.map(lambda x, y: (random_shift(x, augment_shift), y),
                        num_parallel_calls=tf.data.AUTOTUNE)
        return ds.prefetch(tf.data.AUTOTUNE)

    return dataset_fn


def eval_dataset(split: Split, batch_size: int) -> tf.data.Dataset:
    """Every example exactly once, in order; the last batch may be partial."""
    ds = tf.data.Dataset.from_tensor_slices((split.images, split.labels))
    # In-memory data has no files to shard: each worker takes every n-th batch.
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return ds.batch(batch_size).map(preprocess).prefetch(tf.data.AUTOTUNE).with_options(options)
