"""The runner of each strategy kind, on a tiny fake task: what it checks, the batch its
input pipelines build, who writes, and what it adds to metrics.json. (The
parameter-server runners need a cluster: tests/test_parameter_server.py,
tests/test_sync_ps.py.)"""

import json
import types

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from app import config as cfg
from app import data, strategy, trainer
from app.cluster import tf_config as clusters
from app.distribute.ps import coordinated
from app.run import runners
from app.task import Task
from tests.conftest import one_device_reduction_mirrored


class Tiny(Task):
    """Two features, a linear target: the least a task can be."""

    metric = "mae"

    def build_model(self):
        inputs = keras.Input((2,))
        return keras.Model(inputs, keras.layers.Dense(1)(inputs))

    def _arrays(self):
        x = np.random.default_rng(0).normal(size=(64, 2)).astype(np.float32)
        return x, x.sum(axis=1, keepdims=True)

    def train_dataset(self, context, global_batch_size):
        return data.batches(self.shard(data.from_arrays(*self._arrays()), context),
                            context.get_per_replica_batch_size(global_batch_size),
                            seed=0, shuffle_buffer=64)

    def eval_dataset(self, split, batch_size):
        return data.from_arrays(*self._arrays()).batch(batch_size) if split == "test" else None

    def train_examples(self):
        return 64

    def loss(self):
        return keras.losses.MeanSquaredError()

    def metrics(self):
        return [keras.metrics.MeanAbsoluteError(name="mae")]


def worker(index: int) -> clusters.Cluster:
    spec = {"worker": ["localhost:1", "localhost:2"]}
    return clusters.parse(json.dumps({"cluster": spec,
                                      "task": {"type": "worker", "index": index}}))


def test_single_host_runners_are_picked_from_the_strategy():
    config = cfg.Config()
    default = runners.create(config, strategy=strategy.create("default"))
    mirrored = runners.create(config, strategy=strategy.create("mirrored"))
    assert type(default) is type(mirrored) is runners.SingleHost
    assert (default.num_replicas, mirrored.num_replicas) == (1, 2)
    assert not default.all_reduces and mirrored.all_reduces
    assert default.input_batch == config.train.global_batch_size and default.writes


def test_multi_worker_writes_only_on_the_chief_and_counts_its_workers(tmp_path):
    mirrored = strategy.create("mirrored")
    chief, other = (runners.MultiWorker(mirrored, cfg.Config(), worker(i)) for i in (0, 1))
    assert chief.writes and not other.writes
    assert chief.num_workers == other.num_workers == 2
    assert chief.outdir(tmp_path) == tmp_path
    elsewhere = other.outdir(tmp_path)  # the other workers save too, where nobody looks
    assert elsewhere != tmp_path and elsewhere.is_dir()
    other.finish(elsewhere, tmp_path)
    assert not elsewhere.exists()


def test_a_multi_worker_peer_lost_mid_all_reduce_is_a_task_lost_error(tmp_path):
    runner = runners.MultiWorker(strategy.create("default"), cfg.Config(), worker(0))
    error = tf.errors.UnavailableError(
        None, None, "from remote target /job:worker/replica:0/task:1 while calling RecvBuf")
    with pytest.raises(clusters.TaskLost) as lost:
        with runner.guard(tmp_path):
            raise error
    assert str(lost.value).startswith("worker:1 (localhost:2) became unreachable during an "
                                      "all-reduce; training stopped (exit code 203). Restart "
                                      "it with the lost task")
    assert str(tmp_path / "backup") in str(lost.value)


class Coordinator:
    """Stands for a ClusterCoordinator holding a failed step's error, which `done()`
    raises, or none."""

    def __init__(self, kept: Exception | None = None):
        self.kept = kept

    def done(self) -> bool:
        if self.kept:
            raise self.kept
        return True


def ps_chief(coordinator: Coordinator) -> types.SimpleNamespace:
    """What AsyncPS.guard reads of its runner: a chief of 2 ps tasks and its coordinator."""
    spec = {"chief": ["localhost:1"], "worker": ["localhost:2"],
            "ps": ["localhost:3", "localhost:4"]}
    return types.SimpleNamespace(coordinator=coordinator, cluster=clusters.parse(json.dumps(
        {"cluster": spec, "task": {"type": "chief", "index": 0}})))


# What waiting on a step that TensorFlow's coordinator cancelled raises.
CANCELLED = tf.errors.CancelledError(
    None, None, "The corresponding function is cancelled. Please reschedule the function.")


def test_a_step_cancelled_behind_a_ps_that_failed_is_that_ps_lost(tmp_path):
    # A partitioned worker's failed reads of ps:0, as TensorFlow counts them.
    unreachable = tf.errors.UnavailableError(
        None, None, "Socket closed. Encountered when executing an operation on "
        "/job:ps/replica:0/task:0/device:CPU:0")
    with pytest.raises(clusters.TaskLost) as lost:
        with runners.AsyncPS.guard(ps_chief(Coordinator(unreachable)), tmp_path):
            raise CANCELLED
    assert lost.value.exit_code == 203
    assert str(lost.value).startswith("parameter server ps:0 (localhost:3) became unreachable; "
                                      "training stopped (exit code 203). Restart it")


# What a step got from a ps that was SIGKILLed and relaunched on its port while no step
# ran: the new process answers without the run's context, or, once the coordinator has
# made that again (after a worker failure), without the tensors of its variables.
RPC_FROM_PS1 = ("\nAdditional GRPC error information from remote target "
                "/job:ps/replica:0/task:1/device:CPU:0 while calling "
                "/tensorflow.eager.EagerService/RunComponentFunction")
