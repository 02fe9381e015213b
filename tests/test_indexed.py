"""Training examples by index (app/indexed.py): one order of (seed, epoch), the same
global batches however the input is split, a pipeline that starts where the backup
left off, and the sources app/data.py makes."""


import numpy as np
import pytest
import tensorflow as tf

from app import config as cfg
from app import data, indexed, records, strategy, trainer
from app.config import ConfigError
from app.task import Task
from tests.conftest import one_device_reduction_mirrored
from tests.numbered import IndexedNumbered, Params


def batches(order: indexed.Order, steps) -> list[np.ndarray]:
    indices = tf.function(order.indices)  # traced once: the steps are tensors
    return [indices(tf.constant(step, tf.int64))[0].numpy() for step in steps]


def test_each_epoch_is_a_permutation_of_seed_and_epoch_alone():
    order = indexed.Order(size=1000, batch=100, steps_per_epoch=10, seed=3)
    first, second = np.concatenate(batches(order, range(10))), np.concatenate(
        batches(order, range(10, 20)))
    np.testing.assert_array_equal(np.sort(first), np.arange(1000))
    np.testing.assert_array_equal(np.sort(second), np.arange(1000))
    assert not np.array_equal(first, second)  # each epoch its own order
    again = indexed.Order(size=1000, batch=100, steps_per_epoch=10, seed=3)
    np.testing.assert_array_equal(np.concatenate(batches(again, range(10))), first)
    other_seed = indexed.Order(size=1000, batch=100, steps_per_epoch=10, seed=4)
    assert not np.array_equal(np.concatenate(batches(other_seed, range(10))), first)


def test_an_epoch_longer_than_the_examples_goes_on_to_a_new_permutation():
    order = indexed.Order(size=100, batch=30, steps_per_epoch=5, seed=0)  # 150 per epoch
    counts = np.bincount(np.concatenate(batches(order, range(5))), minlength=100)
    assert counts.min() >= 1 and counts.max() <= 2 and counts.sum() == 150


@pytest.mark.parametrize("pipelines, replicas", [(1, 1), (1, 2), (2, 2), (4, 4), (2, 4)])
def test_the_input_pipelines_split_each_global_batch_between_them(pipelines, replicas):
    order = indexed.Order(size=500, batch=40, steps_per_epoch=12, seed=1)
    source = indexed.Source(500, lambda loaded, i: i)
    read = []
    for pipeline in range(pipelines):
        context = tf.distribute.InputContext(pipelines, pipeline, replicas)
        elements = indexed.dataset(source, order, context, lambda: tf.constant(7, tf.int64))
        per_step = replicas // pipelines
        read.append([e.numpy() for e in elements.take(2 * per_step)])
    for step, k in enumerate((7, 8)):
        parts = [part for pipeline in read for part in pipeline[step * len(pipeline) // 2:
                                                                (step + 1) * len(pipeline) // 2]]
        np.testing.assert_array_equal(np.concatenate(parts), order.indices(k)[0].numpy())


def test_a_pipeline_starts_at_the_step_set_before_it_is_read_not_when_it_is_built():
    order = indexed.Order(size=64, batch=8, steps_per_epoch=8, seed=0)
    first = tf.Variable(0, dtype=tf.int64)
    elements = indexed.dataset(indexed.Source(64, lambda loaded, i: i), order,
                               tf.distribute.InputContext(), first.read_value)
    first.assign(5)  # as the backup's restore does, after fit() built its input
    np.testing.assert_array_equal(next(iter(elements)).numpy(), order.indices(5)[0].numpy())


def windowed(size=1000, batch=40, steps_per_epoch=25, seed=3, shard=64, window=3):
    return indexed.Order(size, batch, steps_per_epoch, seed, shard=shard, window=window)


@pytest.mark.parametrize("size, shard, window", [(1000, 64, 3), (1024, 64, 4), (1000, 2000, 2),
                                                 (1000, 1, 1000), (1000, 1000, 1)])
def test_a_windowed_epoch_is_a_permutation_of_seed_and_epoch_alone(size, shard, window):
    steps = size // 8
    order = windowed(size=size, batch=8, steps_per_epoch=steps, shard=shard, window=window)
    epochs = [np.concatenate(batches(order, range(e * steps, (e + 1) * steps)))
              for e in range(2)]
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch), np.arange(size))
    assert not np.array_equal(*epochs)
    again = windowed(size=size, batch=8, steps_per_epoch=steps, shard=shard, window=window)
    np.testing.assert_array_equal(np.concatenate(batches(again, range(steps))), epochs[0])


