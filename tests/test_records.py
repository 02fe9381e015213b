"""TFRecord files read by record number (app/records.py): the index, its checks, and
reads at offsets inside TensorFlow ops."""

import gzip
import os

import numpy as np
import pytest
import tensorflow as tf

from app import data, records
from app.config import ConfigError
from tools import index_records


def write_plain(path, values: list[bytes]) -> None:
    """A TFRecord file as any other writer makes it: no index."""
    with tf.io.TFRecordWriter(str(path)) as writer:
        for value in values:
            writer.write(value)


def numbered(n: int, start: int = 0, rng=None) -> list[bytes]:
    """Records of varied lengths that say their own number."""
    rng = rng or np.random.default_rng(start)
    return [f"record-{i}:".encode() + b"x" * int(rng.integers(0, 300))
            for i in range(start, start + n)]


@pytest.fixture
def files(tmp_path):
    """Five indexed files of 1000, 1, 1500, 0 and 700 records (a file of one record and
    an empty one among them), numbered across them in order."""
    paths, start = [], 0
    for k, count in enumerate([1000, 1, 1500, 0, 700]):
        path = tmp_path / f"part-{k}.tfrecord"
        write_plain(path, numbered(count, start))
        records.index_file(path)
        paths.append(path)
        start += count
    return records.Files.indexed(paths)


def number_of(record: bytes) -> int:
    return int(record.split(b":")[0].split(b"-")[1])


def test_records_are_read_by_number_across_files_eagerly_and_in_a_function(files):
    assert files.size == 3201 and files.counts == (1000, 1, 1500, 0, 700)
    wanted = [3200, 0, 1000, 999, 1001, 2500, 2500, 17]
    assert [number_of(r) for r in files.read(tf.constant(wanted)).numpy()] == wanted
    read = tf.function(files.read)  # as a step traced on the chief runs on a worker
    assert [number_of(r) for r in read(tf.constant(wanted[::-1])).numpy()] == wanted[::-1]


def test_runs_of_records_are_read_in_order_each_from_every_file_it_spans(files):
    runs = [(2400, 801), (0, 5), (999, 3), (1000, 1), (0, 3201)]
    got = files.spans(tf.constant([s for s, _ in runs]), tf.constant([c for _, c in runs]))
    assert [number_of(r) for r in got.numpy()] == [
        i for start, count in runs for i in range(start, start + count)]


