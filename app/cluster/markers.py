"""The chief's word to its ps and worker tasks when it leaves: "finished", or that
it failed for good.

`tell_finished` leaves `finished_marker` on every ps and worker task, written
by TF on that task's own device; `tell_failed` leaves the same marker holding
the chief's exit code and error (`chief_failure.tell`).
`app.cluster.serving.serve` waits for it.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile

import tensorflow as tf

from app.cluster.tf_config import Cluster, reachable

log = logging.getLogger(__name__)


# A marker that starts so holds a chief's failure (`chief_failure.message`), not "finished".
FAILED = "failed "


def finished_marker(address: str) -> str:
    """The file that tells the ps or worker task at `address` that the chief has
    finished: on that task's own disk, named after its address (one per task when
    several share a machine). The chief names the path, in its own temp dir: a
    task whose TMPDIR differs never sees the mark, and exits 203 once the chief
    has been gone `cluster.connect_timeout_s` (a Kubernetes job has succeeded by
    then, and its pods are removed)."""
    return os.path.join(tempfile.gettempdir(),
                        "tf-chief-finished-" + re.sub(r"[^A-Za-z0-9_.-]", "_", address))


def tell_finished(cluster: Cluster) -> None:
    """From the chief, once training is done: leave `finished_marker` on every ps and
    worker task, written by TF on that task's device, so that `serve` returns.

    A task that is down is skipped (logged): restarted, it serves until its
    scheduler or launcher stops it, as the chief will not come back.
    """
    _mark(cluster, "finished", "that training finished")


def tell_failed(cluster: Cluster, said: str) -> None:
    """From a chief connected to the cluster that fails for good (`chief_failure.tell`):
    the same marker, holding its exit code and error (`said`), so that `serve` raises
    `ChiefFailed` instead of waiting for it to come back."""
    _mark(cluster, FAILED + said, "that the chief failed")


def _mark(cluster: Cluster, text: str, what: str) -> None:
    for job in ("ps", "worker"):
        for index, address in enumerate(cluster.jobs.get(job, ())):
            marker = finished_marker(address)
            if not reachable(address):  # TF would wait for it to come back
                log.warning("could not tell %s:%d (%s) %s: it is down", job, index, address,
                            what)
                continue
            try:
                with tf.device(f"/job:{job}/replica:0/task:{index}/device:CPU:0"):
                    tf.io.write_file(marker, text)
                    # Read back: the write has happened on that task before the chief exits.
                    written = tf.io.read_file(marker).numpy()
            except (tf.errors.OpError, RuntimeError, ValueError) as e:
                # OpError: that task failed it; RuntimeError, ValueError: this process
                # knows no such device (it has not connected to the cluster).
                written = (str(getattr(e, "message", e)).splitlines() or [""])[0]
            if written != text.encode():
                log.warning("could not tell %s:%d (%s) %s: %s", job, index, address, what,
                            written)