def test_a_windowed_order_reads_each_window_from_its_own_shards():
    order = windowed()  # 16 shards of 64 (the last of 40), windows of 3 shards: 192 examples
    epoch = np.concatenate(batches(order, range(25)))
    for start in range(0, 1000, 192):
        shards = np.unique(epoch[start:start + 192] // 64)
        assert len(shards) == min(3, 16 - start // 192 * 3)
        # Whole shards: a window holds every example of each of its shards.
        assert len(epoch[start:start + 192]) == sum(min(64, 1000 - s * 64) for s in shards)
    assert np.all(epoch[-40:] // 64 == 15)  # the short shard, last: its window holds it alone


@pytest.mark.parametrize("pipelines, first, window", [(1, 37, 3), (2, 0, 3), (4, 13, 3),
                                                      (2, 5, 4), (4, 0, 4)])
def test_windows_read_ahead_give_the_global_batches_of_the_order(pipelines, first, window):
    """What the synchronous strategies read (a window at a time, each shard in one
    run) is what a parameter-server step reads (`Order.indices`), however the input is
    split and wherever it starts; an epoch longer than the examples goes on to a new
    permutation. With windows of 4 shards, 2 or 4 pipelines each read shards of their
    own (`Order.pipeline_shards`): together, every record once."""
    steps = 20 if window == 3 else 12  # 800 examples an epoch, or 480 in one pass
    order = windowed(size=500, batch=40, steps_per_epoch=steps, shard=48, window=window)
    assert order.pipeline_shards(pipelines) == (window == 4)
    windows_read = [[] for _ in range(pipelines)]  # each pipeline's, the records of each

    def spans(pipeline):
        def record(starts, counts):
            windows_read[pipeline].append(np.concatenate(
                [np.arange(s, s + c) for s, c in zip(starts, counts, strict=True)]))
            return counts

        def span(loaded, starts, counts):
            counts = tf.numpy_function(record, [starts, counts], tf.int64, stateful=True)
            return tf.strings.as_string(tf.ragged.range(starts, starts + counts).flat_values)
        return span

    read = []
    for pipeline in range(pipelines):
        source = indexed.Source(500, lambda loaded, i: i, span=spans(pipeline),
                                decode=lambda raw: tf.strings.to_number(raw, tf.int64))
        context = tf.distribute.InputContext(pipelines, pipeline, pipelines)
        elements = indexed.dataset(source, order, context, lambda: tf.constant(first, tf.int64))
        read.append([e.numpy() for e in elements.take(3 * steps)])
    for k, expected in enumerate(batches(order, range(first, first + 3 * steps))):
        np.testing.assert_array_equal(np.sort(np.concatenate([part[k] for part in read])),
                                      np.sort(expected))
    if window == 4 and first == 0:
        # Three epochs of 480 of the 500, each over 3 windows of the 11 shards (the last
        # of 20): 4 shards split over the 4 pipelines, a shard each, and 3 shards each
        # pipeline reads whole. Together, every record once an epoch, checked on the
        # windows read, not a count of records, which depends on how far each read ahead.
        assert min(len(w) for w in windows_read) >= 3 * 3
        for epoch in range(3):
            records = []
            for k in range(3 * epoch, 3 * epoch + 3):
                parts = [each[k] for each in windows_read]
                if all(np.array_equal(part, parts[0]) for part in parts):
                    assert len(parts[0]) == 2 * 48 + 20
                    records.append(parts[0])
                else:
                    assert [len(part) for part in parts] == [48] * pipelines
                    records.extend(parts)
            np.testing.assert_array_equal(np.sort(np.concatenate(records)), np.arange(500))


def branching(t: tf.Tensor) -> tf.Tensor:
    """`t`, through a Python `if` on a tensor: traced as it is, that raises
    (OperatorNotAllowedInGraphError); autograph makes it a `tf.cond`."""
    if tf.reduce_min(t) >= 0:
        return t
    return -t


def test_a_tasks_own_functions_are_converted_by_autograph_as_tf_data_converts_a_map():
    """The pipeline's own functions skip autograph (`indexed._plain`); what the task
    gives (`read`, `load`, `augment`, `span`, `decode`) may branch on tensors, in the
    pipeline (in memory, a window at a time from files, and not by index) and in a
    parameter-server step."""
    order = indexed.Order(size=64, batch=8, steps_per_epoch=8, seed=0)
    in_memory = indexed.Source(64, lambda loaded, i: branching(tf.gather(loaded, i)),
                               load=lambda: branching(tf.range(64, dtype=tf.int64)),
                               augment=lambda batch, seeds: branching(batch))
    start = lambda: tf.constant(2, tf.int64)  # noqa: E731
    got = next(iter(indexed.dataset(in_memory, order, tf.distribute.InputContext(), start)))
    np.testing.assert_array_equal(got.numpy(), order.indices(2)[0].numpy())
    step = tf.function(lambda s: indexed.batch(in_memory, order, tf.range(64, dtype=tf.int64),
                                               s))
    np.testing.assert_array_equal(step(tf.constant(3, tf.int64)).numpy(),
                                  order.indices(3)[0].numpy())
    shuffled = indexed.pipeline(in_memory, tf.data.Dataset.range(64), 8, seed=0)
    assert sorted(np.concatenate([b.numpy() for b in shuffled.take(8)])) == list(range(64))

    def span(loaded, starts, counts):
        return branching(tf.ragged.range(starts, starts + counts).flat_values)

    windowed_order = windowed(size=64, batch=8, steps_per_epoch=8, shard=16, window=2)
    from_files = indexed.Source(64, lambda loaded, i: i, span=span, decode=branching)
    got = next(iter(indexed.dataset(from_files, windowed_order, tf.distribute.InputContext(),
                                    start)))
    np.testing.assert_array_equal(got.numpy(), windowed_order.indices(2)[0].numpy())


def test_augmentation_seeds_follow_the_example_and_the_epoch():
    order = indexed.Order(size=64, batch=8, steps_per_epoch=8, seed=5)
    indices, seeds = order.indices(3)
    np.testing.assert_array_equal(seeds[:, 1].numpy(), indices.numpy())
    assert len(set(seeds[:, 0].numpy())) == 1
    assert order.indices(8 + 3)[1][0, 0].numpy() != seeds[0, 0].numpy()  # the next epoch


@pytest.mark.parametrize("in_files", [False, True])
def test_indexed_arrays_read_the_rows_asked_for_in_the_graph_or_through_files(
        in_files, monkeypatch, tmp_path):
    if in_files:
        monkeypatch.setattr(data, "MAX_ARRAY_BYTES", 0)
        data.use_storage(tmp_path)
    try:
        images = np.arange(50 * 6, dtype=np.float32).reshape(50, 2, 3)
        labels = {"y": np.arange(50) % 3, "ok": np.arange(50) % 2 == 0,
                  "name": np.array([f"n{i}".encode() for i in range(50)])}
        source = data.indexed_arrays(images, labels)
        indices = tf.constant([49, 0, 7, 7], tf.int64)
        x, y = source.read(source.load() if source.load else None, indices)
    finally:
        data.use_storage(None)
    np.testing.assert_array_equal(x.numpy(), images[[49, 0, 7, 7]])
    np.testing.assert_array_equal(y["y"].numpy(), labels["y"][[49, 0, 7, 7]])
    np.testing.assert_array_equal(y["ok"].numpy(), labels["ok"][[49, 0, 7, 7]])
    assert list(y["name"].numpy()) == [b"n49", b"n0", b"n7", b"n7"]
    assert source.size == 50
    assert any(tmp_path.rglob("*.rows.tfrecord")) == in_files


def test_records_written_with_their_index_are_read_by_index(tmp_path):
    columns = {"x": np.arange(30, dtype=np.float32).reshape(10, 3), "y": np.arange(10)}
    paths = [tmp_path / "a.tfrecord", tmp_path / "b.tfrecord"]
    data.write_records(paths[0], {k: v[:4] for k, v in columns.items()})
    data.write_records(paths[1], {k: v[4:] for k, v in columns.items()})
    assert records.read_index(paths[0]).records == 4
    source = data.indexed_records(paths, {"x": ([3], tf.float32), "y": ([], tf.int64)},
                                  example=lambda f: (f["x"], f["y"]))
    x, y = source.read(None, tf.constant([9, 3, 4], tf.int64))
    assert source.size == 10
    np.testing.assert_array_equal(x.numpy(), columns["x"][[9, 3, 4]])
    np.testing.assert_array_equal(y.numpy(), [9, 3, 4])


def test_records_without_their_index_are_refused_with_the_fix(tmp_path):
    path = tmp_path / "old.tfrecord"
    with tf.io.TFRecordWriter(str(path)) as writer:
        writer.write(b"x")
    with pytest.raises(ConfigError, match=r"old.tfrecord has no index beside it, which reading "
                                          r"by index needs \(.*old.tfrecord.index, with every "
                                          r"record's offset\); make it: python -m "
                                          r"tools.index_records .*old.tfrecord$"):
        data.indexed_records([path], {"x": ([], tf.int64)})


def numbered_run(tmp_path, chosen, *overrides):
    config = cfg.load(overrides=["train.epochs=2", "train.verbose=0", "train.global_batch_size=16",
                                 "eval.test_every_epoch=false", *overrides])
    return trainer.run(config, tmp_path, strategy=chosen,
                       task=IndexedNumbered(Params(examples=256), seed=config.train.seed))


@pytest.mark.parametrize("kind", ["default", "mirrored"])
def test_a_run_by_index_trains_on_every_example_once_an_epoch(tmp_path, kind, caplog):
    chosen = strategy.create("default") if kind == "default" else one_device_reduction_mirrored()
    with caplog.at_level("INFO", logger="app.trainer"):
        metrics = numbered_run(tmp_path, chosen)
    assert metrics["input"] == "by_index" and metrics["input_guarantee"] == "exactly_once"
    assert metrics["visits_min"] == metrics["visits_max"] == 2, metrics  # two epochs
    assert ("input: by index, 256 examples, in an order of (train.seed, epoch): one "
            "permutation of all the examples; every example once per epoch") in caplog.text


def test_without_by_index_the_task_pipeline_is_read_and_the_run_says_so(tmp_path, caplog):
    with caplog.at_level("INFO", logger="app.trainer"):
        metrics = numbered_run(tmp_path, strategy.create("default"), "data.by_index=false")
    assert metrics["input"] == "pipeline" and metrics["input_guarantee"] == "none"
    assert "input: a pipeline (data.by_index = false)" in caplog.text


def test_a_task_that_gives_only_its_source_has_a_pipeline_of_it_too():
    class OnlyBySource(Task):
        def train_source(self):
            return indexed.Source(100, lambda loaded, i: (i, i % 3))

    task = OnlyBySource(seed=2)
    shards = []
    for pipeline in range(2):
        context = tf.distribute.InputContext(2, pipeline, 2)
        ids, labels = next(iter(task.train_dataset(context, global_batch_size=20).batch(5)))
        assert ids.shape == (5, 10)  # per-replica batches of this pipeline's shard
        shards.append(set(ids.numpy().ravel()))
        np.testing.assert_array_equal(labels.numpy(), ids.numpy() % 3)
    assert not shards[0] & shards[1] and len(shards[0] | shards[1]) == 100
    with pytest.raises(NotImplementedError, match="Task.train_dataset"):
        Task().train_dataset(tf.distribute.InputContext(), 8)
