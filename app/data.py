"""Input helpers any task can use: in-memory arrays, TFRecord files, exact evaluation.

A training `dataset_fn` runs where the data is read: on each worker under the
multi-worker strategies, after the chief traced it. Whatever it captures is
sent with it, so large arrays must not be captured (`from_arrays` refuses
them): such data belongs in files every worker can read (`write_records`,
`read_records`), or is generated from the example index.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

# Arrays captured by a dataset_fn become constants of its graph, serialised to
# every worker with each function; past a few MB that is the slowest way to ship data.
MAX_ARRAY_BYTES = 8 << 20


def from_arrays(*arrays: np.ndarray) -> tf.data.Dataset:
    """The examples of small in-memory `arrays` (first axis = examples)."""
    size = sum(a.nbytes for a in arrays)
    if size > MAX_ARRAY_BYTES:
        raise ValueError(
            f"in-memory arrays of {size / 2**20:.1f} MiB are too large to capture in a "
            f"dataset_fn (limit {MAX_ARRAY_BYTES >> 20} MiB: they would be sent to every "
            "worker inside its graph); write them to files with app.data.write_records and "
            "read those with app.data.read_records")
    return tf.data.Dataset.from_tensor_slices(arrays if len(arrays) > 1 else arrays[0])


def write_records(path: str | pathlib.Path, columns: dict[str, np.ndarray]) -> int:
    """Write the examples of `columns` (name -> array, first axis = examples) as one
    TFRecord file of tf.train.Examples holding float or int64 features. Returns the count."""
    count = len(next(iter(columns.values())))
    with tf.io.TFRecordWriter(str(path)) as writer:
        for i in range(count):
            features = {name: _feature(np.ravel(values[i])) for name, values in columns.items()}
            example = tf.train.Example(features=tf.train.Features(feature=features))
            writer.write(example.SerializeToString())
    return count


def _feature(values: np.ndarray) -> tf.train.Feature:
    if np.issubdtype(values.dtype, np.integer):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=values))
    return tf.train.Feature(float_list=tf.train.FloatList(value=values))


def read_records(files: tf.data.Dataset, spec: dict[str, tuple[Sequence[int], tf.DType]],
                 *, parallel_files: int = 4) -> tf.data.Dataset:
    """Parsed examples of the TFRecord files named by `files`, as dicts of the
    features in `spec` (name -> (shape, dtype)) written by `write_records`."""
    features = {name: tf.io.FixedLenFeature(shape, dtype) for name, (shape, dtype) in spec.items()}
    records = files.interleave(tf.data.TFRecordDataset, cycle_length=parallel_files,
                               num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return records.map(lambda r: tf.io.parse_single_example(r, features),
                       num_parallel_calls=tf.data.AUTOTUNE)


def exact(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """`dataset` for evaluation under a multi-worker strategy: each worker takes every
    n-th batch, so every example is evaluated exactly once (no file sharding, which
    would drop or repeat examples when files and workers do not divide)."""
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return dataset.with_options(options)


def batches(dataset: tf.data.Dataset, batch_size: int, *, seed: int, shuffle_buffer: int,
            augment: Callable | None = None) -> tf.data.Dataset:
    """The usual end of a training pipeline: shuffled, repeated, batched, prefetched."""
    if shuffle_buffer:
        dataset = dataset.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
    # Keras keeps one iterator for the whole of fit() with a DatasetCreator.
    dataset = dataset.repeat().batch(batch_size, drop_remainder=True)
    if augment is not None:
        dataset = dataset.map(augment, num_parallel_calls=tf.data.AUTOTUNE)
    return dataset.prefetch(tf.data.AUTOTUNE)

