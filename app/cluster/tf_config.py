"""The cluster this process belongs to, from `TF_CONFIG`.

This module is the only reader of `TF_CONFIG`. It checks the variable before
any server starts and explains each mistake in one line that names the field
and the fix (`ClusterError`, exit code 2). Strategies get a resolver over the
*training* jobs only, without the `evaluator` that Kubeflow
lists in every task's TF_CONFIG (a chief waiting on it would stall).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import time
import typing
from typing import Any

from app.config import ConfigError, is_address

ENV = "TF_CONFIG"
JOBS = ("chief", "worker", "ps", "evaluator")
_EXAMPLE = ('{"cluster": {"worker": ["host0:2222", "host1:2222"]}, '
            '"task": {"type": "worker", "index": 0}}')


class ClusterError(ConfigError):
    """TF_CONFIG describes a cluster that cannot work."""


class TaskLost(RuntimeError):
    """A task the run depends on went away mid-run; a restart resumes from the backup."""

    # Retried by launchers, unlike 2 (a configuration mistake). Above 128 because
    # Kubeflow's `restartPolicy: ExitCode` restarts a pod only after an exit code in
    # 128..255 (1..127 fail the job for good); 203, not 129..192, which a shell
    # reports for a death by signal (128 + N).
    exit_code = 203


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A validated TF_CONFIG: every job's addresses and this process's task."""

    jobs: dict[str, tuple[str, ...]]
    task_type: str
    task_index: int
    rpc_layer: str = "grpc"

    @property
    def num_workers(self) -> int:
        return len(self.jobs.get("worker", ()))

    @property
    def num_ps(self) -> int:
        return len(self.jobs.get("ps", ()))

    @property
    def has_chief(self) -> bool:
        return "chief" in self.jobs

    @property
    def training_jobs(self) -> dict[str, list[str]]:
        return {job: list(addrs) for job, addrs in self.jobs.items() if job != "evaluator"}

    @property
    def is_multi_task(self) -> bool:
        return sum(len(addrs) for addrs in self.training_jobs.values()) > 1

    @property
    def is_chief(self) -> bool:
        """The task that writes summaries, exports and metrics.json."""
        if self.has_chief:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_index == 0

    @property
    def label(self) -> str:
        return f"{self.task_type}:{self.task_index}"

    def resolver(self):
        """A cluster resolver over the training jobs, for a strategy to use.

        Built from this object, not from the environment, so that a process
        can hold more than one (in-process clusters, tests).
        """
        import tensorflow as tf

        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(self.training_jobs), task_type=self.task_type,
            task_id=self.task_index, rpc_layer=self.rpc_layer)


# The strategies that train on one host, whatever TF_CONFIG says.
ONE_HOST_STRATEGIES = ("default", "mirrored")


def check_strategy(name: str, cluster: Cluster | None) -> None:
    """`runtime.strategy = name` against the cluster: a ConfigError for a strategy the
    cluster cannot run. Without TensorFlow, so that `python -m app.train` says it at
    once; `strategy.choose` decides the rest."""
    multi_task = cluster is not None and cluster.is_multi_task
    has_ps = cluster is not None and cluster.num_ps > 0
    if name in ONE_HOST_STRATEGIES and multi_task:
        raise ConfigError(
            f"--strategy {name} trains on one host, but TF_CONFIG describes a cluster "
            f"({shape(cluster)}); unset TF_CONFIG, or use --strategy auto")
    if name == "multi_worker_mirrored" and has_ps:
        raise ConfigError(
            f"--strategy multi_worker_mirrored has no parameter servers, but TF_CONFIG "
            f"lists {cluster.num_ps} 'ps' task(s); remove the 'ps' job, or use "
            "--strategy parameter_server")
    if name == "parameter_server" and not has_ps:
        raise ConfigError(
            "--strategy parameter_server needs TF_CONFIG with 'chief', 'worker' and 'ps' "
            "jobs (see docs/launching.md)")


def shape(cluster: Cluster | None) -> str:
    """"2 worker, 1 ps": the training jobs' sizes."""
    if cluster is None:
        return "none"
    return ", ".join(f"{len(a)} {job}" for job, a in cluster.training_jobs.items())


