"""TFRecord files read by record number, inside TensorFlow ops, with no file loaded whole.

A TFRecord file is a sequence of framed records (an 8-byte length, its CRC, the
data, its CRC), so record i can only be found by reading the i records before it.
An index beside each file holds every record's byte offset; with it, a reader
starts `tf.raw_ops.TFRecordDatasetV2` at the offset (`byte_offsets`, a seek:
`RandomAccessInputStream::SkipNBytes`) and reads one record, or a run of them.
Everything runs in TensorFlow ops, so a parameter-server worker can read a batch
inside a step the chief traced, and a tf.data pipeline can read ahead.

The index (`<file>.index`) is itself a TFRecord file, so that it too can be read
at an offset: record 0 is JSON (the data file's size, record count and sampled
checksums, to detect a file changed after it was indexed); record 1 + c holds the
offsets of records c*CHUNK .. (c+1)*CHUNK - 1 as little-endian int64. Every chunk
but the last is full, so chunk c starts at a byte computed from c: reading one
record's offset reads CHUNK * 8 bytes, not the whole index. A reader's memory
then does not grow with the data set (DALI's `tfrecord2idx` writes a text index of
offsets; TensorFlow has none, tensorflow#59559).

`write_records` (app/data.py) writes the index with the file; `index_file` makes
one for a file written elsewhere (`python -m tools.index_records FILES`).
Compressed files cannot be read at an offset: `index_file` refuses them, and
`decompress` rewrites one uncompressed.
"""

from __future__ import annotations

import array
import dataclasses
import json
import os
import struct
import zlib
from collections.abc import Iterable, Sequence

import numpy as np
import tensorflow as tf

from app.config import ConfigError

INDEX_SUFFIX = ".index"
# The index of a file whose records were not numbered by offset: what an older
# `write_records` wrote beside its files.
OLD_INDEX_SUFFIX = ".index.json"
FORMAT = "tf-train-records-index/1"
# Offsets per chunk of the index: one chunk, 4 KiB, is what reading one record's
# offset costs.
CHUNK = 512
# The frame around each record's data: its length (8 bytes) and that length's CRC
# (4), before; the data's CRC (4), after.
HEADER, FOOTER = 12, 4
# The bytes at each end of a file that the index keeps a CRC of: with the size, what
# tells a file rewritten after it was indexed (checking every byte would read the
# whole data set at every start).
SAMPLE = 1 << 16
_SCAN_BLOCK = 1 << 22
INDEX_COMMAND = "python -m tools.index_records"
# Up to this many records, a reading process holds every record's offset (8 bytes
# each: 32 MiB at most), loaded once: a record read at random then costs one read,
# not two (measured inside a step: 4.1 ms for 32 records of 16 KiB, 8.5 ms with
# their chunks). Beyond, offsets are read a chunk at a time, and a reader's memory
# does not grow with the data set.
MAX_HELD_OFFSETS = 1 << 22


class RecordsError(ConfigError):
    """A file cannot be read by record number as it is; the message says why and how to
    fix it (exit code 2, before training)."""


def index_path(path: str | os.PathLike) -> str:
    return f"{os.fspath(path)}{INDEX_SUFFIX}"


def framed(data_bytes: int) -> int:
    """The bytes a record of `data_bytes` takes in its file."""
    return HEADER + data_bytes + FOOTER


def _chunk_record(offsets: np.ndarray) -> bytes:
    return np.ascontiguousarray(offsets, "<i8").tobytes()


def _sample_crc(path: str, size: int) -> list[int]:
    with tf.io.gfile.GFile(path, "rb") as f:
        head = f.read(SAMPLE)
        f.seek(max(size - SAMPLE, 0))
        tail = f.read(SAMPLE)
    return [zlib.crc32(head), zlib.crc32(tail)]


def _size(path: str) -> int:
    return tf.io.gfile.stat(path).length


def local(path: str | os.PathLike) -> str:
    """`path` as every task of a cluster names it: absolute, unless a URL (gs://...)."""
    path = os.fspath(path)
    return path if "://" in path else os.path.abspath(path)


def write_index(path: str | os.PathLike, offsets: np.ndarray, size: int) -> str:
    """Write the index of the TFRecord file `path` (its `size` bytes) whose records start
    at `offsets`, atomically; its path."""
    path = os.fspath(path)
    meta = {"format": FORMAT, "records": len(offsets), "bytes": size, "chunk": CHUNK,
            "sample_crc32": _sample_crc(path, size)}
    target = index_path(path)
    partial = f"{target}.{os.getpid()}.partial"
    with tf.io.TFRecordWriter(partial) as writer:
        writer.write(json.dumps(meta).encode())
        for start in range(0, len(offsets), CHUNK):
            writer.write(_chunk_record(offsets[start:start + CHUNK]))
    tf.io.gfile.rename(partial, target, overwrite=True)
    return target


