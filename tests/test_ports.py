"""launch/ports.py: a port is held from its pick, so that nothing else takes it before
its task's TensorFlow server binds it; that server binds it and gets its connections."""

import json
import os
import socket
import subprocess
import sys

import pytest

from launch import network
from launch.ports import Ports

# A TensorFlow server on the port given, "serving" once it listens (or TF's error);
# it serves until its stdin closes.
SERVER = """
import sys
import tensorflow as tf
try:
    tf.distribute.Server(tf.train.ClusterSpec({"worker": [f"localhost:{sys.argv[1]}"]}),
                         job_name="worker", task_index=0, start=True)
except tf.errors.OpError as e:
    print(e.message, flush=True)
    sys.exit(1)
print("serving", flush=True)
sys.stdin.read()
"""
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def plain_bind(port: int) -> socket.socket:
    """A socket bound to `port` on every interface, as any other program would bind it."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("", port))
    except OSError:
        s.close()
        raise
    return s


def test_a_held_port_is_refused_to_others_until_released():
    with Ports() as ports:
        taken = [ports.take() for _ in range(3)]
        assert len(set(taken)) == 3
        for port in taken:
            with pytest.raises(OSError, match="Address already in use"):
                plain_bind(port)
    plain_bind(taken[0]).close()  # released


def answers_grpc(port: int) -> bool:
    """Whether a new connection to `port` is answered by a gRPC server: its SETTINGS
    frame after the client's HTTP/2 preface (a connection queued on a socket that
    nobody accepts from would time out instead)."""
    with socket.create_connection(("localhost", port), timeout=30) as s:
        s.sendall(HTTP2_PREFACE)
        frame = s.recv(9)
        return len(frame) == 9 and frame[3] == 4  # the frame type: SETTINGS


def test_a_tensorflow_server_binds_a_held_port_and_gets_every_connection():
    with Ports() as ports:
        port = ports.take()
        server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
        try:
            said = server.stdout.readline().strip()
            assert said == "serving", said
            # The held socket does not listen, so no connection can be queued on it.
            assert all(answers_grpc(port) for _ in range(100))
        finally:
            server.stdin.close()
            server.wait(timeout=60)


def test_no_outgoing_connection_gets_a_held_port():
    # In a network namespace whose ephemeral range is 4 ports: the held port is one
    # of them, and connections take the other 3, then fail, rather than take it. A
    # port picked and let go (portpicker's way) was taken there by the 4th, and the
    # TensorFlow server then failed with "Could not start gRPC server".
    problem = network.preflight()
    if problem:
        pytest.skip(problem)
    result = subprocess.run(
        ["unshare", "--net", sys.executable, "-m", "tests.netns", "held_port"],
        env={**os.environ, network.NETNS_ENV: network.netns_id(), "TF_CPP_MIN_LOG_LEVEL": "3"},
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    assert 40000 <= found["port"] <= 40003, found
    assert sorted(found["connections"][:3]) == sorted({40000, 40001, 40002, 40003}
                                                      - {found["port"]}), found
    assert found["connections"][3] == "OSError", found
    assert found["server"] == "serving", found
