"""Shared test set-up.

The CPU is split into two logical devices before any test touches
TensorFlow, so MirroredStrategy has two replicas to work with in-process; and
TensorFlow's thread pools sleep when idle rather than spin, as launch.local's
tasks do: make test's runners share the two cores.
"""

import json
import os
import resource
import time
from collections.abc import Iterator

import numpy as np
import pytest
import tensorflow as tf

from app import config as cfg
from app import strategy
from app.cluster import tf_config as clusters
from app.tasks.mnist import Mnist

try:
    strategy.configure_runtime(cfg.RuntimeConfig(cpu_devices=2, thread_spinning=False))
except cfg.ConfigError:  # imported by a script whose TensorFlow has started (a
    strategy.split_cpu(2)  # MultiWorkerMirrored worker): its pools stay as they started

# The test files that take longest, longest first (measured: docs/testing.md). `make
# test`'s runners take the files in collection order (--no-loadscope-reorder):
# started first, the long ones end beside the many short ones instead of after
# them. Only an order: a file not listed runs after these, as collected.
# test_steps_per_execution.py's MultiWorkerMirrored pair (the file's first test) computes
# for about 25 s but may wait for minutes (docs/testing.md): started last, it once ran
# alone at the end of the first phase for 3 minutes.
LONGEST_FIRST = ("test_compat_multi_worker.py", "test_steps_per_execution.py", "test_compat.py",
                 "test_exactly_once.py", "test_sigterm.py", "test_restart_task.py",
                 "test_multi_worker.py", "test_slurm_jobs.py",
                 "test_network.py", "test_launch_local.py", "test_data_service.py",
                 "test_train_cli.py", "test_restart.py", "test_sync_ps.py", "test_resume_ps.py")
# Files whose tests are independent of each other (no module fixture, no order):
# each test may run on either runner. Every other file runs whole on one runner, in
# order, its module fixtures built once.
SPREAD = ("test_compat_multi_worker.py", "test_compat.py", "test_exactly_once.py",
          "test_sigterm.py", "test_restart_task.py", "test_multi_worker.py",
          "test_launch_local.py")


def pytest_xdist_make_scheduler(config, log):
    """`make test`'s schedule (`--dist loadfile`): by file, but the tests of `SPREAD`
    each on its own. Any other `--dist` is xdist's own."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduler(LoadFileScheduling):
        # A unit of work is what `_split_scope` names (pytest-xdist 3.8: a file, for
        # loadfile). If it moves, the SPREAD files run whole: slower, not wrong.
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return nodeid if path.rpartition("/")[2] in SPREAD else path

    return Scheduler(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """With TEST_CPU_LOG=FILE, each test's CPU seconds (setup, call and teardown; the
    runner's own threads and every process it started and reaped, the tasks of a
    launch.local included) appended to FILE as `cpu_s wall_s start runner nodeid`
    (`start` in Unix seconds, `runner` xdist's name for it). What a test costs the
    suite is mostly its CPU time; its wall time and start show a runner left alone
    at the end of a phase, or a test that waits more than it computes."""
    log = os.environ.get("TEST_CPU_LOG")
    before, start = (_cpu_seconds(), time.time()) if log else (0.0, 0.0)
    yield
    if log:
        runner = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(log, "a") as f:
            f.write(f"{_cpu_seconds() - before:.2f} {time.time() - start:.2f} {start:.2f} "
                    f"{runner} {item.nodeid}\n")


def _cpu_seconds() -> float:
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                          resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable


def tiny_split(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """`n` MNIST-shaped (images, labels) whose label is readable from the image (learnable)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n)
    images = rng.integers(0, 40, (n, 28, 28, 1), dtype=np.uint8)
    for i, label in enumerate(labels):  # a bright bar whose row encodes the class
        images[i, 2 + 2 * label: 4 + 2 * label, 4:24, 0] = 255
    return images, labels.astype(np.int64)


def tiny_task(config: cfg.Config | None = None) -> Mnist:
    """The MNIST task on 512 / 64 / 101 tiny learnable examples, with `config`'s task
    parameters (model, dropout, ...) and seed."""
    from app import task as tasks

    config = config or cfg.Config()
    _, resolved = tasks.create(config)
    params = Mnist.Params(**resolved.task.params)
    return Mnist.from_arrays(tiny_split(512), tiny_split(64, seed=1), tiny_split(101, seed=2),
                             params, seed=config.train.seed,
                             shard_policy=config.data.shard_policy)


@pytest.fixture(scope="module")
def tiny_datasets() -> tuple:
    """The (images, labels) of tiny_task's train, validation and test splits."""
    return tiny_split(512), tiny_split(64, seed=1), tiny_split(101, seed=2)


@pytest.fixture(scope="session")
def ps_cluster() -> Iterator[clusters.Cluster]:
    """A chief's view of 2 workers and 2 ps servers started in this process (tests
    marked `cluster`: the servers and the connection stay until the process ends)."""
    from launch import inprocess
    from launch.ports import Ports

    # Held for the session: this process's chief binds its port when it connects.
    with Ports() as ports:
        spec = inprocess.cluster_spec(num_workers=2, num_ps=2, ports=ports)
        inprocess.start_servers(spec)
        yield clusters.parse(json.dumps({"cluster": spec,
                                         "task": {"type": "chief", "index": 0}}))


@pytest.fixture(scope="session")
def ps_strategy(ps_cluster):
    return strategy.parameter_server(ps_cluster, cfg.PSConfig(), connect_timeout_s=30)


def one_device_reduction_mirrored() -> tf.distribute.MirroredStrategy:
    """MirroredStrategy over the 2 logical CPUs that sums without collective ops.

    In-process collectives are keyed by instance numbers that every new strategy
    counts from the same start; a test whose all-reduce carries float16 would
    leave later strategies' float32 all-reduces failing on a type mismatch.
    """
    devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    return tf.distribute.MirroredStrategy(devices,
                                          cross_device_ops=tf.distribute.ReductionToOneDevice())
