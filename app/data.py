"""Input helpers any task can use: in-memory arrays, TFRecord files, exact evaluation.

A training `dataset_fn` runs where the data is read: on each worker under the
multi-worker strategies, after the chief traced it. Whatever it captures is
sent with it, so large arrays must not be captured: `from_arrays` writes
them to files every worker can read; `write_records` and `read_records` do
the same for a task's own files.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from app import example_proto, indexed, records

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
    them; above that each is written to its file, as by `from_arrays`, and read
    by record number (`app.records`), never whole: a reading process holds a
    window of rows (data.window_shards), not the arrays.
    """
    structure, flat = _flat_arrays(arrays)
    if sum(map(_nbytes, flat)) <= MAX_ARRAY_BYTES:
        def load():
            return tuple(tf.constant(a) for a in flat)

        def read(loaded, indices):
            return tf.nest.pack_sequence_as(structure, [tf.gather(t, indices) for t in loaded])

        return indexed.Source(len(flat[0]), read, load)
    columns = [_column_files(a, _stored(a)) for a in flat]

    def decode(raw):
        return tf.nest.pack_sequence_as(
            structure, [_decode_rows(a, r) for a, r in zip(flat, raw, strict=True)])

    def fetch(loaded, indices):
        return decode(tuple(files.read(indices) for files in columns))

    def span(loaded, starts, counts):
        return tuple(files.spans(starts, counts) for files in columns)

    return indexed.Source(len(flat[0]), fetch, span=span, decode=decode,
                          stored_bytes=sum(files.bytes for files in columns))


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
    """`array`'s file in the run's storage, one TFRecord per row: a row's little-endian
    bytes for numbers (booleans as uint8), so every record has the same length and
    row i starts at a byte computed from i (`records.Files.fixed`); one string per
    row for strings, with an index (`app.records`)."""
    directory = _storage / "arrays" if _storage else pathlib.Path(tempfile.gettempdir(),
                                                                  "tf-train-arrays")
    if array.dtype.kind in "OSU":
        if array.ndim > 2 or (array.ndim == 2 and array.shape[1] != 1):
            raise ValueError(f"from_arrays: a string array of shape {array.shape} is too "
                             "large for the graph and only a column of strings (n,) or (n, 1) "
                             "can go through a file; write it with app.data.write_records")
        return _write_once(directory, array, ".strings.tfrecord", _write_strings)
    return _write_once(directory, _little_endian(array), ".rows.tfrecord", _write_rows)


def _little_endian(array: np.ndarray) -> np.ndarray:
    if array.dtype == np.bool_:
        array = array.view(np.uint8)
    return np.ascontiguousarray(array, array.dtype.newbyteorder("<"))


def _column_files(array: np.ndarray, path: pathlib.Path) -> records.Files:
    if array.dtype.kind in "OSU":
        return records.Files.indexed([path])
    row_bytes = _little_endian(array[:1]).nbytes
    return records.Files.fixed([str(path)], [len(array)], row_bytes)


def _decode_rows(array: np.ndarray, raw: tf.Tensor) -> tf.Tensor:
    """Rows of `array` from their records (`_stored`)."""
    if array.dtype.kind in "OSU":
        return tf.reshape(raw, [-1, *array.shape[1:]])
    stored = tf.uint8 if array.dtype == np.bool_ else tf.as_dtype(array.dtype)
    values = tf.reshape(tf.io.decode_raw(raw, stored, little_endian=True),
                        [-1, *array.shape[1:]])
    return tf.cast(values, tf.bool) if array.dtype == np.bool_ else values


def _file_column(array: np.ndarray, path: pathlib.Path) -> tf.data.Dataset:
    """The rows of `array`, streamed from its file (`_stored`)."""
    return tf.data.TFRecordDataset(str(path)).batch(1024).map(
        lambda raw: _decode_rows(array, raw), num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True).unbatch()


def _write_rows(path: str, array: np.ndarray) -> None:
    rows = array.reshape(len(array), -1).view(np.uint8) if len(array) else array
    with tf.io.TFRecordWriter(path) as writer:
        for row in rows:
            writer.write(row.tobytes())


def _write_strings(path: str, array: np.ndarray) -> None:
    values = [v if isinstance(v, bytes) else str(v).encode() for v in np.ravel(array)]
    _write_framed(path, values)


def _write_framed(path: str, values: Sequence[bytes]) -> None:
    """`values` as the records of a TFRecord file at `path`, and its index."""
    offsets = np.zeros(len(values), np.int64)
    position = 0
    with tf.io.TFRecordWriter(path) as writer:
        for i, value in enumerate(values):
            writer.write(value)
            offsets[i] = position
            position += records.framed(len(value))
    records.write_index(path, offsets, position)


