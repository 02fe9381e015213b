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


def test_large_arrays_are_refused_with_the_fix():
    big = np.zeros((3000, 28, 28, 1), np.float32)  # 9.0 MiB
    with pytest.raises(ValueError) as e:
        data.from_arrays(big)
    assert str(e.value).startswith("in-memory arrays of 9.0 MiB are too large to capture in a "
                                   "dataset_fn (limit 8 MiB")
    assert "app.data.write_records" in str(e.value)
    assert len(list(data.from_arrays(big[:100]))) == 100


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