# Where TensorFlow names the task whose answer an error came in (grpc_util.h).
_REMOTE_PS = r"remote target (/job:ps/replica:0/task:\d+)"


def lost_ps(message: str, ps: typing.Sequence[str]) -> str:
    """Name the ps tasks a TensorFlow error message blames, with their `ps` addresses.

    A step's error names every task it passed through, the one that failed first:
    "(0) UNAVAILABLE: ... from remote target /job:ps/replica:0/task:1 while calling
    RecvTensor ... from remote target /job:ps/replica:0/task:0 ..." is ps:1 lost, and
    ps:0, which was reading from it, relayed the error. So each root error blames the
    first ps it names as a remote target; a message without one, every ps it names."""
    roots = re.split(r"\(\d+\) [A-Z_]+: ", message)  # "2 root error(s) found. (0) ABORTED: ..."
    first = [m[1] for root in roots if (m := re.search(_REMOTE_PS, root))]
    return _blamed(" ".join(first) if first else message, {"ps": ps}) or "a parameter server"


def lost_peers(message: str, cluster: Cluster) -> str:
    """Name the other chief and worker tasks a TensorFlow error message blames, with
    their addresses (a synchronous worker's peers in its collectives)."""
    jobs = {job: cluster.jobs.get(job, ()) for job in ("chief", "worker")}
    return (_blamed(message, jobs, skip=(cluster.task_type, cluster.task_index))
            or "a peer worker")


def _blamed(message: str, jobs: typing.Mapping[str, typing.Sequence[str]],
            skip: tuple[str, int] | None = None) -> str:
    """"ps:1 (host:port), ...": the tasks of `jobs` that `message` names as
    /job:JOB/replica:0/task:N, in order, but `skip`."""
    found = {(job, int(i)) for job, i in re.findall(r"/job:(\w+)/replica:0/task:(\d+)", message)}
    return ", ".join(f"{job}:{i} ({jobs[job][i]})" for job, i in sorted(found)
                     if job in jobs and i < len(jobs[job]) and (job, i) != skip)


def read() -> Cluster | None:
    """The validated cluster from TF_CONFIG, or None when it is unset or empty."""
    text = os.environ.get(ENV, "").strip()
    return parse(text) if text else None


def parse(text: str) -> Cluster:
    """Validate TF_CONFIG text; raises ClusterError naming the field and the fix."""
    try:
        tf_config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ClusterError(
            f"{ENV} is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); "
            f"it should look like {_EXAMPLE}") from None
    if not isinstance(tf_config, dict):
        raise ClusterError(f"{ENV} must be a JSON object like {_EXAMPLE}")
    for key in ("cluster", "task"):
        if not isinstance(tf_config.get(key), dict):
            raise ClusterError(
                f"{ENV} has no {key!r} object; it should look like {_EXAMPLE}")
    jobs = _parse_jobs(tf_config["cluster"])
    task_type, task_index = _parse_task(tf_config["task"], jobs)
    rpc_layer = tf_config.get("rpc_layer", "grpc")
    return Cluster(jobs=jobs, task_type=task_type, task_index=task_index, rpc_layer=rpc_layer)


