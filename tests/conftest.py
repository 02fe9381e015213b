"""Shared test set-up.

The CPU is split into two logical devices before any test touches
TensorFlow, so MirroredStrategy has two replicas to work with in-process.
"""

import json

import numpy as np
import pytest
import tensorflow as tf

from app import cluster as clusters
from app import config as cfg
from app import data, strategy

strategy.split_cpu(2)


def tiny_split(n: int, seed: int = 0) -> data.Split:
    """`n` MNIST-shaped examples whose label is readable from the image (learnable)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n)
    images = rng.integers(0, 40, (n, 28, 28, 1), dtype=np.uint8)
    for i, label in enumerate(labels):  # a bright bar whose row encodes the class
        images[i, 2 + 2 * label: 4 + 2 * label, 4:24, 0] = 255
    return data.Split(images, labels.astype(np.int64))


@pytest.fixture(scope="module")
def tiny_datasets() -> data.Datasets:
    return data.Datasets(train=tiny_split(512), validation=tiny_split(64, seed=1),
                         test=tiny_split(101, seed=2), num_classes=10)


@pytest.fixture(scope="session")
def ps_cluster() -> clusters.Cluster:
    """A chief's view of 2 workers and 2 ps servers started in this process (tests
    marked `cluster`: the servers and the connection stay until the process ends)."""
    from launch import inprocess

    spec = inprocess.cluster_spec(num_workers=2, num_ps=2)
    inprocess.start_servers(spec)
    return clusters.parse(json.dumps({"cluster": spec, "task": {"type": "chief", "index": 0}}))


@pytest.fixture(scope="session")
def ps_strategy(ps_cluster):
    from app import parameter_server

    return parameter_server.create(ps_cluster, cfg.PSConfig(), connect_timeout_s=30)


def one_device_reduction_mirrored() -> tf.distribute.MirroredStrategy:
    """MirroredStrategy over the 2 logical CPUs that sums without collective ops.

    In-process collectives are keyed by instance numbers that every new strategy
    counts from the same start; a test whose all-reduce carries float16 would
    leave later strategies' float32 all-reduces failing on a type mismatch.
    """
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    return tf.distribute.MirroredStrategy(devices,
                                          cross_device_ops=tf.distribute.ReductionToOneDevice())
