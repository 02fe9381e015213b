"""ParameterServerStrategy on a fake in-process cluster: 2 workers and 2 ps
servers in this process, which is the chief (multi_worker_test_base's way;
the `ps_cluster` fixture of conftest.py).

TensorFlow's servers cannot be stopped and the chief's connection changes the
process's devices for good, so these tests run in a pytest process of their
own (`make test` runs the `cluster` marker separately).
"""

import dataclasses
import json
import logging
import os
import socket
import threading

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras
import zoo

from app import config as cfg
from app import trainer
from app.cluster import chief_failure, markers, serving
from app.cluster import tf_config as clusters
from app.dialects import keras2
from app.distribute.ps import variables as ps_variables
from app.planning import model as plan
from app.run import optimizers, runners
from launch.ports import Ports
from tests.conftest import tiny_task

pytestmark = pytest.mark.cluster
# The serve tests' servers stay until this process exits, and so do their ports.
_PORTS = Ports()


def config(*overrides: str) -> cfg.Config:
    return cfg.load(None, ["train.epochs=2", "train.global_batch_size=16", "train.verbose=0",
                           "eval.batch_size=32", *overrides])


@pytest.fixture(scope="module")
def trained(ps_strategy, ps_cluster, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ps")
    metrics = trainer.run(config(), workdir, strategy=ps_strategy,
                          cluster=ps_cluster, task=tiny_task(config()))
    return metrics, workdir


def test_training_on_the_cluster_writes_metrics(trained):
    metrics, workdir = trained
    assert metrics["strategy"] == "ParameterServerStrategy"
    assert (metrics["num_workers"], metrics["num_ps"]) == (2, 2)
    assert metrics["epochs_completed"] == 2
    assert metrics["steps"] >= 2 * 512 // 16
    assert metrics["num_test_examples"] == 101
    assert metrics["test_accuracy"] > 0.3  # learnable bars: far above chance after 64 steps
    assert json.loads((workdir / "metrics.json").read_text())["ps_bytes"] == metrics["ps_bytes"]


def test_test_accuracy_is_exact_over_every_test_image(trained, tiny_datasets):
    metrics, workdir = trained
    model = keras.models.load_model(workdir / "export")
    images, labels = tiny_datasets[2]
    logits = model.predict(images, verbose=0)  # raw pixels: the export scales them
    expected = float(np.mean(np.argmax(logits, axis=-1) == labels))
    # float32 metric sums over 101 examples: exact to float32's resolution.
    assert metrics["test_accuracy"] == pytest.approx(expected, abs=1e-6)


def test_variables_live_on_ps_and_the_big_kernel_is_sharded_over_both(ps_strategy):
    with ps_strategy.scope():
        dense = keras.layers.Dense(1024)  # 3136 x 1024 floats: 12.25 MiB
        dense.build((None, 3136))
    kernel = dense.kernel
    assert type(kernel).__name__ == "ShardedVariable"
    tasks = sorted(tf.DeviceSpec.from_string(v.device).task for v in kernel.variables)
    jobs = {tf.DeviceSpec.from_string(v.device).job for v in kernel.variables}
    assert jobs == {"ps"} and tasks == [0, 1]


def test_placement_lists_a_lookup_table_among_the_weights_as_not_a_variable(ps_strategy):
    with ps_strategy.scope():
        model = zoo.TextVectorizationModel().build_model()
    placement = ps_variables.placement(model.weights, num_ps=2)
    assert [type(w).__name__ for w in model.weights if not ps_variables.is_variable(w)] == [
        "VocabWeightHandler"]
    assert len(placement.others) == 1 and len(placement.shards) == 3  # embedding, kernel, bias
    assert any("not a variable" in line for line in placement.report())


def test_placement_is_balanced_and_predicted_by_the_plan(trained):
    metrics, _ = trained
    assert metrics["ps_balance"] <= 1.05
    placement, _ = plan.predict(config(), num_ps=2)
    predicted = placement.ps_bytes
    # The plan places from ps:0, as a chief's first variable is; this process's strategy
    # has placed the variables of earlier tests round robin, so the run may start on ps:1.
    rotations = [predicted[i:] + predicted[:i] for i in range(len(predicted))]
    assert metrics["ps_bytes"] in rotations


def test_each_worker_reads_its_own_shard_of_the_data(ps_strategy):
    pipelines = []

    def dataset_fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        pipelines.append(context.num_input_pipelines)
        # Repeated: the coordinator may give the same worker a closure again, which
        # then reads its own shard again rather than running out.
        return tf.data.Dataset.range(10).shard(context.num_input_pipelines,
                                               context.input_pipeline_id).batch(10).repeat()

    coordinator = tf.distribute.coordinator.ClusterCoordinator(ps_strategy)
    per_worker = coordinator.create_per_worker_dataset(
        lambda: ps_strategy.distribute_datasets_from_function(
            runners.per_worker(dataset_fn, num_workers=2)))
    assert pipelines == [2]  # traced once; the worker index is a value each worker fills in

    @tf.function
    def first_batch(iterator):
        return next(iterator)

    iterator = iter(per_worker)
    # Each closure resolves the iterator to the worker that runs it. Which worker runs
    # which closure is the coordinator's choice: closures are scheduled until both
    # workers' shards have been seen.
    seen = set()
    for _ in range(50):
        remotes = [coordinator.schedule(first_batch, args=(iterator,)) for _ in range(4)]
        coordinator.join()
        seen.update(tuple(remote.fetch().tolist()) for remote in remotes)
        if len(seen) == 2:
            break
    assert seen == {(0, 2, 4, 6, 8), (1, 3, 5, 7, 9)}


def test_fp16_push_casts_on_the_worker_and_back_on_the_ps(ps_strategy):
    with ps_strategy.scope():
        v = tf.Variable([0.0, 0.0])
        settings = config("ps.compression=fp16", "train.optimizer=sgd",
                          "train.lr_schedule=constant", "train.learning_rate=1.0")
        optimizer = optimizers.optimizer(settings, tiny_task(settings), steps_per_epoch=1,
                                      dialect=keras2)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(ps_strategy)

    @tf.function
    def step():
        def replica_fn():
            gradient = tf.constant([0.1, 1e-3]) + 0.0 * v  # computed on the worker
            optimizer.apply_gradients([(gradient, v)])
        ps_strategy.run(replica_fn)

    coordinator.schedule(step)
    coordinator.join()
    # SGD (momentum 0.9, a first step) moves v by exactly the float16 gradient.
    f16 = np.float16
    np.testing.assert_array_equal(v.numpy(), -np.array([f16(0.1), f16(1e-3)], np.float32))
    casts = [op for op in step.get_concrete_function().graph.get_operations()
             if op.type == "Cast" and tf.float16 in (op.get_attr("SrcT"), op.get_attr("DstT"))]
    to_16 = [op.device for op in casts if op.get_attr("DstT") == tf.float16]
    back = [op.device for op in casts if op.get_attr("SrcT") == tf.float16]
    # The float16 tensor is what crosses from the worker to the ps.
    assert to_16 and not any("/job:ps" in d for d in to_16)
    assert back and all(d == v.device for d in back), (back, v.device)


DETERMINISTIC = (
    "train.deterministic = true repeats a synchronous run bit for bit across a resume; under "
    "ParameterServerStrategy the workers' updates reach the ps tasks in whatever order they "
    "finish, so no run repeats. Set it to false, or train with MultiWorkerMirrored (no ps "
    "tasks)")


@pytest.mark.parametrize("overrides, message", [
    (["train.deterministic=true", "ps.mode=async"], DETERMINISTIC),
    (["train.deterministic=true", "ps.mode=sync"], DETERMINISTIC),
    (["ps.read_every=4", "train.steps_per_execution=2"],
     "ps.read_every = 4 reads the variables once every 4 steps of a closure, and a closure "
     "runs train.steps_per_execution = 2: set train.steps_per_execution to 4 or more, or "
     "ps.read_every to 2 or less"),
])
def test_settings_the_cluster_cannot_honour_are_refused_before_anything_is_written(
        overrides, message, ps_strategy, ps_cluster, tmp_path):
    settings = config(*overrides)
    with pytest.raises(cfg.ConfigError) as e:
        trainer.run(settings, tmp_path, strategy=ps_strategy, cluster=ps_cluster,
                    task=tiny_task(settings))
    assert str(e.value) == message
    assert list(tmp_path.iterdir()) == []


# A deadline only a hung serve loop reaches, however loaded the machine.
HANG_S = 120


class Said(logging.Handler):
    """What `serving.serve` logs in one thread, which a test can wait for: the
    serve loop's own account of what it has seen, where a fixed sleep would guess."""

    def __init__(self, thread_name: str):
        super().__init__(logging.INFO)
        self.thread_name, self.lines = thread_name, []
        self.changed = threading.Condition()

    def emit(self, record: logging.LogRecord) -> None:
        if record.threadName == self.thread_name:
            with self.changed:
                self.lines.append(record.getMessage())
                self.changed.notify_all()

    def wait_for(self, start: str, timeout_s: float = HANG_S) -> None:
        """Return once a line starting with `start` has been logged (the deadline: a hang)."""
        with self.changed:
            assert self.changed.wait_for(
                lambda: any(line.startswith(start) for line in self.lines), timeout_s), self.lines


def serve_in_thread(job: str, wait_s: float, stopping=lambda: False, chief_up: bool = True,
                    finished=lambda: False) -> tuple[socket.socket, dict, threading.Event]:
    """A listening socket standing for the chief (closed already unless `chief_up`), and
    `serve` of task `job`:0 in a thread; (the chief, what serve raised as {"error": ...},
    the task's cluster and what it logged ("said": `Said`), set when it ends)."""
    chief = socket.socket()
    chief.bind(("localhost", 0))
    chief.listen()
    # Held for the test process's life, as its servers are (launch/ports.py).
    spec = {"chief": [f"localhost:{chief.getsockname()[1]}"],
            "ps": _PORTS.addresses("localhost", 1), "worker": _PORTS.addresses("localhost", 1)}
    if not chief_up:  # a chief that never connected: its port is free
        chief.close()
    task = clusters.parse(json.dumps({"cluster": spec, "task": {"type": job, "index": 0}}))
    said = Said(f"serve-{spec[job][0]}")
    logger = logging.getLogger(serving.__name__)
    logger.addHandler(said)
    logger.setLevel(logging.INFO)
    outcome, done = {"cluster": task, "said": said}, threading.Event()

    def run():
        try:
            serving.serve(task, cfg.RuntimeConfig(), wait_s=wait_s, poll_s=0.1,
                                   stopping=stopping, finished=finished)
        except clusters.TaskLost as e:
            outcome["error"] = e
        finally:
            logger.removeHandler(said)
        done.set()

    threading.Thread(target=run, name=said.thread_name, daemon=True).start()
    outcome["marker"] = markers.finished_marker(spec[job][0])
    return chief, outcome, done


@pytest.mark.parametrize("spinning", [True, False])
def test_a_tasks_server_gets_its_thread_pools_from_the_runtime_settings(spinning, monkeypatch):
    servers = []  # the keyword arguments of each tf.distribute.Server made
    monkeypatch.setattr(serving.tf.distribute, "Server", lambda *_, **kw: servers.append(kw))
    chief = socket.socket()  # bound and closed: a chief that has gone
    chief.bind(("localhost", 0))
    spec = {"chief": [f"localhost:{chief.getsockname()[1]}"], "worker": ["h:2", "h:3"],
            "ps": ["h:4"]}
    chief.close()
    task = clusters.parse(json.dumps({"cluster": spec, "task": {"type": "ps", "index": 0}}))
    serving.serve(task, cfg.RuntimeConfig(intra_op_threads=1, thread_spinning=spinning),
                  wait_s=60, poll_s=0.1, finished=lambda: True)
    [server] = servers
    config = server["config"]
    assert config.inter_op_parallelism_threads == 3  # workers + 1, unless given
    assert config.intra_op_parallelism_threads == 1
    assert config.experimental.disable_thread_spinning is not spinning


def test_a_task_serves_until_the_chief_has_finished_not_merely_left():
    chief, outcome, done = serve_in_thread("ps", wait_s=60)
    outcome["said"].wait_for("the chief is up")
    assert not done.is_set()  # the chief is up: keep serving
    chief.close()
    outcome["said"].wait_for("the chief left without finishing")
    assert not done.is_set()  # gone without finishing: it may come back, keep serving
    # What the chief's tell_finished writes through TF on this task's disk.
    with open(outcome["marker"], "w") as f:
        f.write("finished")
    assert done.wait(timeout=HANG_S) and "error" not in outcome
    assert not os.path.exists(outcome["marker"])  # not left for the next job on this port


def test_a_task_the_finished_chief_could_not_tell_finds_the_run_finished_in_its_workdir(
        tmp_path):
    # The chief wrote metrics.json, then its mark could not reach this task (a process
    # restarted on its port, which the chief's TensorFlow did not know).
    finished = tmp_path / "metrics.json"
    chief, outcome, done = serve_in_thread("worker", wait_s=60, finished=finished.exists)
    outcome["said"].wait_for("the chief is up")
    finished.write_text("{}")
    chief.close()
    assert done.wait(timeout=HANG_S) and "error" not in outcome
    outcome["said"].wait_for("the chief has gone and the run has finished")


def test_a_task_started_after_the_chief_finished_stops_with_the_run():
    # Relaunched as the chief finished: no chief ever seen, no mark, and the run finished.
    chief, outcome, done = serve_in_thread("worker", wait_s=60, chief_up=False,
                                           finished=lambda: True)
    assert done.wait(timeout=HANG_S) and "error" not in outcome


def test_a_task_whose_chief_does_not_come_back_exits_with_a_retried_code():
    chief, outcome, done = serve_in_thread("worker", wait_s=0.5)
    outcome["said"].wait_for("the chief is up")
    chief.close()
    assert done.wait(timeout=HANG_S)
    error = outcome["error"]
    assert error.exit_code == 203
    assert ("left without finishing and has not come back within cluster.connect_timeout_s "
            "= 0.5 s; worker:0 stops with exit code 203") in str(error)


def test_a_task_whose_chief_failed_before_connecting_stops_with_the_chiefs_code():
    chief, outcome, done = serve_in_thread("worker", wait_s=60, chief_up=False)
    cluster = dataclasses.replace(outcome["cluster"], task_type="chief")
    # No ps:0 serves here, so the chief would wait for it: in a thread of its own.
    threading.Thread(target=chief_failure.tell, daemon=True, args=(
        cluster, 2, "--workdir /runs/a already holds a finished run", 20)).start()
    assert done.wait(timeout=HANG_S)
    error = outcome["error"]
    assert error.exit_code == 2
    assert str(error).startswith(
        f"the chief ({cluster.jobs['chief'][0]}) failed with exit code 2: --workdir /runs/a "
        "already holds a finished run; worker:0 stops with the same code")


def test_a_task_whose_chief_failed_after_connecting_reads_it_in_the_marker():
    chief, outcome, done = serve_in_thread("ps", wait_s=60)
    outcome["said"].wait_for("the chief is up")
    chief.close()
    # What the chief's tell_failed writes through TF on this task's disk.
    with open(outcome["marker"] + ".tmp", "w") as f:  # whole, as TF's write is
        f.write(markers.FAILED + chief_failure.message(1, "ValueError: bad batch"))
    os.replace(outcome["marker"] + ".tmp", outcome["marker"])
    assert done.wait(timeout=HANG_S)
    assert outcome["error"].exit_code == 1
    assert "failed with exit code 1: ValueError: bad batch; ps:0 stops" in str(outcome["error"])


def test_sigterm_before_any_chief_came_speaks_of_no_backup():
    chief, outcome, done = serve_in_thread("ps", wait_s=60, stopping=lambda: True,
                                           chief_up=False)
    assert done.wait(timeout=HANG_S)
    assert str(outcome["error"]) == (
        "preempted (SIGTERM) before any chief had connected to ps:0; it stops (exit code 204): "
        "no training ran through it")


def test_the_example_task_trains_on_the_cluster(ps_strategy, ps_cluster, tmp_path):
    from app import task as tasks

    overrides = [f"task.data_dir={tmp_path / 'data'}", "task.files=4",
                 "task.examples_per_file=256", "task.test_examples=256", "train.epochs=2",
                 "train.verbose=0"]
    task, settings = tasks.create(cfg.load("examples/regression.toml", overrides))
    metrics = trainer.run(settings, tmp_path / "run", strategy=ps_strategy, cluster=ps_cluster,
                          task=task)
    assert (metrics["strategy"], metrics["metric"]) == ("ParameterServerStrategy", "test_mae")
    assert 0 < metrics["test_mae"] < 0.9
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["num_ps"] == 2


class LargeArrays(zoo.Zoo):
    """12.5 and 9.4 MiB of images passed as NumPy arrays: over the graph's limit."""

    def arrays(self, split):
        n = 3200 if split == "train" else 2400
        labels = np.random.default_rng(len(split)).integers(0, 2, n)
        images = np.zeros((n, 32, 32, 1), np.float32)
        images[labels == 1, :16] = 1.0
        return images, labels.astype(np.int64)

    def train_examples(self):
        return 3200

    def eval_examples(self, split):
        return 2400

    def build_model(self):
        x = keras.Input((32, 32, 1))
        return keras.Model(x, keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(x)))


