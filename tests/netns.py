"""Run inside a network namespace by tests/test_network.py and tests/test_ports.py
(`unshare --net python -m tests.netns CHECK`): sets up launch.network's links on
this namespace's loopback, moves bytes through them with a socket server and
client on 127.0.0.1, and prints what tc counted as one JSON line; or, for
launch/ports.py, what outgoing connections did to a held port."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

from launch import network
from launch.ports import Ports

PORTS = {"worker:0": 40001, "ps:0": 40002}


def serve(port: int, send: int, timeout_s: float) -> tuple[socket.socket, threading.Thread]:
    """A server on `port` that reads what one client sends, then sends it `send`
    bytes; it gives up waiting for the client after `timeout_s`."""
    server = socket.create_server((network.HOST, port))
    server.settimeout(timeout_s)  # else a cut-off port leaves it in accept(), bound

    def answer():
        try:
            connection, _ = server.accept()
        except TimeoutError:
            return
        with connection:
            while connection.recv(1 << 16):
                pass
            connection.sendall(b"s" * send)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return server, thread


def exchange(port: int, upload: int, download: int, timeout_s: float = 30) -> int:
    """Send `upload` bytes to a fresh server on `port`, get `download` back; bytes got."""
    server, thread = serve(port, download, timeout_s)
    try:
        with socket.create_connection((network.HOST, port), timeout=timeout_s) as client:
            client.sendall(b"c" * upload)
            client.shutdown(socket.SHUT_WR)
            got = 0
            while chunk := client.recv(1 << 16):
                got += len(chunk)
        return got
    finally:
        thread.join(timeout_s)
        server.close()


def counters() -> dict[str, list[int]]:
    shown = subprocess.run(["tc", "-s", "class", "show", "dev", "lo"], capture_output=True,
                           text=True, check=True).stdout
    return {classid: list(c) for classid, c in network.class_counters(shown).items()}


def shaping() -> dict:
    """1 MiB into worker:0's port, 2 MiB out of ps:0's, over 100 Mbit/s links."""
    links = network.Links(network.parse_link("100mbit"), PORTS, print)
    got = exchange(PORTS["worker:0"], upload=1 << 20, download=0)
    got += exchange(PORTS["ps:0"], upload=0, download=2 << 20)
    shown = subprocess.run(["tc", "-s", "class", "show", "dev", "lo"], capture_output=True,
                           text=True, check=True).stdout
    return {"got": got, "links": network.link_bytes(links.ports, shown), "classes": counters()}


def partition() -> dict:
    """Cut ps:0 off: a connection to its port times out; back on: bytes go through."""
    links = network.Links(network.parse_link("1gbit"), PORTS, print)
    links.set_cut("ps:0", True)
    try:
        exchange(PORTS["ps:0"], upload=1000, download=1000, timeout_s=2)
        cut = "connected"
    except OSError as e:  # TimeoutError: the SYN never arrives
        cut = type(e).__name__
    dropped = counters()[network.BLACKHOLE][1]
    links.set_cut("ps:0", False)
    return {"while_cut": cut, "dropped_while_cut": dropped,
            "got_after": exchange(PORTS["ps:0"], upload=1000, download=1000, timeout_s=60)}


def delay() -> dict:
    """Links with a delay: netem under every class, or the error that says it is missing."""
    try:
        network.Links(network.parse_link("1gbit,1ms"), PORTS, print)
    except network.NetworkError as e:
        return {"error": str(e)}
    shown = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True,
                           text=True, check=True).stdout
    return {"netem_qdiscs": shown.count("netem")}


def held_port() -> dict:
    """launch/ports.py against every outgoing connection: this namespace's ephemeral
    range cut to 4 ports, a port taken with `Ports`, connections opened until the
    range is spent (their local ports), then a TensorFlow server on the port."""
    with open("/proc/sys/net/ipv4/ip_local_port_range", "w") as f:
        f.write("40000 40003")
    listener = socket.create_server((network.HOST, 30000))  # outside that range
    connections, local = [], []
    with Ports() as ports:
        port = ports.take()
        for _ in range(4):
            try:
                connections.append(socket.create_connection((network.HOST, 30000), timeout=5))
            except OSError as e:  # EADDRNOTAVAIL: no ephemeral port left
                local.append(type(e).__name__)
                continue
            local.append(connections[-1].getsockname()[1])
        import tensorflow as tf

        try:
            tf.distribute.Server(tf.train.ClusterSpec({"worker": [f"localhost:{port}"]}),
                                 job_name="worker", task_index=0, start=True)
            server = "serving"
        except tf.errors.OpError as e:
            server = e.message
    for c in [*connections, listener]:
        c.close()
    return {"port": port, "connections": local, "server": server}


if __name__ == "__main__":
    network.setup_loopback()
    print(json.dumps({"shaping": shaping, "partition": partition, "delay": delay,
                      "held_port": held_port}[sys.argv[1]]()))
