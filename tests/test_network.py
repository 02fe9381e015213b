"""launch.network: links and partitions of a local cluster.

The parsing and the tc command lines are checked anywhere; the tests marked
by the `namespace` fixture make a network namespace of their own (root,
iproute2 and util-linux's unshare) and move bytes through real links there.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types

import pytest

from launch import local, network

PORTS = {"chief:0": 1111, "worker:0": 2222}


@pytest.mark.parametrize("text, rate_bits, delay_s", [
    ("1gbit", 10**9, 0.0), ("100mbit,0.5ms", 10**8, 0.0005), ("10Gbit, 100us", 10**10, 1e-4),
    ("2.5gbit,2ms", 25 * 10**8, 0.002), ("64kbit,1s", 64000, 1.0)])
def test_links_read_rates_and_delays_as_tc_counts_them(text, rate_bits, delay_s):
    link = network.parse_link(text)
    assert link.rate_bits == rate_bits and link.delay_s == pytest.approx(delay_s)


@pytest.mark.parametrize("text, message", [
    ("1gb", "--link '1gb': cannot read '1gb'; write a rate such as 100mbit"),
    ("fast", "cannot read 'fast'; write a rate such as"),
    ("1gbit,1", "cannot read '1'; write RATE,DELAY with a delay such as 0.1ms"),
    ("1gbit,1min", "cannot read '1min'"),
    ("100bit", "a rate of 100 bit/s is too slow for a cluster to start; give at least 1kbit"),
])
def test_a_link_that_cannot_be_read_says_what_to_write(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        network.parse_link(text)


def test_partitions_name_a_task_a_time_and_maybe_a_duration():
    tasks = ["chief:0", "worker:0", "worker:1", "ps:0"]
    assert network.parse_partition("worker:1@40+30", tasks) == network.Partition(
        "worker:1", 40.0, 30.0)
    assert network.parse_partition("ps:0@2.5", tasks) == network.Partition("ps:0", 2.5, None)
    assert network.parse_partition("worker:1@step50+15", tasks) == network.Partition(
        "worker:1", None, 15.0, at_step=50)
    with pytest.raises(ValueError, match=re.escape(
            "--partition 'worker:1@step2.5': write TASK@SECONDS[+DURATION]")):
        network.parse_partition("worker:1@step2.5", tasks)
    with pytest.raises(ValueError, match=re.escape(
            "--partition 'worker:2@40': this cluster has no task worker:2; its tasks are "
            "chief:0, worker:0, worker:1, ps:0")):
        network.parse_partition("worker:2@40", tasks)
    with pytest.raises(ValueError, match=re.escape(
            "--partition 'worker:1 40': write TASK@SECONDS[+DURATION], e.g. worker:1@40+30")):
        network.parse_partition("worker:1 40", tasks)


def test_a_step_partition_cuts_when_the_lead_logs_its_step_and_reconnects_after_its_duration(
        monkeypatch):
    cuts, reconnected = [], threading.Event()

    def set_cut(task, cut):
        cuts.append((task, cut))
        if not cut:
            reconnected.set()

    # No tc: this `lo` is the machine's. The cuts are recorded instead.
    monkeypatch.setattr(network, "run", lambda commands: None)
    monkeypatch.setattr(network, "subprocess", types.SimpleNamespace(run=lambda *a, **k: None))
    links = network.Links(network.Link(10**9), {"chief:0": 1, "worker:1": 2}, print)
    monkeypatch.setattr(links, "set_cut", set_cut)
    links.schedule([network.Partition("worker:1", None, 0.01, at_step=20)],
                   serving=["chief:0", "worker:1"], lead="chief:0")
    links.heard("[worker:1] INFO step 30")  # not the lead
    links.heard("[chief:0] INFO step 10")  # not yet
    assert cuts == []
    links.heard("[chief:0] INFO step 20")
    links.heard("[chief:0] INFO step 21")  # once only
    assert reconnected.wait(60) and cuts == [("worker:1", True), ("worker:1", False)]


def test_task_ports_come_from_the_cluster_spec():
    spec = {"worker": ["127.0.0.1:2222", "127.0.0.1:3333"], "chief": ["127.0.0.1:1111"]}
    assert network.task_ports(spec) == {"chief:0": 1111, "worker:0": 2222, "worker:1": 3333}


def test_every_task_port_gets_a_class_and_a_filter_each_way():
    commands = [" ".join(c) for c in network.shaping_commands(PORTS, network.parse_link("1gbit"))]
    assert commands[0] == "tc qdisc add dev lo root handle 1: htb"
    assert "tc qdisc add dev lo parent 1:2 handle 2: pfifo limit 0" in commands  # the blackhole
    rate = "rate 1000000000bit ceil 1000000000bit"
    # worker:0 is the second task: its classes are 1:12 (into its port) and 1:13 (out of it).
    assert f"tc class add dev lo parent 1: classid 1:12 htb {rate} quantum 65536" in commands
    assert f"tc class add dev lo parent 1: classid 1:13 htb {rate} quantum 65536" in commands
    filters = [c for c in commands if " filter " in c]
    assert ("tc filter add dev lo parent 1: protocol ip prio 1000 u32 "
            "match ip dport 2222 0xffff flowid 1:12") in filters
    assert ("tc filter add dev lo parent 1: protocol ip prio 1000 u32 "
            "match ip sport 2222 0xffff flowid 1:13") in filters
    assert len(filters) == 4 and not any("netem" in c for c in commands)


def test_a_delay_is_a_netem_qdisc_under_every_class():
    commands = [" ".join(c)
                for c in network.shaping_commands(PORTS, network.parse_link("10gbit,0.1ms"))]
    netem = [c for c in commands if "netem" in c]
    assert netem == [f"tc qdisc add dev lo parent 1:{m} handle {m}: netem delay 100us"
                     for m in ("10", "11", "12", "13")]


def test_a_partition_sends_a_tasks_packets_to_the_blackhole_ahead_of_its_link():
    cut = [" ".join(c) for c in network.partition_commands(PORTS, "worker:0", cut=True)]
    assert cut == [f"tc filter add dev lo parent 1: protocol ip prio 11 u32 match ip {field} "
                   "2222 0xffff flowid 1:2" for field in ("dport", "sport")]
    back = network.partition_commands(PORTS, "worker:0", cut=False)
    assert [" ".join(c) for c in back] == ["tc filter del dev lo parent 1: protocol ip prio 11"]


def test_counters_are_read_from_tc_class_show():
    shown = ("class htb 1:11 root prio 0 rate 100Mbit ceil 100Mbit burst 1600b cburst 1600b \n"
             " Sent 1592 bytes 25 pkt (dropped 0, overlimits 0 requeues 0) \n"
             " backlog 0b 0p requeues 0\n\n"
             "class htb 1:10 root leaf 10: prio 0 rate 100Mbit ceil 100Mbit burst 1600b \n"
             " Sent 1050366 bytes 99 pkt (dropped 2, overlimits 13 requeues 0) \n")
    assert network.class_counters(shown) == {"1:11": (1592, 0, 0), "1:10": (1050366, 2, 13)}
    assert network.link_bytes({"chief:0": 1}, shown) == {"chief:0": (1050366, 1592)}


def test_without_iproute2_links_are_refused_with_the_package_to_install(monkeypatch, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")
    problem = network.preflight()
    assert problem.startswith("--link needs `ip` and `tc` from iproute2, not found on PATH")
    assert "apt-get install iproute2" in problem
    assert local.main(["--workers", "1", "--link", "1gbit"]) == 2
    assert "error: --link needs `ip` and `tc` from iproute2" in capsys.readouterr().err


def test_without_unshare_root_or_namespaces_links_are_refused(monkeypatch):
    monkeypatch.setattr(network.shutil, "which",
                        lambda tool: None if tool == "unshare" else f"/usr/sbin/{tool}")
    assert "needs `unshare` from util-linux" in network.preflight()
    monkeypatch.setattr(network.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
    monkeypatch.setattr(network.os, "geteuid", lambda: 1000)
    assert "needs root to make a network namespace" in network.preflight()
    monkeypatch.setattr(network.os, "geteuid", lambda: 0)
    monkeypatch.setattr(network, "probe_namespace",
                        lambda: "unshare: unshare failed: Operation not permitted")
    assert network.preflight() == (
        "--link: network namespaces are not permitted here (unshare: unshare failed: Operation "
        "not permitted); in a container, start it with --privileged or --cap-add SYS_ADMIN "
        "--cap-add NET_ADMIN")


@pytest.mark.parametrize("argv, message", [
    (["--partition", "worker:1@40"], "--partition needs --link"),
    (["--link", "1gb"], "--link '1gb': cannot read '1gb'"),
    (["--link", "1gbit", "--partition", "worker:2@5"], "this cluster has no task worker:2"),
])
def test_the_launcher_refuses_bad_network_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        local.main(["--workers", "2", "--ps", "1", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.fixture
def namespace():
    """Skip unless this machine lets a test make a network namespace and shape it."""
    problem = network.preflight()
    if problem:
        pytest.skip(problem)


def in_namespace(check: str) -> dict:
    """Run tests/netns.py's `check` in a network namespace of its own; its result."""
    result = subprocess.run(
        ["unshare", "--net", sys.executable, "-m", "tests.netns", check],
        env={**os.environ, network.NETNS_ENV: network.netns_id()},
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def test_sigterm_to_the_outer_launcher_reaches_the_one_in_the_namespace(namespace, tmp_path):
    # With --link the launcher re-runs itself in a namespace (run_in_namespace), and a
    # scheduler's SIGTERM reaches only the outer one: it must pass it on.
    ready = tmp_path / "ready"
    inner = ("import pathlib, signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
             f"pathlib.Path({str(ready)!r}).touch()\n"
             "time.sleep(60)\n")

    def terminate_when_ready():
        while not ready.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_when_ready, daemon=True).start()
    assert network.run_in_namespace(["-c", inner]) == 7