def test_arrays_over_the_graph_limit_train_through_files_in_the_workdir(
        ps_strategy, ps_cluster, tmp_path):
    config = cfg.load(None, ["train.epochs=1", "train.global_batch_size=64", "train.verbose=0",
                             "train.learning_rate=0.05"])
    metrics = trainer.run(config, tmp_path, strategy=ps_strategy, cluster=ps_cluster,
                          task=LargeArrays())
    # One file per array (train images and labels, test images and labels), read by
    # the workers; every test example evaluated once, and learned.
    assert len(list((tmp_path / "arrays").glob("*.rows.tfrecord"))) == 4
    assert metrics["num_test_examples"] == 2400 and metrics["test_accuracy"] > 0.9


class _Float16Layer(LargeArrays):
    """A model with a layer of the task's own in the mixed_float16 policy."""

    def build_model(self):
        x = keras.Input((32, 32, 1))
        pooled = keras.layers.GlobalAveragePooling2D(dtype="mixed_float16")(x)
        return keras.Model(x, keras.layers.Dense(2)(pooled))


def test_a_mixed_float16_layer_of_the_tasks_own_is_refused_by_name(ps_strategy, ps_cluster):
    runner = runners.create(cfg.Config(), ps_cluster, ps_strategy)
    with pytest.raises(cfg.ConfigError) as e:
        runner.build(_Float16Layer(), lambda dialect: keras.optimizers.SGD())
    assert str(e.value) == (
        "the mixed_float16 policy (train.precision, or a layer's dtype) needs loss scaling, "
        "which Keras does not support under ParameterServerStrategy; use train.precision = "
        "mixed_bfloat16 (no loss scaling) or float32, or a Mirrored or MultiWorkerMirrored "
        "strategy")