RESTARTED = [
    tf.errors.AbortedError(None, None, "Unable to find a context_id matching the specified one "
                           "(62736). Perhaps the worker was restarted, or the context was "
                           "GC'd?" + RPC_FROM_PS1),
    tf.errors.InvalidArgumentError(None, None, "Unable to find the relevant tensor remote_handle: "
                                   "Op ID: 5, Output num: 0." + RPC_FROM_PS1),
]


@pytest.mark.parametrize("restarted", RESTARTED, ids=["context", "tensors"])
@pytest.mark.parametrize("cancelled_behind", [False, True], ids=["raised", "kept"])
def test_a_ps_restarted_before_a_step_reached_it_is_that_ps_lost(tmp_path, restarted,
                                                                  cancelled_behind):
    chief = ps_chief(Coordinator(restarted if cancelled_behind else None))
    with pytest.raises(clusters.TaskLost) as lost:
        with runners.AsyncPS.guard(chief, tmp_path):
            raise CANCELLED if cancelled_behind else restarted
    assert str(lost.value).startswith("parameter server ps:1 (localhost:4) failed or was "
                                      "restarted: its variables are gone; training stopped "
                                      "(exit code 203)")


def test_an_error_of_the_step_itself_is_not_a_ps_lost(tmp_path):
    # Named after a ps, but not as TensorFlow names a ps that failed: the task's own.
    own = tf.errors.AbortedError(None, None, "/job:ps/replica:0/task:1: the task's own abort")
    with pytest.raises(tf.errors.AbortedError, match="the task's own abort") as raised:
        with runners.AsyncPS.guard(ps_chief(Coordinator()), tmp_path):
            raise own
    assert raised.value is own and raised.value.__cause__ is None


def test_steps_cancelled_with_no_other_error_are_a_lost_connection_not_a_failure(tmp_path):
    with pytest.raises(clusters.TaskLost) as lost:
        with runners.AsyncPS.guard(ps_chief(Coordinator()), tmp_path):
            raise CANCELLED
    assert lost.value.exit_code == 203
    assert str(lost.value).startswith(
        "TensorFlow's ClusterCoordinator cancelled the training steps (The corresponding "
        "function is cancelled. Please reschedule the function.), as it does when a "
        "connection between the tasks fails; training stopped (exit code 203). Restart it")


def test_a_step_cancelled_behind_a_step_that_failed_raises_that_steps_error(tmp_path):
    bug = tf.errors.InvalidArgumentError(None, None, "assertion failed: [the task's own check]")
    with pytest.raises(tf.errors.InvalidArgumentError, match="the task's own check"):
        with runners.AsyncPS.guard(ps_chief(Coordinator(bug)), tmp_path):
            raise CANCELLED
    assert coordinated.failure_behind(Coordinator(bug), bug) is bug  # not cancelled: itself


def test_a_fake_task_trains_and_reports_its_headline_metric(tmp_path):
    config = cfg.load(None, ["train.epochs=2", "train.global_batch_size=8", "train.verbose=0",
                             "train.learning_rate=0.05", "train.lr_schedule=constant"])
    # Summed without collective ops, which other in-process strategies would collide with.
    metrics = trainer.run(config, tmp_path, strategy=one_device_reduction_mirrored(), task=Tiny())
    assert metrics["metric"] == "test_mae" and metrics["higher_is_better"] is False
    assert set(metrics) >= {"test_loss", "test_mae", "steps", "history"}
    assert "num_test_examples" not in metrics  # Tiny does not say how many it has
    assert metrics["steps"] == 2 * 64 // 8
    assert metrics["history"][-1]["test_mae"] == pytest.approx(metrics["test_mae"], rel=1e-5)
    assert not any(key.startswith("ps_") for key in metrics)  # no ps: no placement figures


@pytest.mark.parametrize("override, message", [
    ("ps.mode=sync", "ps.mode = sync is parameter-server training and this run has no ps"),
    ("debug.slow_worker=0", "debug.slow_worker = 0 slows a worker of a parameter-server"),
    ("ps.compression=fp16", "ps.compression = fp16 compresses the gradients workers push"),
    ("ps.read_compression=fp16", "ps.read_compression = fp16 compresses the variables workers "
                                 "read"),
    # At one step an execution as at two: the one refusal, whose advice is the fix.
    ("ps.read_every=2", "ps.read_every = 2 reads the variables from ps tasks less often, and "
                        "this run has none"),
    ("ps.read_every=2 train.steps_per_execution=2", "ps.read_every = 2 reads the variables "
                                                    "from ps tasks less often, and this run "
                                                    "has none"),
    ("sync.compression=fp16", "sync.compression = fp16 compresses the all-reduce of"),
    ("train.global_batch_size=7", "train.global_batch_size (7) must be divisible by the number "
                                  "of replicas (2); use 6 or 8"),
])
def test_single_host_checks(override, message):
    name = "default" if override.startswith("sync.") else "mirrored"
    runner = runners.create(cfg.load(None, override.split()), strategy=strategy.create(name))
    with pytest.raises(cfg.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        runner.check()


def test_a_parameter_server_runner_needs_its_cluster():
    with pytest.raises(ValueError, match="a parameter-server run needs its cluster"):
        runners.AsyncPS(tf.distribute.get_strategy(), cfg.Config(), None)
