"""A ps or worker task's life in a parameter-server cluster: its TF server, started in
its own process, serving the chief until the chief says that it has finished, or that
it failed for good (app/cluster/markers.py), and the exit codes of a task whose chief
does not come back (203) or that is asked to stop (204).

The chief's side, the strategy that connects to these servers, is
`app.strategy.parameter_server`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable

import tensorflow as tf

from app.cluster import chief_failure, preemption
from app.cluster.markers import FAILED, finished_marker
from app.cluster.tf_config import Cluster, TaskLost
from app.config import RuntimeConfig

log = logging.getLogger(__name__)


def serve(cluster: Cluster, runtime: RuntimeConfig, wait_s: float,
          stopping: Callable[[], bool] = lambda: False, poll_s: float = 1.0,
          finished: Callable[[], bool] = lambda: False) -> None:
    """Serve this ps or worker task until the chief has finished.

    The chief connects to the cluster at its own address, so a task can see it
    arrive and leave (TF's `server.join()` never returns). Leaving is not
    finishing: a chief that crashed or was killed comes back (a Kubernetes pod
    restart, `launch.local --restart task`) and needs its ps and workers. So a
    task returns only once the chief, gone, has left the mark `tell_finished`
    writes on this task's own disk through TF (no shared storage needed). A
    chief gone without it is waited for `wait_s`; then `TaskLost` (exit 203, a
    code schedulers retry): the restarted task serves the chief when it comes.
    A chief that failed for good says so (`chief_failure`: on its port before
    it connected, in the mark after): `ChiefFailed`, with the chief's exit code.
    After SIGTERM (`stopping()`), the task stops once the chief has gone:
    `Preempted` (exit 204), retried as the chief's own exit.

    A task started (or restarted) as the chief finishes may get no mark: the
    chief's TensorFlow knows the task's earlier process ("unknown device"), or
    the task was down when it wrote. So a chief gone while `finished()` (the
    run's workdir holds its metrics.json, written before the chief lets its
    tasks go) has finished too. A chief that refuses a workdir finished by an
    earlier job says so on its port first (`chief_failure`), within a second of
    its start, before a task has its server up to ask.
    """
    address = cluster.jobs[cluster.task_type][cluster.task_index]
    marker = finished_marker(address)
    with contextlib.suppress(FileNotFoundError):  # an earlier job's, on this task's address
        os.remove(marker)
    start_server(cluster.resolver().cluster_spec(), cluster.task_type, cluster.task_index,
                 protocol=cluster.rpc_layer, inter_op_threads=runtime.inter_op_threads,
                 intra_op_threads=runtime.intra_op_threads, spinning=runtime.thread_spinning)
    chief = cluster.jobs["chief"][0]
    log.info("serving at %s; waiting for the chief at %s", address, chief)
    seen, gone_since = False, None
    while True:
        up, failure = chief_failure.ask(chief, cluster.label)
        if failure is not None:
            raise chief_failure.failed(chief, failure, cluster.label)
        if up:
            if not seen or gone_since is not None:
                log.info("the chief is up")
            seen, gone_since = True, None
        elif os.path.exists(marker):
            # Even unseen (a chief that failed within a poll), and before SIGTERM: what
            # the chief said is what happened (a launcher stops the tasks at once).
            with open(marker) as f:
                said = f.read()
            os.remove(marker)
            if said.startswith(FAILED):
                raise chief_failure.failed(chief, said.removeprefix(FAILED), cluster.label)
            log.info("the chief has finished; stopping")
            return
        elif finished():
            log.info("the chief has gone and the run has finished (its workdir holds "
                     "metrics.json); stopping")
            return
        elif stopping():
            raise preemption.serving_preempted(cluster.label, chief_seen=seen)
        elif seen:
            if gone_since is None:
                gone_since = time.monotonic()
                log.info("the chief left without finishing; waiting up to %g s for it to "
                         "come back", wait_s)
            elif time.monotonic() - gone_since >= wait_s:
                raise TaskLost(
                    f"the chief ({chief}) left without finishing and has not come back within "
                    f"cluster.connect_timeout_s = {wait_s:g} s; {cluster.label} stops with "
                    f"exit code {TaskLost.exit_code}, which launchers and Kubernetes' "
                    "restartPolicy: ExitCode retry: restarted, it serves the chief again")
        time.sleep(poll_s)


def start_server(spec: tf.train.ClusterSpec, job: str, index: int, protocol: str = "grpc",
                 inter_op_threads: int = 0, intra_op_threads: int = 0,
                 spinning: bool = True) -> None:
    """Start the TF server of task `job:index` in this process (it runs until exit)."""
    tf.distribute.Server(spec, job_name=job, task_index=index, protocol=protocol,
                         config=server_config(spec, inter_op_threads, intra_op_threads,
                                              spinning),
                         start=True)


def server_config(spec: tf.train.ClusterSpec, inter_op_threads: int = 0,
                  intra_op_threads: int = 0, spinning: bool = True) -> tf.compat.v1.ConfigProto:
    """The session config of a task's server: its thread pools, which TensorFlow makes
    once per process (the first config to ask for them sets them)."""
    config = tf.compat.v1.ConfigProto()
    # Fewer inter-op threads than workers + 1 can deadlock a task that runs
    # several workers' functions at once on a small host.
    config.inter_op_parallelism_threads = inter_op_threads or spec.num_tasks("worker") + 1
    if intra_op_threads:
        config.intra_op_parallelism_threads = intra_op_threads
    # Eigen's pools spin for their next op before they sleep; on cores that a cluster's
    # tasks share, that spinning takes time from the task with work (docs/benchmarks.md).
    config.experimental.disable_thread_spinning = not spinning
    return config
