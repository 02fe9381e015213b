"""Input helpers any task can use: in-memory arrays, TFRecord files, exact evaluation.

A training `dataset_fn` runs where the data is read: on each worker under the
multi-worker strategies, after the chief traced it. Whatever it captures is
sent with it, so large arrays must not be captured: `from_arrays` writes
them to files every worker can read; `write_records` and `read_records` do
the same for a task's own files.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from app import indexed

# Arrays captured by a dataset_fn become constants of its graph, serialised to
# every worker with each function; past a few MB that is the slowest way to ship
# data, and past 2 GB impossible (a graph is one protobuf).
MAX_ARRAY_BYTES = 8 << 20

# Where `from_arrays` writes arrays too large for a graph: the run's workdir (set by
# `trainer.run`), which every task of a job can read; else a directory in /tmp.
_storage: pathlib.Path | None = None


def use_storage(directory: str | pathlib.Path | None) -> None:
    """Write the files of large `from_arrays` arrays under `directory` (None: /tmp)."""
    global _storage
    _storage = None if directory is None else pathlib.Path(directory)


def from_arrays(*arrays) -> tf.data.Dataset:
    """The examples of in-memory `arrays` (first axis = examples; each argument an
    array or a dict of arrays), of any size.

    Up to `MAX_ARRAY_BYTES` in all they travel inside the dataset's graph; above
    that each array is written once to a file named by its contents in the run's
    storage (`use_storage`), which the input pipelines read wherever they run.
    """
    structure, flat = _flat_arrays(arrays)
    if sum(map(_nbytes, flat)) <= MAX_ARRAY_BYTES:
        return tf.data.Dataset.from_tensor_slices(structure)
    columns = tf.data.Dataset.zip(tuple(_file_column(a, _stored(a)) for a in flat))
    return columns.map(lambda *values: tf.nest.pack_sequence_as(structure, list(values)),
                       num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def indexed_arrays(*arrays) -> indexed.Source:
    """The examples of in-memory `arrays`, as `from_arrays` takes them, by index
    (`Task.train_source`): a batch is a gather of its rows.

    Up to `MAX_ARRAY_BYTES` in all the arrays travel inside the graph that loads
    them; above that each is written to its file, as by `from_arrays`, and each
    process that reads examples loads the whole file once and keeps it in memory
    (TensorFlow has no op that reads one record of a file at an offset).
    """
    structure, flat = _flat_arrays(arrays)
    if sum(map(_nbytes, flat)) <= MAX_ARRAY_BYTES:
        def load():
            return tuple(tf.constant(a) for a in flat)
    else:
        paths = [_stored(a) for a in flat]

        def load():
            return tuple(_whole_column(a, path) for a, path in zip(flat, paths, strict=True))

    def read(loaded, indices):
        return tf.nest.pack_sequence_as(structure, [tf.gather(t, indices) for t in loaded])

    return indexed.Source(len(flat[0]), read, load)


def _flat_arrays(arrays: tuple) -> tuple[Any, list[np.ndarray]]:
    structure = arrays if len(arrays) > 1 else arrays[0]
    flat = [np.asarray(a) for a in tf.nest.flatten(structure)]
    counts = {len(a) for a in flat}
    if len(counts) != 1:
        raise ValueError(f"from_arrays: the arrays hold different numbers of examples "
                         f"({sorted(counts)}); give each the same first axis")
    return structure, flat


def _nbytes(array: np.ndarray) -> int:
    """The bytes `array` puts in a graph; an object array's `nbytes` counts only its
    pointers, not the strings they point to."""
    if array.dtype.kind != "O":
        return array.nbytes
    return sum(len(v) if isinstance(v, bytes) else len(str(v).encode()) for v in array.flat)


def _stored(array: np.ndarray) -> pathlib.Path:
    """`array`'s file in the run's storage: fixed-length little-endian records for
    numbers (booleans as uint8), one TFRecord per example for strings."""
    directory = _storage / "arrays" if _storage else pathlib.Path(tempfile.gettempdir(),
                                                                  "tf-train-arrays")
    if array.dtype.kind in "OSU":
        if array.ndim > 2 or (array.ndim == 2 and array.shape[1] != 1):
            raise ValueError(f"from_arrays: a string array of shape {array.shape} is too "
                             "large for the graph and only a column of strings (n,) or (n, 1) "
                             "can go through a file; write it with app.data.write_records")
        return _write_once(directory, array, ".tfrecord", _write_strings)
    if array.dtype == np.bool_:
        array = array.view(np.uint8)
    return _write_once(directory, np.ascontiguousarray(array, array.dtype.newbyteorder("<")),
                       ".bin", lambda f, a: a.tofile(f))


def _file_column(array: np.ndarray, path: pathlib.Path) -> tf.data.Dataset:
    """The rows of `array`, streamed from its file (`_stored`)."""
    if array.dtype.kind in "OSU":
        return tf.data.TFRecordDataset(str(path)).map(lambda s: tf.reshape(s, array.shape[1:]))
    stored = tf.uint8 if array.dtype == np.bool_ else tf.as_dtype(array.dtype)
    row = array[0].nbytes if len(array) else 1
    column = tf.data.FixedLengthRecordDataset(str(path), record_bytes=row).map(
        lambda r: tf.reshape(tf.io.decode_raw(r, stored), array.shape[1:]),
        num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return column.map(lambda v: tf.cast(v, tf.bool)) if array.dtype == np.bool_ else column


def _whole_column(array: np.ndarray, path: pathlib.Path) -> tf.Tensor:
    """All of `array`, read from its file (`_stored`) inside the graph."""
    if array.dtype.kind in "OSU":
        records = tf.data.TFRecordDataset(str(path)).batch(max(len(array), 1))
        return tf.reshape(records.get_single_element(), [-1, *array.shape[1:]])
    stored = tf.uint8 if array.dtype == np.bool_ else tf.as_dtype(array.dtype)
    values = tf.io.decode_raw(tf.io.read_file(str(path)), stored, little_endian=True)
    values = tf.reshape(values, [-1, *array.shape[1:]])
    return tf.cast(values, tf.bool) if array.dtype == np.bool_ else values


def _write_strings(path: str, array: np.ndarray) -> None:
    with tf.io.TFRecordWriter(path) as writer:
        for value in np.ravel(array):
            writer.write(value if isinstance(value, bytes) else str(value).encode())


def _write_once(directory: pathlib.Path, array: np.ndarray, suffix: str,
                write: Callable[[str, np.ndarray], None]) -> pathlib.Path:
    """`array`'s file, named by its contents, written if no task has written it yet.

    Each process that needs it and finds it missing writes a temporary file and
    renames it into place: a rename is atomic, and two tasks racing write the
    same bytes, so no reader ever sees a partial file and no lock is needed.
    """
    digest = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
    digest.update(array.tobytes() if array.dtype.kind not in "OSU"
                  else "\0".join(map(str, np.ravel(array))).encode())
    path = directory / f"{digest.hexdigest()[:24]}{suffix}"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f".{path.name}.{os.getpid()}.partial"
        write(str(partial), array)
        os.replace(partial, path)
    return path


# Beside each file `write_records` writes: its number of records, which reading the
# files by index (`indexed_records`) needs before it reads them.
INDEX_SUFFIX = ".index.json"


def write_records(path: str | pathlib.Path, columns: dict[str, np.ndarray]) -> int:
    """Write the examples of `columns` (name -> array, first axis = examples) as one
    TFRecord file of tf.train.Examples holding float or int64 features, and its index
    beside it (`<path>.index.json`). Returns the count."""
    count = len(next(iter(columns.values())))
    with tf.io.TFRecordWriter(str(path)) as writer:
        for i in range(count):
            features = {name: _feature(np.ravel(values[i])) for name, values in columns.items()}
            example = tf.train.Example(features=tf.train.Features(feature=features))
            writer.write(example.SerializeToString())
    tf.io.gfile.GFile(f"{path}{INDEX_SUFFIX}", "w").write(json.dumps({"records": count}))
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


def indexed_records(files: Sequence[str | pathlib.Path],
                    spec: dict[str, tuple[Sequence[int], tf.DType]],
                    example: Callable[[dict[str, tf.Tensor]], Any] | None = None
                    ) -> indexed.Source:
    """The examples of TFRecord files written by `write_records`, by index
    (`Task.train_source`): example i is record i of the files in the order given.
    A batch is parsed to a dict of the features in `spec` (as `read_records`), then
    made what fit() takes by `example(features)`, e.g. a (features, label) pair.

    Each process that reads examples loads the files' records whole, once, and keeps
    them in memory (TensorFlow has no op that reads one record at an offset)."""
    names = [str(f) for f in files]
    if not names:
        raise ValueError("indexed_records: no files given")
    counts = []
    for name in names:
        index = f"{name}{INDEX_SUFFIX}"
        if not tf.io.gfile.exists(index):
            raise ValueError(f"indexed_records: {name} has no index beside it ({index}); "
                             "write it with app.data.write_records, which writes both")
        counts.append(json.loads(tf.io.gfile.GFile(index).read())["records"])
    features = {name: tf.io.FixedLenFeature(shape, dtype) for name, (shape, dtype) in spec.items()}
    size = sum(counts)

    def load():
        return tf.data.TFRecordDataset(names).batch(size).get_single_element()

    def read(records, indices):
        parsed = tf.io.parse_example(tf.gather(records, indices), features)
        return example(parsed) if example else parsed

    return indexed.Source(size, read, load)


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

