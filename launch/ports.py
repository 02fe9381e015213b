"""Ports for the servers a launcher starts, held from the moment they are picked.

A port picked free and let go (portpicker's way: bind to port 0, close) is the
kernel's again until its server binds it, seconds later once TensorFlow has
started. The kernel picks such ports from its ephemeral range, the same range
it gives every outgoing connection a local port from: a task's probes of its
peers, a gRPC channel, another test's cluster. One of them can take the port
in between, and the task's server then fails with "Could not start gRPC
server".

So `Ports.take` picks a port by binding a socket to port 0 and keeps that
socket bound, with SO_REUSEADDR, never listening, until `release`:

- the kernel gives a port that a socket is bound to neither to an outgoing
  connection nor to anyone else's bind to port 0;
- the task's own server may still bind and listen on it: gRPC binds with
  SO_REUSEADDR too, and Linux lets a socket listen beside bound ones that do
  not listen when both set it. TensorFlow's server turns SO_REUSEPORT off
  (grpc_server_lib.cc, NoReusePortOption), so a held socket with SO_REUSEPORT
  alone would keep it out;
- connections go to the listening socket only: the held one never listens.

A launcher holds its tasks' ports until it exits, so a task relaunched on its
port (`--restart task`) finds it still reserved. tests/test_ports.py checks each
point, with a TensorFlow server.
"""

from __future__ import annotations

import socket


class Ports:
    """Ports picked for servers to come, each held bound until `release` (or the
    end of a `with` block)."""

    def __init__(self) -> None:
        self._held: list[socket.socket] = []

    def take(self) -> int:
        """A port no one else has or will be given, held until `release`."""
        # On every interface, as TensorFlow's servers listen: IPv6 and IPv4 at once
        # where the host has both, so that neither family can hand the port out.
        dual = socket.has_dualstack_ipv6()
        held = socket.socket(socket.AF_INET6 if dual else socket.AF_INET, socket.SOCK_STREAM)
        try:
            if dual:
                held.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            held.bind(("", 0))
        except OSError:
            held.close()
            raise
        self._held.append(held)
        return held.getsockname()[1]

    def addresses(self, host: str, n: int) -> list[str]:
        """`n` addresses `host:port`, each on a port taken here."""
        return [f"{host}:{self.take()}" for _ in range(n)]

    def release(self) -> None:
        """Let every port go (a server that listens on one keeps it)."""
        for held in self._held:
            held.close()
        self._held.clear()

    def __enter__(self) -> Ports:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