def scan_offsets(path: str | os.PathLike) -> np.ndarray:
    """The byte offset of every record of the uncompressed TFRecord file `path`, from
    its frames alone (8 bytes read a record, in blocks); raises RecordsError if the
    frames do not end exactly at the file's last byte (a compressed or damaged file)."""
    path = os.fspath(path)
    size = _size(path)
    offsets = array.array("q")
    position = 0
    with tf.io.gfile.GFile(path, "rb") as f:
        while position < size:
            f.seek(position)
            block = f.read(_SCAN_BLOCK)
            at = 0
            while at + 8 <= len(block) and position + at < size:
                offsets.append(position + at)
                at += framed(struct.unpack_from("<Q", block, at)[0])
            if at == 0:
                break  # fewer than 8 bytes left: a partial frame
            position += at
    if position != size:
        raise RecordsError(_not_tfrecord(path))
    return np.frombuffer(offsets, np.int64) if offsets else np.zeros([0], np.int64)


def compression(path: str | os.PathLike) -> str:
    """"GZIP" or "ZLIB" if `path` reads as a TFRecord file compressed so, else ""."""
    path = os.fspath(path)
    with tf.io.gfile.GFile(path, "rb") as f:
        magic = f.read(2)
    kinds = ["GZIP"] if magic == b"\x1f\x8b" else ["ZLIB"] if magic[:1] == b"\x78" else []
    for kind in kinds:
        try:
            next(iter(tf.data.TFRecordDataset(path, compression_type=kind).take(1)))
            return kind
        except (tf.errors.OpError, StopIteration):
            pass
    return ""


def _not_tfrecord(path: str) -> str:
    kind = compression(path)
    if kind:
        return (f"{path} is a {kind}-compressed TFRecord file, which cannot be read at an "
                f"offset; rewrite it uncompressed: {INDEX_COMMAND} --decompress {path}")
    return (f"{path} is not a TFRecord file (its record frames do not end at its last byte); "
            "write it with tf.io.TFRecordWriter or app.data.write_records")


def index_file(path: str | os.PathLike) -> str:
    """Index the uncompressed TFRecord file `path` (any writer's); the index's path."""
    path = os.fspath(path)
    offsets = scan_offsets(path)
    _check_first_and_last(path, offsets)
    return write_index(path, offsets, _size(path))


def _check_first_and_last(path: str, offsets: np.ndarray) -> None:
    """Read the first and the last record where the index says they start: TensorFlow's
    reader checks both CRCs of each."""
    for offset in {int(offsets[0]), int(offsets[-1])} if len(offsets) else ():
        try:
            _read_at(path, offset, 1)
        except tf.errors.DataLossError as e:
            raise RecordsError(f"{path}: the record at byte {offset} is damaged ({e.message}); "
                              "it cannot be indexed") from None


def _read_at(path: str, offset: int, count: int) -> list[bytes]:
    records = _records(tf.constant(path), tf.constant(offset, tf.int64)).take(count)
    return list(records.batch(count).get_single_element().numpy())


def decompress(path: str | os.PathLike, out: str | os.PathLike | None = None) -> str:
    """Rewrite the compressed TFRecord file `path` uncompressed, to `out` (default: its
    name without .gz, .gzip, .zz or .zlib; else with `.uncompressed` added), and index
    it; the new file's path. An existing file is never overwritten."""
    path = os.fspath(path)
    kind = compression(path)
    if not kind:
        raise RecordsError(f"{path} is not a compressed TFRecord file; index it as it is: "
                          f"{INDEX_COMMAND} {path}")
    if out is None:
        stem, suffix = os.path.splitext(path)
        out = stem if suffix in (".gz", ".gzip", ".zz", ".zlib") else f"{path}.uncompressed"
    out = os.fspath(out)
    if tf.io.gfile.exists(out):
        raise RecordsError(f"{out} exists already; move it away or give another --out")
    partial = f"{out}.{os.getpid()}.partial"
    offsets, position = [], 0
    with tf.io.TFRecordWriter(partial) as writer:
        for record in tf.data.TFRecordDataset(path, compression_type=kind):
            data = record.numpy()
            writer.write(data)
            offsets.append(position)
            position += framed(len(data))
    tf.io.gfile.rename(partial, out, overwrite=True)
    write_index(out, np.asarray(offsets, np.int64), position)
    return out


@dataclasses.dataclass(frozen=True)
class Index:
    """What a file's index says of it, read and checked against the file."""

    records: int
    bytes: int
    # The byte of the index where chunk 0 starts (after record 0, the JSON).
    chunks_at: int