def _parse_jobs(cluster: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    jobs: dict[str, tuple[str, ...]] = {}
    for job, addrs in cluster.items():
        if job not in JOBS:
            raise ClusterError(
                f"{ENV} cluster.{job}: unknown job {job!r}; jobs are {', '.join(JOBS)}")
        if not isinstance(addrs, list) or not addrs:
            raise ClusterError(
                f"{ENV} cluster.{job} must be a non-empty list of \"host:port\" strings")
        for i, addr in enumerate(addrs):
            _check_address(f"cluster.{job}[{i}]", addr)
        jobs[job] = tuple(addrs)
    if not jobs:
        raise ClusterError(f"{ENV} cluster is empty; it should look like {_EXAMPLE}")

    seen: dict[str, str] = {}
    for job, addrs in jobs.items():
        for i, addr in enumerate(addrs):
            where = f"cluster.{job}[{i}]"
            if addr in seen:
                raise ClusterError(
                    f"{ENV} {where} = {addr!r} is also {seen[addr]}; "
                    "every task needs its own host:port")
            seen[addr] = where
    if len(jobs.get("chief", ())) > 1:
        raise ClusterError(
            f"{ENV} cluster.chief lists {len(jobs['chief'])} tasks; there can be at most one "
            "chief (make the others workers)")
    if "ps" in jobs and "chief" not in jobs:
        raise ClusterError(
            f"{ENV} cluster has a 'ps' job but no 'chief': parameter-server training needs "
            "a chief to coordinate; add \"chief\": [\"host:port\"]")
    if "ps" in jobs and "worker" not in jobs:
        raise ClusterError(
            f"{ENV} cluster has a 'ps' job but no 'worker' job; add \"worker\": [\"host:port\"]")
    return jobs


def _check_address(where: str, addr: Any) -> None:
    if not (isinstance(addr, str) and is_address(addr)):
        raise ClusterError(
            f"{ENV} {where} = {json.dumps(addr)} is not \"host:port\" with a port in "
            "1..65535 (e.g. \"10.0.0.1:2222\")")


def _parse_task(task: dict[str, Any], jobs: dict[str, tuple[str, ...]]) -> tuple[str, int]:
    task_type, index = task.get("type"), task.get("index", 0)
    if task_type not in JOBS:
        raise ClusterError(
            f"{ENV} task.type = {json.dumps(task_type)} is not one of {', '.join(JOBS)}")
    if type(index) is not int:
        raise ClusterError(f"{ENV} task.index = {json.dumps(index)} must be an integer")
    # TensorFlow lets an evaluator run without being listed in the cluster.
    unlisted_evaluator = task_type == "evaluator" and task_type not in jobs
    size = 1 if unlisted_evaluator else len(jobs.get(task_type, ()))
    if size == 0:
        raise ClusterError(
            f"{ENV} task.type = {task_type!r} but the cluster has no {task_type!r} job; "
            f"add cluster.{task_type} or fix task.type")
    if not 0 <= index < size:
        raise ClusterError(
            f"{ENV} task.index = {index} is out of range: cluster.{task_type} lists "
            f"{size} task(s), so task.index must be in 0..{size - 1}")
    return task_type, index


def wait_until_reachable(addresses: typing.Mapping[str, str], timeout_s: float,
                         poll_s: float = 0.5) -> dict[str, str]:
    """Wait up to `timeout_s` for every {name: host:port} to accept connections; those
    that still do not, or {} once all do. (TensorFlow itself would wait without end.)"""
    deadline = time.monotonic() + timeout_s
    while missing := {name: a for name, a in addresses.items() if not reachable(a)}:
        if time.monotonic() >= deadline:
            return missing
        time.sleep(poll_s)
    return {}


def wait_for_tasks(cluster: Cluster, timeout_s: float, jobs: tuple[str, ...],
                   poll_s: float = 0.5) -> None:
    """Return once every task of `jobs` accepts connections; else ClusterError naming
    the tasks that never answered (TensorFlow: "CreateSession still waiting for
    response from worker")."""
    tasks = {f"{job}:{i}": address for job in jobs
             for i, address in enumerate(cluster.jobs.get(job, ()))}
    if missing := wait_until_reachable(tasks, timeout_s, poll_s):
        tasks = ", ".join(f"{task} at {address}" for task, address in missing.items())
        raise ClusterError(
            f"no answer within cluster.connect_timeout_s = {timeout_s:g} s from {tasks}; "
            "start those tasks (python -m app.train with their TF_CONFIG), check the "
            "addresses in TF_CONFIG, or raise cluster.connect_timeout_s")


def connect(address: str, timeout_s: float = 1.0) -> socket.socket:
    """A TCP connection to host:port; OSError when nothing accepts one."""
    host, _, port = address.rpartition(":")
    return socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)


def reachable(address: str, timeout_s: float = 1.0) -> bool:
    """Whether something accepts TCP connections at host:port."""
    try:
        with connect(address, timeout_s):
            return True
    except OSError:
        return False
