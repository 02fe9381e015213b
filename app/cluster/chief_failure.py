"""A chief that fails for good tells its ps and worker tasks, so that the job ends.

The ps and worker tasks of a parameter-server cluster serve until the chief
tells them it has finished (`markers.tell_finished`), and wait for a
chief that merely went away (a restarted one needs them). A chief that stops
before training, or fails in a way a restart cannot mend (exit 1: an error
the code did not anticipate; 2: a configuration or storage error), would
leave them waiting: under SLURM, whose step ends only when every task has,
until the job's time limit. So such a chief tells each of them, with its exit
code and its error line, and they stop with the same code (`ChiefFailed`):
permanent under Kubeflow's `restartPolicy: ExitCode` (1..127), not retried by
`launch.local` (2), and the step's exit code under SLURM.

Two ways, whichever the chief can use:

- before it has connected to the cluster (a finished `--workdir`, a config
  error, tasks that did not answer in time), its port is free: it listens
  there, plain TCP, and answers each task that connects with one line,
  `MAGIC code reason`; the task answers with its label. The chief stays until
  every ps and worker task has been told, or `cluster.connect_timeout_s`.
  A task probes the chief's address each second anyway (`ask`), so this needs
  no shared storage and no TensorFlow on the chief's side.
- once connected, its port is its TensorFlow server's: it writes the failure
  to each task's marker file through TensorFlow instead, as `tell_finished`
  writes "finished" (`markers.tell_failed`).

No TensorFlow is imported here: a chief whose config does not load has none.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import time

from app.cluster.tf_config import Cluster, TaskLost, connect

log = logging.getLogger(__name__)

MAGIC = "tf-chief-failed"
# Failures no launcher's restart would mend (see the module's docstring).
PERMANENT = (1, 2)


class ChiefFailed(TaskLost):
    """Raised in a ps or worker task whose chief failed for good; the task exits with
    the chief's code, so that no scheduler restarts it either."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def message(code: int, reason: str) -> str:
    """What a failed chief says: its exit code and the first line of its error."""
    first = (reason.strip().splitlines() or ["no message"])[0]
    return f"{code} {first[:500]}"


def failed(chief: str, said: str, label: str) -> ChiefFailed:
    """The error of task `label`, told `said` (`message`'s text) by the chief at `chief`."""
    code, _, reason = said.partition(" ")
    exit_code = int(code) if code.isdigit() else 1
    return ChiefFailed(
        f"the chief ({chief}) failed with exit code {exit_code}: {reason}; {label} stops "
        f"with the same code (a restart would fail the same way: do what the chief's error "
        "says, then start the job again)", exit_code)


def ask(address: str, label: str, timeout_s: float = 1.0) -> tuple[bool, str | None]:
    """(whether something accepts connections at `address`, what a failed chief
    listening there says, or None), asked by task `label`, which answers a failed
    chief with its label so that the chief knows who has heard. A TensorFlow
    server says no such line: a live chief costs a connection and up to
    `timeout_s` of waiting."""
    try:
        with connect(address, timeout_s) as s:
            data = b""
            try:
                while b"\n" not in data and len(data) < 4096:
                    chunk = s.recv(4096)
                    if not chunk:
                        break
                    data += chunk
            except OSError:  # nothing said within timeout_s: a TensorFlow server
                return True, None
            line = data.split(b"\n", 1)[0].decode(errors="replace")
            if not line.startswith(MAGIC + " "):
                return True, None
            with contextlib.suppress(OSError):  # the chief has heard enough
                s.sendall(f"{label}\n".encode())
            return True, line[len(MAGIC) + 1:]
    except OSError:
        return False, None


def applies(cluster: Cluster | None) -> bool:
    """Whether this process is the chief of a parameter-server cluster: it has tasks to tell."""
    return bool(cluster and cluster.num_ps and cluster.task_type == "chief")


def tell(cluster: Cluster | None, code: int, reason: str, wait_s: float) -> None:
    """From a parameter-server chief that is about to exit with `code`: when it is
    permanent, tell every ps and worker task (see the module's docstring)."""
    if not (applies(cluster) and code in PERMANENT):
        return
    said = message(code, reason)
    port = int(cluster.jobs["chief"][0].rpartition(":")[2])
    try:
        # All interfaces, as TensorFlow's server would listen.
        server = socket.create_server(
            ("", port), family=socket.AF_INET6 if socket.has_dualstack_ipv6() else
            socket.AF_INET, dualstack_ipv6=socket.has_dualstack_ipv6())
    except OSError:
        # The chief's own TensorFlow server holds it: the chief had connected.
        if "tensorflow" in sys.modules:
            from app.cluster import markers

            markers.tell_failed(cluster, said)
        return
    with server:
        linger(server, cluster, said, wait_s)


def linger(server: socket.socket, cluster: Cluster, said: str, wait_s: float) -> None:
    """Answer every ps and worker task that connects with `said`, until all have
    heard it or `wait_s` has passed."""
    tasks = {f"{job}:{i}" for job in ("ps", "worker") for i in range(len(cluster.jobs[job]))}
    told: set[str] = set()
    log.info("the chief failed (exit code %s); telling the ps and worker tasks, for up to "
             "%g s", said.split(" ", 1)[0], wait_s)
    deadline = time.monotonic() + wait_s
    while told < tasks and (left := deadline - time.monotonic()) > 0:
        server.settimeout(left)
        try:
            conn, _ = server.accept()
        except OSError:  # the deadline
            break
        with conn:
            conn.settimeout(2.0)
            try:
                conn.sendall(f"{MAGIC} {said}\n".encode())
                label = conn.recv(64).decode(errors="replace").strip()
            except OSError:
                continue  # a probe that left early asks again within a second
            if label in tasks:
                told.add(label)
    if told < tasks:
        log.warning("could not tell %s that the chief failed: not up within "
                    "cluster.connect_timeout_s = %g s", ", ".join(sorted(tasks - told)), wait_s)