def read_index(path: str | os.PathLike) -> Index:
    """The index of the TFRecord file `path`, checked against the file: raises
    RecordsError (a one-line message with the fix) if there is none, if it is an older
    kind, or if the file changed after it was indexed."""
    path = os.fspath(path)
    index = index_path(path)
    if not tf.io.gfile.exists(index):
        older = tf.io.gfile.exists(f"{path}{OLD_INDEX_SUFFIX}")
        raise RecordsError(
            f"{path} has {'only an older index' if older else 'no index'} beside it, which "
            f"reading by index needs ({index}, with every record's offset); make it: "
            f"{INDEX_COMMAND} {path}")
    with tf.io.gfile.GFile(index, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        f.seek(HEADER)
        meta = json.loads(f.read(length))
    if meta.get("format") != FORMAT or meta.get("chunk") != CHUNK:
        raise RecordsError(f"{index} is of another format ({meta.get('format')}); make it anew: "
                          f"{INDEX_COMMAND} {path}")
    size = _size(path)
    if size != meta["bytes"] or _sample_crc(path, size) != meta["sample_crc32"]:
        what = (f"{size} bytes, its index says {meta['bytes']}" if size != meta["bytes"]
                else "its first or last 64 KiB differ from when it was indexed")
        raise RecordsError(f"{path} changed after it was indexed ({what}); index it again: "
                          f"{INDEX_COMMAND} {path}")
    return Index(meta["records"], size, framed(length))


def _records(name: tf.Tensor, offset: tf.Tensor) -> tf.data.Dataset:
    """The records of file `name` from byte `offset` on. `buffer_size=0`: a buffer would
    read ahead 256 KiB at every seek.

    Such a dataset must not be serialized, as tf.data does to the dataset an eager
    iterator runs: TF 2.21's TFRecordDatasetV2 leaves `byte_offsets` out of its graph
    ("3 inputs specified of 4"). Reached through a function (a map, an interleave,
    `get_single_element`), as here, it is never serialized."""
    variant = tf.raw_ops.TFRecordDatasetV2(
        filenames=tf.reshape(name, [1]), compression_type="", buffer_size=tf.constant(0, tf.int64),
        byte_offsets=tf.reshape(offset, [1]))
    return tf.data.experimental.from_variant(variant, tf.TensorSpec([], tf.string))


# No Python `if` or loop on a tensor and no task code in the reads below: autograph,
# which tf.data would run on them in every reading process, is skipped (app/indexed.py).
_plain = tf.autograph.experimental.do_not_convert


@dataclasses.dataclass(frozen=True)
class Files:
    """TFRecord files, their records numbered across them in order (file 0's first), read
    by number inside TensorFlow ops.

    `record_bytes`: every record's data is this long (arrays written by rows), so
    record i of a file starts at byte i * (record_bytes + 16) and no index is read;
    else each file has its index (`read_index`)."""

    names: tuple[str, ...]
    counts: tuple[int, ...]
    sizes: tuple[int, ...]
    chunks_at: tuple[int, ...] = ()
    record_bytes: int = 0

    @classmethod
    def indexed(cls, names: Iterable[str | os.PathLike]) -> Files:
        """Files read through their indexes, each checked (`read_index`)."""
        names = tuple(local(n) for n in names)
        if not names:
            raise RecordsError("no files given")
        indexes = [read_index(n) for n in names]
        return cls(names, tuple(i.records for i in indexes), tuple(i.bytes for i in indexes),
                   tuple(i.chunks_at for i in indexes))

    @classmethod
    def fixed(cls, names: Sequence[str], counts: Sequence[int], record_bytes: int) -> Files:
        sizes = tuple(c * framed(record_bytes) for c in counts)
        return cls(tuple(names), tuple(counts), sizes, record_bytes=record_bytes)

    @property
    def size(self) -> int:
        return sum(self.counts)

    @property
    def bytes(self) -> int:
        return sum(self.sizes)

    def _starts(self) -> tf.Tensor:
        return tf.constant(np.cumsum([0, *self.counts]), tf.int64)

    def _locate(self, indices: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """(file, record within the file) of each of `indices`."""
        starts = self._starts()
        files = tf.searchsorted(starts[1:], indices, side="right", out_type=tf.int64)
        return files, indices - tf.gather(starts, files)

    @property
    def holds_offsets(self) -> bool:
        """Whether a reader loads every offset (`load_offsets`) rather than read chunks."""
        return not self.record_bytes and self.size <= MAX_HELD_OFFSETS

    def _chunk_starts(self) -> np.ndarray:
        """Where each file's chunks start among all the files' chunks."""
        return np.cumsum([0, *(-(-c // CHUNK) for c in self.counts)])

    @_plain
    def load_offsets(self) -> tf.Tensor:
        """Every record's offset, each file's padded to whole chunks (int64), read from
        the indexes in order: what `read` and `spans` take as `held`."""
        def chunks(name):
            return tf.data.TFRecordDataset(name).skip(1)  # record 0 is the JSON

        names = tf.data.Dataset.from_tensor_slices([index_path(n) for n in self.names])
        raw = names.flat_map(chunks).batch(tf.int64.max).get_single_element()
        return tf.reshape(tf.io.decode_raw(raw, tf.int64, little_endian=True,
                                           fixed_length=CHUNK * 8), [-1])

    def _offsets(self, files: tf.Tensor, records: tf.Tensor,
                 held: tf.Tensor | None = None) -> tf.Tensor:
        """The byte offset of record `records[i]` of file `files[i]`: computed for rows
        of one length, looked up in `held` offsets, or read from the indexes' chunks."""
        if self.record_bytes:
            return records * framed(self.record_bytes)
        if held is not None:
            chunk_starts = tf.constant(self._chunk_starts(), tf.int64)
            return tf.gather(held, tf.gather(chunk_starts, files) * CHUNK + records)
        chunks = records // CHUNK
        # Each chunk read once, however many of the records it numbers.
        keys, which = tf.unique(files * (1 << 40) + chunks, out_idx=tf.int64)
        key_files, key_chunks = keys // (1 << 40), keys % (1 << 40)
        at = (tf.gather(tf.constant(self.chunks_at, tf.int64), key_files)
              + key_chunks * framed(CHUNK * 8))
        names = tf.gather(tf.constant([index_path(n) for n in self.names]), key_files)
        chunk_bytes = self._read_one_each(names, at)
        table = tf.io.decode_raw(chunk_bytes, tf.int64, little_endian=True,
                                 fixed_length=CHUNK * 8)
        return tf.gather_nd(table, tf.stack([which, records % CHUNK], axis=1))

    @staticmethod
    def _read_one_each(names: tf.Tensor, offsets: tf.Tensor) -> tf.Tensor:
        """The one record at `offsets[i]` of file `names[i]`, for each i (a string vector)."""
        def one(name, offset):
            return _records(name, offset).take(1)

        # Several records open at once (cycle_length): the reads of a batch overlap the
        # opening of the next file (measured: 2.1 ms for 32 records of 16 KiB, against
        # 3.5 ms one after the other).
        records = tf.data.Dataset.from_tensor_slices((names, offsets)).interleave(
            one, cycle_length=8, block_length=1)
        return records.batch(tf.int64.max).get_single_element()

    @_plain
    def read(self, indices: tf.Tensor, held: tf.Tensor | None = None) -> tf.Tensor:
        """The records numbered `indices` (int64 [n]), as a string vector; `held`: the
        offsets `load_offsets` gave, if the reader holds them."""
        indices = tf.cast(indices, tf.int64)
        files, records = self._locate(indices)
        names = tf.gather(tf.constant(self.names), files)
        return tf.ensure_shape(
            self._read_one_each(names, self._offsets(files, records, held)), indices.shape)

    @_plain
    def spans(self, starts: tf.Tensor, counts: tf.Tensor,
              held: tf.Tensor | None = None) -> tf.Tensor:
        """Records `starts[k]` .. `starts[k] + counts[k] - 1` for each k (counts of at
        least 1), in that order, as one string vector: each run read from each file
        that holds part of it with one seek, then every byte once."""
        starts, counts = tf.cast(starts, tf.int64), tf.cast(counts, tf.int64)
        first, _ = self._locate(starts)
        last, _ = self._locate(starts + counts - 1)
        files = tf.ragged.range(first, last + 1)  # the files of each run
        run_starts = tf.repeat(starts, files.row_lengths())
        run_ends = tf.repeat(starts + counts, files.row_lengths())
        files = files.flat_values
        file_starts = tf.gather(self._starts(), files)
        lo = tf.maximum(run_starts, file_starts) - file_starts
        hi = tf.minimum(run_ends, tf.gather(self._starts(), files + 1)) - file_starts
        pieces = hi > lo  # not the empty files a run passes over
        files, lo, hi = (tf.boolean_mask(t, pieces) for t in (files, lo, hi))
        names = tf.gather(tf.constant(self.names), files)

        def piece(name, offset, n):
            return _records(name, offset).take(n)

        pieces = tf.data.Dataset.from_tensor_slices(
            (names, self._offsets(files, lo, held), hi - lo))
        return pieces.flat_map(piece).batch(tf.int64.max).get_single_element()
