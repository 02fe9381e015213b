"""The built-in MNIST task: its input pipelines, splits, sources and models."""

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from app import config as cfg
from app import task as tasks
from app.tasks import mnist
from app.tasks.mnist import Mnist
from tests.conftest import tiny_split


def context(pipelines=1, pipeline_id=0, replicas=1):
    return tf.distribute.InputContext(num_input_pipelines=pipelines,
                                      input_pipeline_id=pipeline_id,
                                      num_replicas_in_sync=replicas)


def ids_task(n, shard_policy="auto", **params):
    """Examples whose first pixel and label are their index, to follow them through."""
    images = np.zeros((n, 28, 28, 1), np.uint8)
    images[:, 0, 0, 0] = np.arange(n) % 256
    params = Mnist.Params(**{"shuffle_buffer": n, **params})
    return Mnist.from_arrays((images, np.arange(n, dtype=np.int64)), None,
                             (images, np.arange(n, dtype=np.int64)), params,
                             shard_policy=shard_policy)


def task_of(*overrides):
    return tasks.create(cfg.load(None, list(overrides)))[0]


def test_batches_are_per_replica_and_raw_uint8():
    task = Mnist.from_arrays(tiny_split(64), None, tiny_split(10))
    images, labels = next(iter(task.train_dataset(context(replicas=4), global_batch_size=32)))
    assert images.shape == (8, 28, 28, 1) and labels.shape == (8,)
    assert images.dtype == tf.uint8  # the model scales them: the export serves raw pixels


def test_training_data_repeats_and_reshuffles():
    ds = ids_task(40).train_dataset(context(), global_batch_size=40)
    epochs = [labels.numpy().tolist() for _, labels in ds.take(3)]
    assert all(sorted(e) == list(range(40)) for e in epochs)
    assert epochs[0] != epochs[1]


