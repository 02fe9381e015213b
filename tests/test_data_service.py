"""The tf.data service (app/distribute/data_service.py): what it refuses, training through it in
one process and under Mirrored, and, end to end with launch.local, what one epoch
of a parameter-server run sees when a trainer or a tf.data worker is SIGKILLed.
The examples are numbered (tests/numbered.py): metrics.json counts their visits."""

import json
import socket
import threading
import time

import pytest
import tensorflow as tf

from app import config as cfg
from app import strategy, trainer
from app.cluster import chief_failure
from app.distribute import data_service
from launch.ports import Ports
from tests import launching
from tests.conftest import one_device_reduction_mirrored
from tests.numbered import Numbered, Params, PythonNumbered

service = tf.data.experimental.service


@pytest.fixture
def dispatcher():
    """A dispatcher and two tf.data workers in this process; the dispatcher's host:port.

    One per test: stopped right after the test that read from it, a tf.data worker
    stops at once; kept to the module's end, past the launch.local test, one took
    43 s to stop (dropped without `_stop`, too).
    """
    servers = [data_service.serve_dispatcher(0, None)]
    address = servers[0].target.removeprefix("grpc://")
    servers += [data_service.serve_worker(address, 0, "localhost") for _ in range(2)]
    yield address
    for server in reversed(servers):
        server._stop()  # no public stop; the process would otherwise keep them


def test_a_dataset_that_calls_python_is_named_with_what_to_use_instead():
    with pytest.raises(cfg.ConfigError, match=r"task t calls Python through EagerPyFunc "
                                              r"\(tf.py_function\).*set data.service = \"\""):
        data_service.check_runnable(PythonNumbered()._examples(4), "t")
    generated = tf.data.Dataset.from_generator(lambda: iter([1]), output_types=tf.int64)
    with pytest.raises(cfg.ConfigError, match=r"PyFunc \(tf.numpy_function or "
                                              r"Dataset.from_generator\)"):
        data_service.check_runnable(generated, "t")
    data_service.check_runnable(Numbered()._examples(4), "t")  # TensorFlow ops only


@pytest.mark.parametrize("address", ["localhost", "host:port", ":5050", "localhost:99999"])
def test_the_config_refuses_an_address_that_is_not_host_port(address):
    with pytest.raises(cfg.ConfigError, match=rf"data.service = '{address}' is not a "
                                              "dispatcher's host:port"):
        cfg.load(overrides=[f"data.service={address}"])


def test_an_unreachable_dispatcher_is_named_within_the_timeout():
    with Ports() as ports:  # held: no server can take it meanwhile
        address = ports.addresses("localhost", 1)[0]
        start = time.monotonic()
        with pytest.raises(cfg.ConfigError, match=rf"no tf.data service dispatcher answers at "
                                                  rf"data.service = {address} within "
                                                  r"cluster.connect_timeout_s = 1 s"):
            data_service.wait_for_dispatcher(f"grpc://{address}", 1, poll_s=0.2)
    assert time.monotonic() - start < 60  # it did not wait for ever


@pytest.mark.parametrize("kind", ["default", "mirrored"])
def test_training_reads_every_example_once_through_the_service(tmp_path, dispatcher, kind,
                                                                caplog):
    caplog.set_level("INFO", logger="app.distribute.data_service")
    examples, batch = 512, 16
    config = cfg.load(overrides=[
        "task.name=tests.numbered:Numbered", "train.epochs=2", "train.verbose=0",
        f"train.global_batch_size={batch}", f"data.service={dispatcher}",
        "eval.test_every_epoch=false"])
    chosen = strategy.create("default") if kind == "default" else one_device_reduction_mirrored()
    metrics = trainer.run(config, tmp_path / kind, strategy=chosen,
                          task=Numbered(Params(examples=examples)))
    # Two epochs of one pass each: the first epoch's examples once each (the
    # epochs are one stream: the second reads the numbers after them), none lost.
    assert f"training input from the tf.data service at {dispatcher}" in caplog.text
    assert metrics["steps"] == 2 * examples // batch
    assert metrics["visits_1"] == examples and metrics["visits_later"] == examples, metrics


# -- end to end: SIGKILLs mid-epoch under launch.local --restart task -------------------

EXAMPLES, BATCH = 16384, 16  # 1024 steps: a restarted task is back before the end


@pytest.mark.slow
def test_killed_tasks_lose_only_their_batches_in_flight_and_repeat_none(tmp_path):
    """One epoch of a chief, 2 workers and a ps through a service of 2 tf.data
    workers; a trainer SIGKILLed at step 200, a tf.data worker at step 500, each
    relaunched alone."""
    launcher = launching.launch(
        "--workers", "2", "--ps", "1", "--restart", "task", "--data-workers", "2",
        "--workdir", str(tmp_path / "run"), "--set", "task.name=tests.numbered:Numbered",
        "--set", f"task.examples={EXAMPLES}", "--set", "train.epochs=1",
        "--set", f"train.global_batch_size={BATCH}", "--set", "train.verbose=0",
        "--set", "debug.log_every_steps=50", *launching.hold(500, tmp_path / "release"))
    output, killed = launching.signal_at_steps(launcher, "chief:0",
                                               {200: "worker:1", 500: "data_worker:0"},
                                               release=tmp_path / "release")
    launcher.wait(timeout=60)
    assert killed == 2 and launcher.returncode == 0, output[-4000:]
    for victim in ("worker:1", "data_worker:0"):
        assert f"[launch] restart 1 of 3: {victim} alone" in output
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["visits_2plus"] == 0, metrics
    assert metrics["visits_0"] <= 0.02 * EXAMPLES, metrics  # what the victims held
    assert metrics["visits_1"] + metrics["visits_0"] == EXAMPLES


def test_a_watching_service_task_stops_when_the_lead_is_gone_or_failed():
    stop = threading.Event()
    with Ports() as ports:  # held: no server can take it meanwhile
        nobody = ports.addresses("localhost", 1)[0]
        assert data_service.watch(nobody, "dispatcher", stop, gone_s=0.5, poll_s=0.1) == 0
    with socket.create_server(("localhost", 0)) as chief:  # a chief that failed, exit 2
        def tell():
            connection, _ = chief.accept()
            with connection:
                connection.sendall(f"{chief_failure.MAGIC} 2 error: a finished run\n".encode())
                connection.recv(100)
        threading.Thread(target=tell, daemon=True).start()
        address = f"localhost:{chief.getsockname()[1]}"
        assert data_service.watch(address, "dispatcher", stop, gone_s=30, poll_s=0.1) == 2
