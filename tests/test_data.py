"""The input helpers any task can use (app/data.py) and the Task's sharding helpers."""

import numpy as np
import pytest
import tensorflow as tf

from app import data
from app.config import ConfigError
from app.task import Task


def context(pipelines=1, pipeline_id=0):
    return tf.distribute.InputContext(num_input_pipelines=pipelines,
                                      input_pipeline_id=pipeline_id,
                                      num_replicas_in_sync=pipelines)


def test_large_arrays_go_through_one_file_each_and_read_back_exactly(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (3000, 28, 28, 1), dtype=np.uint8)
    features = {"x": rng.normal(size=(3000, 700)).astype(np.float32),  # 8.0 MiB: over the limit
                "flag": rng.integers(0, 2, 3000).astype(bool),
                "text": np.array([f"w{i % 7}" for i in range(3000)], dtype=object)}
    data.use_storage(tmp_path)
    try:
        dataset = data.from_arrays(features, images)
        again = data.from_arrays(features, images)
    finally:
        data.use_storage(None)
    files = sorted(p.name for p in (tmp_path / "arrays").iterdir())
    assert not any(name.startswith(".") for name in files)  # written once, each whole
    # One file a column, one record a row; the strings' with its index.
    assert sorted(name.split(".", 1)[1] for name in files) == [
        "rows.tfrecord", "rows.tfrecord", "rows.tfrecord", "strings.tfrecord",
        "strings.tfrecord.index"]
    assert dataset.element_spec[0]["x"].shape == (700,) and dataset.element_spec[1].shape == (
        28, 28, 1)
    for got in (dataset, again):
        rows = list(got.skip(2990))
        np.testing.assert_array_equal(np.stack([r[1] for r in rows]), images[2990:])
        np.testing.assert_array_equal(np.stack([r[0]["x"] for r in rows]), features["x"][2990:])
        assert [bool(r[0]["flag"]) for r in rows] == list(features["flag"][2990:])
        assert [r[0]["text"].numpy().decode() for r in rows] == list(features["text"][2990:])


def test_a_large_column_of_strings_is_counted_by_its_text_and_goes_through_a_file(tmp_path):
    # As an object array its nbytes is 3000 pointers (23 KiB); its text is 11.4 MiB.
    words = np.array([f"{i:04d}" + "w" * 4000 for i in range(3000)], dtype=object)
    data.use_storage(tmp_path)
    try:
        dataset = data.from_arrays(words)
    finally:
        data.use_storage(None)
    assert sorted(p.name.split(".", 1)[1] for p in (tmp_path / "arrays").iterdir()) == [
        "strings.tfrecord", "strings.tfrecord.index"]
    assert next(iter(dataset.skip(2999))).numpy().decode() == words[2999]


def test_small_arrays_stay_in_the_graph(tmp_path):
    data.use_storage(tmp_path)
    try:
        assert len(list(data.from_arrays(np.zeros((100, 3), np.float32)))) == 100
    finally:
        data.use_storage(None)
    assert not (tmp_path / "arrays").exists()


def test_a_large_string_array_of_several_columns_is_refused_with_the_fix():
    words = np.full((3000, 2), "w" * 2000, dtype=object)  # 11.4 MiB of text, 2 columns
    with pytest.raises(ValueError) as e:
        data.from_arrays(words)
    assert str(e.value) == (
        "from_arrays: a string array of shape (3000, 2) is too large for the graph and only "
        "a column of strings (n,) or (n, 1) can go through a file; write it with "
        "app.data.write_records")


def test_large_arrays_of_different_lengths_are_refused_by_name():
    with pytest.raises(ValueError, match=r"different numbers of examples \(\[10, 3000\]\)"):
        data.from_arrays(np.zeros((3000, 28, 28, 1), np.float32), np.zeros(10))


def test_records_round_trip(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    ids = np.array([3, 1, 4, 1], np.int64)
    assert data.write_records(tmp_path / "a.tfrecord", {"x": x, "id": ids}) == 4
    files = tf.data.Dataset.from_tensor_slices([str(tmp_path / "a.tfrecord")])
    got = list(data.read_records(files, {"x": ([3], tf.float32), "id": ([], tf.int64)}))
    np.testing.assert_array_equal([e["x"].numpy() for e in got], x)
    assert [int(e["id"]) for e in got] == [3, 1, 4, 1]


def files_read(policy: str, files: int, pipelines: int) -> list[tuple[list[str], bool]]:
    names = [f"f{i}" for i in range(files)]
    task = Task(shard_policy=policy)
    out = []
    for pid in range(pipelines):
        ds, by_record = task.shard_files(names, context(pipelines, pid))
        out.append(([n.decode() for n in ds.as_numpy_iterator()], by_record))
    return out


def test_files_are_split_among_the_pipelines_when_there_are_enough():
    assert files_read("auto", 4, 2) == [(["f0", "f2"], False), (["f1", "f3"], False)]
    assert files_read("file", 4, 2) == [(["f0", "f2"], False), (["f1", "f3"], False)]


def test_too_few_files_fall_back_to_records_or_are_refused():
    everything = ["f0"]
    assert files_read("auto", 1, 2) == [(everything, True), (everything, True)]
    assert files_read("data", 4, 2)[0] == (["f0", "f1", "f2", "f3"], True)
    assert files_read("off", 4, 2)[1] == (["f0", "f1", "f2", "f3"], False)
    with pytest.raises(ConfigError) as e:
        files_read("file", 1, 2)
    assert str(e.value) == ("data.shard_policy = 'file' needs at least one file per input "
                            "pipeline, but there are 1 file(s) for 2 pipelines; write more "
                            "files or use data")


def test_exact_evaluation_shards_batches_not_files():
    ds = data.exact(tf.data.Dataset.range(5).batch(2))
    policy = ds.options().experimental_distribute.auto_shard_policy
    assert policy == tf.data.experimental.AutoShardPolicy.DATA