def test_the_offsets_scanned_from_the_frames_are_those_the_writer_recorded(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    columns = {"x": rng.normal(size=(300, 50)).astype(np.float32), "id": np.arange(300)}
    path = tmp_path / "w.tfrecord"
    data.write_records(path, columns)
    written = records.Files.indexed([path]).read(tf.range(300, dtype=tf.int64))
    # Blocks smaller than a record: every frame crosses a block's end.
    monkeypatch.setattr(records, "_SCAN_BLOCK", 97)
    offsets = records.scan_offsets(path)
    records.index_file(path)
    assert len(offsets) == 300 and offsets[0] == 0
    again = records.Files.indexed([path]).read(tf.range(300, dtype=tf.int64))
    assert (written.numpy() == again.numpy()).all()


def test_a_file_changed_after_it_was_indexed_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "a.tfrecord"
    write_plain(path, numbered(50))
    records.index_file(path)
    with open(path, "ab") as f:
        f.write(b"more")
    with pytest.raises(ConfigError) as grown:
        records.Files.indexed([path])
    assert str(grown.value) == (
        f"{path} changed after it was indexed ({os.path.getsize(path)} bytes, its index says "
        f"{os.path.getsize(path) - 4}); index it again: python -m tools.index_records {path}")
    write_plain(path, numbered(50, rng=np.random.default_rng(7)))  # other lengths
    records.index_file(path)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # the same size, its last record rewritten
        f.seek(size - 3)
        f.write(b"zzz")
    with pytest.raises(ConfigError, match="its first or last 64 KiB differ from when it was "
                                          "indexed"):
        records.Files.indexed([path])


def test_a_file_without_its_index_or_with_an_older_one_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "a.tfrecord"
    write_plain(path, numbered(3))
    with pytest.raises(ConfigError) as none:
        records.Files.indexed([path])
    assert str(none.value) == (
        f"{path} has no index beside it, which reading by index needs ({path}.index, with "
        f"every record's offset); make it: python -m tools.index_records {path}")
    (tmp_path / "a.tfrecord.index.json").write_text('{"records": 3}')
    with pytest.raises(ConfigError, match="has only an older index beside it"):
        records.Files.indexed([path])


def test_a_compressed_file_is_refused_and_rewritten_uncompressed_on_request(tmp_path):
    path = tmp_path / "c.tfrecord.gz"
    with tf.io.TFRecordWriter(str(path), "GZIP") as writer:
        for value in numbered(40):
            writer.write(value)
    with pytest.raises(ConfigError) as refused:
        records.index_file(path)
    assert str(refused.value) == (
        f"{path} is a GZIP-compressed TFRecord file, which cannot be read at an offset; "
        f"rewrite it uncompressed: python -m tools.index_records --decompress {path}")
    out = records.decompress(path)
    assert out == str(tmp_path / "c.tfrecord")
    got = records.Files.indexed([out]).read(tf.constant([39, 0]))
    assert [number_of(r) for r in got.numpy()] == [39, 0]
    with pytest.raises(ConfigError, match="exists already"):
        records.decompress(path)


def test_a_file_that_is_not_tfrecord_is_refused_by_name(tmp_path):
    path = tmp_path / "notes.txt.gz"
    path.write_bytes(gzip.compress(b"just text, no records\n" * 100))
    with pytest.raises(ConfigError, match=r"notes.txt.gz is not a TFRecord file \(its record "
                                          r"frames do not end at its last byte\)"):
        records.index_file(path)


def test_rows_of_one_length_need_no_index(tmp_path):
    path = tmp_path / "rows.tfrecord"
    rows = np.arange(40, dtype="<i4").reshape(10, 4)
    write_plain(path, [r.tobytes() for r in rows])
    fixed = records.Files.fixed([str(path)], [10], 16)
    got = tf.io.decode_raw(fixed.read(tf.constant([9, 2])), tf.int32).numpy()
    np.testing.assert_array_equal(got, rows[[9, 2]])
    got = tf.io.decode_raw(fixed.spans(tf.constant([3]), tf.constant([4])), tf.int32).numpy()
    np.testing.assert_array_equal(got, rows[3:7])


def test_the_command_indexes_checks_and_names_what_it_cannot_index(tmp_path, capsys):
    good, gz = tmp_path / "good.tfrecord", tmp_path / "bad.tfrecord.gz"
    write_plain(good, numbered(20))
    with tf.io.TFRecordWriter(str(gz), "GZIP") as writer:
        writer.write(b"x")
    assert index_records.main([str(good), str(gz), str(tmp_path / "missing")]) == 2
    out, err = capsys.readouterr()
    assert f"{good}: 20 records" in out
    assert f"error: {gz} is a GZIP-compressed TFRecord file" in err
    assert f"error: {tmp_path / 'missing'}: no such file" in err
    assert index_records.main([str(good)]) == 0
    assert "indexed already (20 records)" in capsys.readouterr().out
    assert index_records.main(["--decompress", str(gz)]) == 0
    assert records.read_index(tmp_path / "bad.tfrecord").records == 1


def test_offsets_held_by_the_reader_find_the_same_records_as_the_index_chunks(files):
    held = files.load_offsets()
    wanted = [3200, 0, 1000, 999, 1001, 2500, 2500, 17, 1511]
    assert [number_of(r) for r in files.read(tf.constant(wanted), held).numpy()] == wanted
    runs = [(2400, 801), (999, 3)]
    got = files.spans(tf.constant([s for s, _ in runs]), tf.constant([c for _, c in runs]), held)
    assert [number_of(r) for r in got.numpy()] == [
        i for start, count in runs for i in range(start, start + count)]
