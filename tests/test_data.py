import numpy as np
import pytest
import tensorflow as tf

from app import data
from app.config import ConfigError, DataConfig
from tests.conftest import tiny_split


def context(pipelines=1, pipeline_id=0, replicas=1):
    return tf.distribute.InputContext(num_input_pipelines=pipelines,
                                      input_pipeline_id=pipeline_id,
                                      num_replicas_in_sync=replicas)


def ids_split(n):
    """Examples whose first pixel is their index, to follow them through the pipeline."""
    images = np.zeros((n, 28, 28, 1), np.uint8)
    images[:, 0, 0, 0] = np.arange(n)
    return data.Split(images, np.arange(n, dtype=np.int64))


def test_batches_are_per_replica_and_preprocessed():
    fn = data.train_dataset_fn(tiny_split(64), global_batch_size=32)
    images, labels = next(iter(fn(context(replicas=4))))
    assert images.shape == (8, 28, 28, 1) and labels.shape == (8,)
    assert images.dtype == tf.float32
    assert 0.0 <= float(tf.reduce_min(images)) and float(tf.reduce_max(images)) <= 1.0


def test_training_data_repeats_and_reshuffles():
    fn = data.train_dataset_fn(ids_split(40), global_batch_size=40)
    epochs = [labels.numpy().tolist() for _, labels in fn(context()).take(3)]
    assert all(sorted(e) == list(range(40)) for e in epochs)
    assert epochs[0] != epochs[1]


def test_input_pipelines_read_disjoint_shards_that_cover_the_data():
    n, pipelines = 200, 3
    seen = []
    for pid in range(pipelines):
        fn = data.train_dataset_fn(ids_split(n), global_batch_size=6, shuffle_buffer=0)
        ds = fn(context(pipelines, pid, replicas=pipelines))
        per_epoch = (n // pipelines) // 2
        seen.append({int(v) for _, y in ds.take(per_epoch) for v in y.numpy()})
    for a in range(pipelines):
        for b in range(a + 1, pipelines):
            assert not seen[a] & seen[b]
    assert len(set().union(*seen)) >= n - pipelines * 2  # drop_remainder leaves < 1 batch each


def test_shard_policy_off_gives_every_pipeline_the_whole_set():
    n = 30
    for pid in range(2):
        fn = data.train_dataset_fn(ids_split(n), global_batch_size=2, shuffle_buffer=0,
                                   shard_policy="off")
        labels = [int(v) for _, y in fn(context(2, pid, replicas=2)).take(n) for v in y.numpy()]
        assert labels == list(range(n))


def test_random_shift_moves_whole_images_within_bounds():
    images = np.zeros((64, 28, 28, 1), np.float32)
    images[:, 10:18, 10:18, 0] = 1.0
    shifted = data.random_shift(tf.constant(images), max_shift=2, seed=1).numpy()
    assert shifted.shape == images.shape
    offsets = set()
    for img in shifted:
        rows, cols = np.nonzero(img[..., 0])
        assert img.sum() == 64  # the square is moved, never cut or blurred
        offsets.add((rows.min() - 10, cols.min() - 10))
    assert all(-2 <= dy <= 2 and -2 <= dx <= 2 for dy, dx in offsets)
    assert len(offsets) > 5


def test_eval_dataset_visits_every_example_once_in_order():
    split = ids_split(1001)
    labels = np.concatenate([y.numpy() for _, y in data.eval_dataset(split, 100)])
    np.testing.assert_array_equal(labels, np.arange(1001))


def test_subsets_and_validation_split():
    d = data.load(DataConfig(name="synthetic", train_examples=1000, test_examples=50,
                             validation_examples=100))
    assert (len(d.train), len(d.validation), len(d.test)) == (900, 100, 50)
    assert d.image_shape == (28, 28, 1) and d.num_classes == 10


def test_validation_larger_than_training_set():
    with pytest.raises(ConfigError) as e:
        data.load(DataConfig(name="synthetic", train_examples=100, validation_examples=100))
    assert str(e.value) == ("data.validation_examples (100) must be smaller than the training "
                            "set (100 examples); lower it or set it to 0")


def test_mnist_from_a_directory_without_the_files(tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path}/train-images-idx3-ubyte\\[.gz\\]: no such"):
        data.load(DataConfig(dir=str(tmp_path)))


def test_tfds_failure_is_explained(tmp_path):
    with pytest.raises(ConfigError) as e:
        data.load(DataConfig(name="tfds:no_such_dataset_xyz", dir=str(tmp_path)))
    assert str(e.value).startswith("data.name = 'tfds:no_such_dataset_xyz' could not be loaded (")
    assert str(e.value).endswith("prepare it with `tfds build` and set data.dir, or use "
                                 "data.name = mnist")