def test_input_pipelines_read_disjoint_shards_that_cover_the_data():
    n, pipelines = 200, 3
    seen = []
    for pid in range(pipelines):
        ds = ids_task(n, shuffle_buffer=0).train_dataset(context(pipelines, pid, pipelines), 6)
        seen.append({int(v) for _, y in ds.take((n // pipelines) // 2) for v in y.numpy()})
    for a in range(pipelines):
        for b in range(a + 1, pipelines):
            assert not seen[a] & seen[b]
    assert len(set().union(*seen)) >= n - pipelines * 2  # drop_remainder leaves < 1 batch each


def test_shard_policy_off_gives_every_pipeline_the_whole_set():
    n = 30
    for pid in range(2):
        task = ids_task(n, shard_policy="off", shuffle_buffer=0)
        ds = task.train_dataset(context(2, pid, replicas=2), global_batch_size=2)
        assert [int(v) for _, y in ds.take(n) for v in y.numpy()] == list(range(n))


def test_shard_policy_file_is_refused_for_records():
    with pytest.raises(cfg.ConfigError) as e:
        ids_task(10, shard_policy="file").train_dataset(context(2, 0, 2), 2)
    assert str(e.value) == ("data.shard_policy = 'file' needs a task that reads its training "
                            "data from files, one or more per worker; task Mnist shards "
                            "records. Use auto or data")


@pytest.mark.parametrize("seeded", [False, True])
def test_random_shift_moves_whole_images_within_bounds(seeded):
    images = np.zeros((64, 28, 28, 1), np.float32)
    images[:, 10:18, 10:18, 0] = 1.0
    seeds = tf.stack([tf.fill([64], tf.constant(7, tf.int64)), tf.range(64, dtype=tf.int64)], 1)
    shifted = mnist.random_shift(tf.constant(images), max_shift=2,
                                 seeds=seeds if seeded else None).numpy()
    if seeded:  # the same seeds, the same shifts
        again = mnist.random_shift(tf.constant(images), max_shift=2, seeds=seeds).numpy()
        np.testing.assert_array_equal(shifted, again)
    assert shifted.shape == images.shape
    offsets = set()
    for img in shifted:
        rows, cols = np.nonzero(img[..., 0])
        assert img.sum() == 64  # the square is moved, never cut or blurred
        offsets.add((rows.min() - 10, cols.min() - 10))
    assert all(-2 <= dy <= 2 and -2 <= dx <= 2 for dy, dx in offsets)
    assert len(offsets) > 5


def test_eval_dataset_visits_every_example_once_in_order():
    labels = np.concatenate([y.numpy() for _, y in ids_task(1001).eval_dataset("test", 100)])
    np.testing.assert_array_equal(labels, np.arange(1001))


def test_real_mnist_streams_from_the_idx_files():
    task = task_of("task.train_examples=1000", "task.test_examples=50",
                   "task.validation_examples=100")
    assert (task.train_examples(), task.eval_examples("validation"),
            task.eval_examples("test")) == (900, 100, 50)
    images, labels = next(iter(task.eval_dataset("validation", 100)))
    assert images.shape == (100, 28, 28, 1) and images.dtype == tf.uint8
    # The validation split is examples 900..999 of the training files.
    everything = next(iter(task_of("task.validation_examples=0").eval_dataset("test", 10)))
    assert everything[1].numpy().tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]  # t10k's first


def test_synthetic_source_is_generated_from_the_example_index():
    task = task_of("task.source=synthetic", "task.train_examples=64",
                   "task.validation_examples=0")
    first = [x.numpy() for x, _ in task.eval_dataset("test", 8).take(2)]
    again = [x.numpy() for x, _ in task.eval_dataset("test", 8).take(2)]
    np.testing.assert_array_equal(first[0], again[0])  # deterministic
    assert task.train_examples() == 64 and first[0].dtype == np.uint8


def test_validation_larger_than_training_set():
    task = task_of("task.source=synthetic", "task.train_examples=100",
                   "task.validation_examples=100")
    with pytest.raises(cfg.ConfigError) as e:
        task.train_examples()
    assert str(e.value) == ("task.validation_examples (100) must be smaller than the training "
                            "set (100 examples); lower it or set it to 0")


def test_more_training_examples_than_the_source_has_are_refused():
    task = task_of("task.train_examples=60001")  # MNIST's training files hold 60,000
    with pytest.raises(cfg.ConfigError) as e:
        task.train_examples()
    assert str(e.value) == ("task.train_examples (60001) is more than the 60000 training "
                            "examples of task.source 'mnist'; lower it, or set it to 0 for "
                            "all of them")
    assert task_of("task.train_examples=60000", "task.validation_examples=0").train_examples() \
        == 60000


def test_mnist_from_a_directory_without_the_files(tmp_path):
    missing = f"{tmp_path}/train-images-idx3-ubyte\\[.gz\\]: no such"
    with pytest.raises(cfg.ConfigError, match=missing):
        task_of(f"task.dir={tmp_path}").train_examples()


def test_tfds_failure_is_explained(tmp_path):
    task = task_of("task.source=tfds:no_such_dataset_xyz", f"task.dir={tmp_path}")
    with pytest.raises(cfg.ConfigError) as e:
        task.train_examples()
    assert str(e.value).startswith("task.source = 'tfds:no_such_dataset_xyz' could not be loaded (")
    assert str(e.value).endswith("prepare it with `tfds build` and set task.dir, or use "
                                 "task.source = mnist")


@pytest.mark.parametrize("override, message", [
    ("task.model=resnet", "task.model = 'resnet' is not one of cnn, mlp"),
    ("task.dropout=1.0", "task.dropout = 1.0 must be in [0, 1)"),
    ("task.train_examples=-5", "task.train_examples = -5 must be >= 0"),
    ("task.source=imagenet", "task.source = 'imagenet' is not one of mnist, synthetic, "
                             "tfds:<name>"),
    ("task.epochs=3", "unknown key 'task.epochs'; keys of [task] are model, dropout, source"),
    ("task.dropout=high", "task.dropout = 'high' has type str, expected float"),
])
def test_bad_task_parameters_name_the_field(override, message):
    with pytest.raises(cfg.ConfigError) as e:
        task_of(override)
    assert message in str(e.value)


@pytest.mark.parametrize("kerases", [keras, tf_keras], ids=["keras", "tf_keras"])
def test_cnn_is_the_classic_network(kerases):
    model = mnist.cnn(kerases, (28, 28, 1), 10, dropout=0.5)
    # conv 5x5x32, conv 5x5x64, dense 7*7*64 -> 1024, dense 1024 -> 10
    expected = (5 * 5 * 32 + 32) + (5 * 5 * 32 * 64 + 64) + (3136 * 1024 + 1024) + (1024 * 10 + 10)
    assert model.count_params() == expected
    assert model(np.zeros((2, 28, 28, 1), np.uint8)).shape == (2, 10)


@pytest.mark.parametrize("kerases", [keras, tf_keras], ids=["keras", "tf_keras"])
def test_mlp_is_the_512_128_128_stack(kerases):
    model = mnist.mlp(kerases, (28, 28, 1), 10)
    assert [layer.units for layer in model.layers if hasattr(layer, "units")] == [512, 128, 128, 10]


def test_preprocessing_rounds_cost_work_and_leave_the_images_as_they_were():
    images = tf.random.uniform((4, 28, 28, 1), maxval=256, dtype=tf.int32)
    images = tf.cast(images, tf.uint8)
    done = mnist.preprocess(images, 3)
    assert done.dtype == tf.uint8 and np.array_equal(done.numpy(), images.numpy())
    graph = tf.function(lambda x: mnist.preprocess(x, 3)).get_concrete_function(
        tf.TensorSpec((None, 28, 28, 1), tf.uint8)).graph
    assert [op.type for op in graph.get_operations()].count("Conv2D") == 3