def _write_once(directory: pathlib.Path, array: np.ndarray, suffix: str,
                write: Callable[[str, np.ndarray], None]) -> pathlib.Path:
    """`array`'s file, named by its contents, written if no task has written it yet.

    Each process that needs it and finds it missing writes a temporary file and
    renames it into place: a rename is atomic, and two tasks racing write the
    same bytes, so no reader ever sees a partial file and no lock is needed. An
    index `write` made beside the file goes into place first: whoever sees the
    file finds its index.
    """
    digest = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
    digest.update(array.tobytes() if array.dtype.kind not in "OSU"
                  else "\0".join(map(str, np.ravel(array))).encode())
    path = directory / f"{digest.hexdigest()[:24]}{suffix}"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f".{path.name}.{os.getpid()}.partial"
        write(str(partial), array)
        if os.path.exists(records.index_path(partial)):
            os.replace(records.index_path(partial), records.index_path(path))
        os.replace(partial, path)
    return path


def write_records(path: str | pathlib.Path, columns: dict[str, np.ndarray]) -> int:
    """Write the examples of `columns` (name -> array, first axis = examples) as one
    TFRecord file of tf.train.Examples, and its index beside it (`<path>.index`, every
    record's offset: `app.records`). Floats become float features, integers and
    booleans int64 features, bytes and strings bytes features (one value per example,
    or an array of them). Returns the count. The file is whole or absent."""
    path = str(path)
    count = len(next(iter(columns.values()))) if columns else 0
    if any(len(v) != count for v in columns.values()):
        raise ValueError(f"write_records: the columns hold different numbers of examples "
                         f"({ {k: len(v) for k, v in columns.items()} }); give each the same "
                         "first axis")
    partial = f"{path}.{os.getpid()}.partial"
    offsets = np.zeros(count, np.int64)
    position = 0
    with tf.io.TFRecordWriter(partial) as writer:
        for start in range(0, count, _WRITE_ROWS):
            chunk = {k: v[start:start + _WRITE_ROWS] for k, v in columns.items()}
            for i, example in enumerate(example_proto.serialize(chunk), start):
                writer.write(example)
                offsets[i] = position
                position += records.framed(len(example))
    os.replace(partial, path)
    records.write_index(path, offsets, position)
    return count


# Rows serialised at a time by `write_records`: its memory, beside the columns'.
_WRITE_ROWS = 4096


def read_records(files: tf.data.Dataset, spec: dict[str, tuple[Sequence[int], tf.DType]],
                 *, parallel_files: int = 4) -> tf.data.Dataset:
    """Parsed examples of the TFRecord files named by `files`, as dicts of the
    features in `spec` (name -> (shape, dtype)) written by `write_records`."""
    features = _features(spec)
    records_ = files.interleave(tf.data.TFRecordDataset, cycle_length=parallel_files,
                                num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    return records_.map(lambda r: tf.io.parse_single_example(r, features),
                        num_parallel_calls=tf.data.AUTOTUNE)


def _features(spec: dict[str, tuple[Sequence[int], tf.DType]]) -> dict[str, Any]:
    return {name: tf.io.FixedLenFeature(shape, dtype) for name, (shape, dtype) in spec.items()}


def indexed_records(files: Sequence[str | pathlib.Path],
                    spec: dict[str, tuple[Sequence[int], tf.DType]],
                    example: Callable[[dict[str, tf.Tensor]], Any] | None = None, *,
                    augment: Callable[[Any, tf.Tensor], Any] | None = None
                    ) -> indexed.Source:
    """The examples of uncompressed TFRecord files of tf.train.Examples, by index
    (`Task.train_source`): example i is record i of the files in the order given.
    A batch is parsed to a dict of the features in `spec` (as `read_records`), then
    made what fit() takes by `example(features)`, e.g. a (features, label) pair;
    `augment(batch, seeds)` then adds per-example randomness (`indexed.Source`).

    Each file needs its index beside it (`<file>.index`), which `write_records`
    writes; for files written elsewhere, `python -m tools.index_records FILES`.
    Records are read at their offsets inside TensorFlow ops, never a file whole: a
    reading process holds a window of records (data.window_shards), however large
    the files, and their offsets up to `records.MAX_HELD_OFFSETS` records (beyond,
    it reads them from the indexes as it needs them). A missing, older or stale
    index (the file changed after it was indexed) raises a ConfigError that says
    how to make one."""
    stored = records.Files.indexed(files)
    features = _features(spec)

    def decode(raw):
        parsed = tf.io.parse_example(raw, features)
        return example(parsed) if example else parsed

    return indexed.Source(stored.size, lambda held, indices: decode(stored.read(indices, held)),
                          load=stored.load_offsets if stored.holds_offsets else None,
                          augment=augment,
                          span=lambda held, starts, counts: stored.spans(starts, counts, held),
                          decode=decode, stored_bytes=stored.bytes)


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

