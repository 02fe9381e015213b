"""`make local-cluster`: a whole parameter-server cluster inside one process.

The TensorFlow tutorial's way: the ps and worker servers are started
in-process on free ports (held from their pick until the servers listen,
launch/ports.py), this process becomes the chief (TF_CONFIG is set for it), and
`app.train` trains as it would on a real cluster. The servers live until the
process exits (TensorFlow cannot stop them).

    python -m launch.inprocess --workers 2 --ps 2 --config configs/mnist_ps.toml
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import sys

from launch.ports import Ports

# Before TensorFlow is imported, as app.train does.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")


def cluster_spec(num_workers: int, num_ps: int, ports: Ports,
                 host: str = "localhost") -> dict[str, list[str]]:
    """Addresses on `host` for a chief, `num_workers` workers and `num_ps` ps tasks,
    each on a port `ports` holds; with no ps, for the workers alone (a synchronous
    cluster)."""
    if not num_ps:
        return {"worker": ports.addresses(host, num_workers)}
    return {"chief": ports.addresses(host, 1), "worker": ports.addresses(host, num_workers),
            "ps": ports.addresses(host, num_ps)}


def start_servers(spec: dict[str, list[str]]) -> None:
    """Start every ps and worker server of `spec` in this process, their thread pools
    sleeping when idle: they share its cores (launch.local's tasks, `thread_settings`)."""
    import tensorflow as tf

    from app.cluster.serving import start_server

    cluster = tf.train.ClusterSpec(spec)
    for job in ("ps", "worker"):
        for index in range(len(spec[job])):
            start_server(cluster, job, index, spinning=False)
    # The chief marks each server it has finished with (markers.tell_finished);
    # nobody here serves, and so nobody would remove the marks.
    atexit.register(remove_finished_markers, [a for job in ("ps", "worker") for a in spec[job]])


def remove_finished_markers(addresses: list[str]) -> None:
    from app.cluster.markers import finished_marker

    for address in addresses:
        with contextlib.suppress(FileNotFoundError):
            os.remove(finished_marker(address))


def become_chief(spec: dict[str, list[str]]) -> None:
    os.environ["TF_CONFIG"] = json.dumps({"cluster": spec, "task": {"type": "chief", "index": 0}})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.inprocess",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=1)
    args, train_args = parser.parse_known_args(argv)
    if args.workers < 1 or args.ps < 1:
        parser.error("--workers and --ps must be at least 1")
    # Held until the process ends: the chief's server binds its port only when it
    # connects to the cluster.
    with Ports() as ports:
        spec = cluster_spec(args.workers, args.ps, ports)
        start_servers(spec)
        become_chief(spec)
        from app import train

        return train.main(train_args)


if __name__ == "__main__":
    sys.exit(main())