def test_a_task_ports_bytes_go_through_its_own_class_each_way(namespace):
    found = in_namespace("shaping")
    assert found["got"] == 2 << 20
    into_worker, out_of_worker = found["links"]["worker:0"]
    into_ps, out_of_ps = found["links"]["ps:0"]
    # 1 MiB was sent to worker:0's port, 2 MiB came out of ps:0's; the other
    # directions carried only TCP's acknowledgements. The counts hold the packets'
    # headers, and any retransmissions (a fresh-clone `make test` counted 1.107 MiB into
    # worker:0): bounded by what another class's flow would add, not by TCP's overhead.
    assert 1 << 20 <= into_worker < 2 << 20 and out_of_worker < 1 << 19
    assert 2 << 20 <= out_of_ps < 3 << 20 and into_ps < 1 << 19
    # Both classes had packets wait for their rate: the link limited them.
    overlimits = {classid: c[2] for classid, c in found["classes"].items()}
    assert overlimits["1:10"] > 0 and overlimits["1:13"] > 0


def test_a_cut_port_drops_its_packets_and_a_restored_one_carries_them(namespace):
    found = in_namespace("partition")
    assert found["while_cut"] == "TimeoutError"
    assert found["dropped_while_cut"] > 0  # the connection attempts, in the blackhole
    assert found["got_after"] == 1000


