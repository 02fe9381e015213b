import functools
import json
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from app import config as cfg
from app import strategy as strategies
from app.cluster import tf_config as clusters
from app.config import ConfigError
from app.tasks.mnist import Mnist
from tests.conftest import tiny_split

MULTI_WORKER = clusters.parse(json.dumps(
    {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}}))
PS = clusters.parse(json.dumps(
    {"cluster": {"chief": ["a:1"], "ps": ["b:1"], "worker": ["c:1"]},
     "task": {"type": "chief", "index": 0}}))
ONE_WORKER = clusters.parse(json.dumps(
    {"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}}))


@pytest.mark.parametrize("name, cluster, gpus, expected", [
    ("auto", None, 0, "default"),
    ("auto", None, 1, "default"),
    ("auto", None, 2, "mirrored"),
    ("auto", ONE_WORKER, 0, "default"),
    ("auto", ONE_WORKER, 4, "mirrored"),
    ("auto", MULTI_WORKER, 0, "multi_worker_mirrored"),
    ("auto", PS, 0, "parameter_server"),
    ("default", None, 2, "default"),
    ("mirrored", None, 0, "mirrored"),
    ("multi_worker_mirrored", None, 0, "multi_worker_mirrored"),
    ("multi_worker_mirrored", MULTI_WORKER, 0, "multi_worker_mirrored"),
    ("parameter_server", PS, 0, "parameter_server"),
])
def test_choose(name, cluster, gpus, expected):
    assert strategies.choose(name, cluster, gpus) == expected


@pytest.mark.parametrize("name, cluster, message", [
    ("mirrored", MULTI_WORKER, "--strategy mirrored trains on one host, but TF_CONFIG "
                               "describes a cluster (2 worker); unset TF_CONFIG, or use "
                               "--strategy auto"),
    ("default", PS, "--strategy default trains on one host, but TF_CONFIG describes a "
                    "cluster (1 chief, 1 ps, 1 worker)"),
    ("multi_worker_mirrored", PS, "--strategy multi_worker_mirrored has no parameter servers, "
                                  "but TF_CONFIG lists 1 'ps' task(s)"),
    ("parameter_server", None, "--strategy parameter_server needs TF_CONFIG with 'chief', "
                               "'worker' and 'ps' jobs"),
    ("parameter_server", MULTI_WORKER, "--strategy parameter_server needs TF_CONFIG"),
    ("tpu", None, "Unrecognized strategy 'tpu'; choose auto or one of default, mirrored"),
])
def test_impossible_combinations_are_errors(name, cluster, message):
    with pytest.raises(ConfigError) as e:
        strategies.choose(name, cluster, 0)
    assert message in str(e.value)


def test_default_strategy():
    s = strategies.create("default")
    assert s is tf.distribute.get_strategy()
    assert strategies.describe(s) == "DefaultStrategy"


def test_mirrored_uses_the_logical_cpu_devices():
    s = strategies.create("mirrored")
    assert isinstance(s, tf.distribute.MirroredStrategy)
    assert s.num_replicas_in_sync == 2  # conftest split the CPU in two
    assert strategies.describe(s) == "MirroredStrategy"


def test_mirrored_strategies_one_after_another_in_a_process_each_all_reduce():
    """A process that trains one model, then another (a loop over configs, a test
    session), builds a MirroredStrategy for each: every one's all-reduce of its
    own shapes works (tensorflow/tensorflow#62790)."""
    for size in (7, 3, 7):
        s = strategies.create("mirrored")

        @tf.function
        def summed(s=s, size=size):
            return s.run(lambda: tf.distribute.get_replica_context().all_reduce(
                "sum", tf.ones([size])))

        sums = [t.numpy() for t in s.experimental_local_results(summed())]
        np.testing.assert_array_equal(sums, np.full((2, size), 2.0))


def test_mirrored_on_cpus_feeds_each_replica_its_own_shard_of_the_training_input():
    s = strategies.create("mirrored")
    options = strategies.input_options(s)
    assert options.experimental_replication_mode == tf.distribute.InputReplicationMode.PER_REPLICA
    task = Mnist.from_arrays(tiny_split(64), None, tiny_split(8), Mnist.Params(shuffle_buffer=0))
    dataset_fn = functools.partial(task.train_dataset, global_batch_size=8)
    batch = next(iter(s.distribute_datasets_from_function(dataset_fn, options)))
    per_replica = [images.numpy() for images in s.experimental_local_results(batch[0])]
    assert [len(p) for p in per_replica] == [4, 4]  # the global batch split over 2 replicas
    # Replica i reads shard i: examples i, i + 2, ... of the training set.
    expected = [tiny_split(64)[0][i:8:2] for i in (0, 1)]
    np.testing.assert_array_equal(per_replica[0], expected[0])
    np.testing.assert_array_equal(per_replica[1], expected[1])


def test_other_strategies_keep_tensorflows_input_defaults():
    assert strategies.input_options(strategies.create("default")) is None


def test_parameter_server_gives_up_on_tasks_that_never_answer():
    config = cfg.load(overrides=["cluster.connect_timeout_s=1"])
    with pytest.raises(clusters.ClusterError) as e:
        strategies.create("auto", PS, config)
    assert str(e.value).startswith(
        "no answer within cluster.connect_timeout_s = 1 s from ps:0 at b:1, worker:0 at c:1; ")


def test_split_cpu_after_start_must_match():
    strategies.split_cpu(2)  # already so: fine
    with pytest.raises(ConfigError, match="runtime.cpu_devices = 3, but TensorFlow already "
                                          "started with 2 CPU device"):
        strategies.split_cpu(3)


def test_thread_spinning_is_fixed_when_tensorflow_starts():
    # In a process of its own: this one's pools were set to sleep before it started
    # (conftest), which asking for it again does not refuse.
    code = ("import tensorflow as tf\n"
            "from app import config, strategy\n"
            "tf.constant(1)\n"  # started, its pools spinning (TensorFlow's default)
            "strategy.configure_runtime(config.RuntimeConfig())\n"  # as it started: fine
            "try:\n"
            "    strategy.configure_runtime(config.RuntimeConfig(thread_spinning=False))\n"
            "except config.ConfigError as e:\n"
            "    print(e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.stdout.strip() == ("runtime.thread_spinning = false, but TensorFlow already "
                                     "started with its thread pools spinning; set it before "
                                     "any TensorFlow op runs"), result.stderr
    strategies.configure_runtime(cfg.RuntimeConfig(thread_spinning=False))  # as it started


def test_thread_spinning_off_reaches_the_config_every_strategy_makes_its_servers_from():
    # MultiWorkerMirrored's collective server and the parameter-server chief's
    # connection copy the eager context's config (TF 2.21 collective_all_reduce_strategy,
    # eager/remote.py); so does the one process's own context.
    code = ("import tensorflow as tf\n"
            "from app import config, strategy\n"
            "strategy.configure_runtime(config.RuntimeConfig(thread_spinning={}))\n"
            "tf.constant(1)\n"
            "print(tf.__internal__.eager_context.get_config()"
            ".experimental.disable_thread_spinning)")
    for spinning, disabled in ((False, "True"), (True, "False")):
        result = subprocess.run([sys.executable, "-c", code.format(spinning)],
                                capture_output=True, text=True, timeout=300)
        assert result.stdout.split() == [disabled], result.stderr


def test_batch_must_divide_over_replicas():
    assert strategies.check_batch(128, 2) == 64
    with pytest.raises(ConfigError) as e:
        strategies.check_batch(100, 3)
    assert str(e.value) == ("train.global_batch_size (100) must be divisible by the number of "
                            "replicas (3); use 99 or 102")
    with pytest.raises(ConfigError, match=r"\(2\) must be divisible .* \(4\); use 4$"):
        strategies.check_batch(2, 4)
