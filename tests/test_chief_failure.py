"""A chief that failed for good tells its ps and worker tasks over plain TCP on its
own port (app/cluster/chief_failure.py): no TensorFlow, no cluster, a second or two."""

import json
import socket
import threading
import time

import pytest

from app.cluster import chief_failure
from app.cluster import tf_config as clusters
from launch.ports import Ports

REFUSAL = ("--workdir /runs/a already holds a finished run (metrics.json); choose a new "
           "--workdir\nsecond line")


@pytest.fixture
def ports():
    """Ports held as launch.local holds its tasks' (launch/ports.py): the failed chief
    listens on its port beside the launcher's held socket."""
    with Ports() as held:
        yield held


def ps_cluster(ports: Ports, task: str = "chief") -> clusters.Cluster:
    spec = {job: ports.addresses("localhost", 1) for job in ("chief", "ps", "worker")}
    return clusters.parse(json.dumps({"cluster": spec, "task": {"type": task, "index": 0}}))


def test_every_task_hears_the_chiefs_exit_code_and_error_and_the_chief_then_leaves(ports):
    cluster = ps_cluster(ports)
    chief = cluster.jobs["chief"][0]
    telling = threading.Thread(target=chief_failure.tell, args=(cluster, 2, REFUSAL, 30))
    telling.start()
    heard = {}
    while len(heard) < 2:
        for label in {"ps:0", "worker:0"} - set(heard):
            up, said = chief_failure.ask(chief, label)
            if said is not None:
                heard[label] = said
        time.sleep(0.1)
    telling.join(timeout=25)
    assert not telling.is_alive()  # all told: it left before its 30 s were up
    error = chief_failure.failed(chief, heard["ps:0"], "ps:0")
    assert error.exit_code == 2
    assert str(error) == (
        f"the chief ({chief}) failed with exit code 2: --workdir /runs/a already holds a "
        "finished run (metrics.json); choose a new --workdir; ps:0 stops with the same code "
        "(a restart would fail the same way: do what the chief's error says, then start the "
        "job again)")
    assert chief_failure.ask(chief, "ps:0") == (False, None)  # gone


def test_a_failure_a_restart_can_mend_or_a_cluster_without_ps_tells_no_one(ports):
    cluster = ps_cluster(ports)
    chief_failure.tell(cluster, 203, "a task was lost", wait_s=30)  # returns at once
    chief_failure.tell(ps_cluster(ports, "worker"), 2, REFUSAL, wait_s=30)
    assert not chief_failure.applies(clusters.parse(json.dumps(
        {"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 0}})))
    assert chief_failure.ask(cluster.jobs["chief"][0], "ps:0") == (False, None)


def test_a_chief_that_says_nothing_is_up_and_has_not_failed():
    with socket.create_server(("localhost", 0)) as silent:
        address = f"localhost:{silent.getsockname()[1]}"
        assert chief_failure.ask(address, "ps:0", timeout_s=0.2) == (True, None)