def test_a_delay_is_netem_or_a_refusal_that_says_how_to_get_it(namespace):
    found = in_namespace("delay")
    if "error" in found:  # a kernel without sch_netem, as some VMs have
        assert "this kernel has no netem qdisc" in found["error"]
        assert "modprobe sch_netem" in found["error"]
    else:
        assert found["netem_qdiscs"] == 2 * len({"worker:0", "ps:0"})


@pytest.mark.slow
def test_a_partitioned_worker_comes_back_and_training_completes(tmp_path, namespace):
    workdir = tmp_path / "run"
    args = [sys.executable, "-u", "-m", "launch.local", "--workers", "2", "--ps", "1",
            # At the chief's step 20 of 62: inside epoch 1, past the chief's start, when
            # it registers its functions on every worker (a worker cut off during that
            # stays without them: TF's coordinator recovers restarted workers, not
            # ones that missed a registration). Counted in steps, not seconds: a loaded
            # machine starts later, never at another step.
            "--link", "1gbit", "--partition", "worker:1@step20+15", "--max-restarts", "1",
            "--set", "task.train_examples=2000", "--set", "task.validation_examples=0",
            "--set", "task.test_examples=300", "--set", "train.epochs=2",
            "--set", "debug.log_every_steps=10",
            "--set", "train.verbose=2", "--workdir", str(workdir)]
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    metrics = json.loads((workdir / "metrics.json").read_text())
    assert metrics["epochs_completed"] == 2 and metrics["steps"] >= 2 * (2000 // 32)
    # What worker 1's link had carried out (the gradients the ps fetched from it,
    # 12.5 MiB a step) when it was cut: it trained before.
    at_cut = float(re.search(r"\[launch\] partitioned worker:1; .* out ([\d.]+) MiB",
                             output)[1])
    assert at_cut >= 12.4, output[-3000:]
    # Whether TensorFlow counts the cut as the worker's failure (and puts its
    # closure back in the queue) depends on where its connection to the chief was
    # when the cut fell: measured, 9 to 15 s into a cut, or at the reconnection, or
    # never (the worker's step resumed when its link came back). And once in eight
    # runs here (a slow one, under coverage) the cut worker's failed reads of ps:0
    # looked to the coordinator like the ps's failure, which it does not recover
    # from: the chief stops as for a lost task (exit 203, not the coordinator's
    # CancelledError's 1), and the job is relaunched (--max-restarts), without the
    # cut, and resumes from its backup. Completing with every step is what this
    # run must do either way.
    if "[launch] restart 1 of 1" in output:
        assert "[launch] chief:0 exited with 203 (a task was lost); stopping" in output, \
            output[-3000:]
        return
    # Cut for the whole 15 s: not one step's gradients passed (uncut, it sends
    # hundreds in 15 s).
    at_return = float(re.search(r"\[launch\] reconnected worker:1; .* out ([\d.]+) MiB",
                                output)[1])
    assert at_return - at_cut < 12.4, output[-3000:]
    assert output.index("reconnected worker:1") < output.index("test_accuracy="), output[-3000:]
    # Every step read the CNN's 12.5 MiB of trainable variables out of ps:0's port.
    out_of_ps = re.search(r"ps:0 in [\d.]+ MiB out ([\d.]+) MiB", output)
    assert out_of_ps and float(out_of_ps[1]) >= metrics["steps"] * 12.4, output[-3000:]
