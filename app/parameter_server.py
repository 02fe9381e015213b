"""Parameter-server training: the strategy, its coordinator, and where variables live.

`create` gives the chief a `ParameterServerStrategy` with a variable
partitioner, after checking that every `ps` and `worker` task answers within
`cluster.connect_timeout_s`. `serve` runs a ps or worker task until the chief
says, through `tell_finished`, that it has finished, or that it failed for
good (`tell_failed`, app/chief_failure.py). `placement` reports which
PS task holds how many bytes; `app.plan` predicts the same without a cluster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable

import numpy as np
import tensorflow as tf

from app import chief_failure, preemption
from app.cluster import Cluster, TaskLost, reachable, wait_for_tasks
from app.config import ConfigError, PSConfig, RuntimeConfig

log = logging.getLogger(__name__)

def partitioner(ps: PSConfig, num_ps: int
                ) -> tf.distribute.experimental.partitioners.Partitioner | None:
    """The ShardedVariable partitioner `ps.partitioner` names, for `num_ps` ps tasks."""
    partitioners = tf.distribute.experimental.partitioners
    if ps.partitioner == "none":
        return None
    if ps.partitioner == "min_size":
        chosen = partitioners.MinSizePartitioner(min_shard_bytes=ps.shard_bytes, max_shards=num_ps)
    elif ps.partitioner == "max_size":
        chosen = partitioners.MaxSizePartitioner(max_shard_bytes=ps.shard_bytes)
    elif ps.partitioner == "fixed":
        chosen = partitioners.FixedShardsPartitioner(ps.num_shards or num_ps)
    else:
        raise ConfigError(f"ps.partitioner = {ps.partitioner!r} is not one of "
                          "min_size, max_size, fixed, none")
    return KnownShapes(chosen)


class KnownShapes(tf.distribute.experimental.partitioners.Partitioner):
    """`partitioner`, for variables whose shape is known; one shard for the others.

    TensorFlow 2.21's ParameterServerStrategy asks the partitioner about every
    variable of rank 1 or more, and its partitioners need the whole shape: the size
    ones multiply `shape.num_elements()`, None for a partly known shape
    (partitioned_variables.py, `min_max_variable_partitioner`: "unsupported operand
    type(s) for *: 'NoneType' and 'int'"), the fixed one takes the first dimension.
    tf_keras' `Discretization` makes its `summary` of shape (2, None) when it is
    adapted, in the strategy's scope: the chief failed in `build_model`. A variable
    whose shape can change cannot be split anyway. No TensorFlow issue found.
    """

    def __init__(self, partitioner: tf.distribute.experimental.partitioners.Partitioner):
        self.partitioner = partitioner

    def __call__(self, shape, dtype, axis=0):
        if not shape.is_fully_defined():
            return [1] * shape.rank
        return self.partitioner(shape, dtype, axis)


def create(cluster: Cluster, ps: PSConfig, connect_timeout_s: float) -> tf.distribute.Strategy:
    """The chief's strategy, once every ps and worker task answers."""
    wait_for_tasks(cluster, connect_timeout_s, jobs=("ps", "worker"))
    return tf.distribute.ParameterServerStrategy(
        cluster.resolver(), variable_partitioner=partitioner(ps, cluster.num_ps))


def serve(cluster: Cluster, runtime: RuntimeConfig, wait_s: float,
          stopping: Callable[[], bool] = lambda: False, poll_s: float = 1.0) -> None:
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
    """
    address = cluster.jobs[cluster.task_type][cluster.task_index]
    marker = finished_marker(address)
    with contextlib.suppress(FileNotFoundError):  # an earlier job's, on this task's address
        os.remove(marker)
    start_server(cluster.resolver().cluster_spec(), cluster.task_type, cluster.task_index,
                 protocol=cluster.rpc_layer, inter_op_threads=runtime.inter_op_threads,
                 intra_op_threads=runtime.intra_op_threads)
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


def start_server(spec: tf.train.ClusterSpec, job: str, index: int, protocol: str = "grpc",
                 inter_op_threads: int = 0, intra_op_threads: int = 0) -> None:
    """Start the TF server of task `job:index` in this process (it runs until exit)."""
    config = tf.compat.v1.ConfigProto()
    # Fewer inter-op threads than workers + 1 can deadlock a task that runs
    # several workers' functions at once on a small host.
    config.inter_op_parallelism_threads = inter_op_threads or spec.num_tasks("worker") + 1
    if intra_op_threads:
        config.intra_op_parallelism_threads = intra_op_threads
    tf.distribute.Server(spec, job_name=job, task_index=index, protocol=protocol,
                         config=config, start=True)


@dataclasses.dataclass(frozen=True)
class Shard:
    variable: str  # the variable's name, without the partition suffix
    ps_task: int
    shape: tuple[int, ...]
    bytes: int


@dataclasses.dataclass(frozen=True)
class Placement:
    """Which ps task holds which variable shards, and the bytes per task."""

    num_ps: int
    shards: tuple[Shard, ...]
    # Weights that are not variables (lookup tables, other resources), by name:
    # they are not partitioned and stay where they were created.
    others: tuple[str, ...] = ()

    @property
    def ps_bytes(self) -> list[int]:
        totals = [0] * self.num_ps
        for shard in self.shards:
            totals[shard.ps_task] += shard.bytes
        return totals

    @property
    def balance(self) -> float:
        """max / mean bytes over the ps tasks: 1.0 is perfect, num_ps is all on one."""
        totals = self.ps_bytes
        mean = sum(totals) / len(totals)
        return round(max(totals) / mean, 4) if mean else 1.0

    def report(self) -> list[str]:
        by_variable: dict[str, list[Shard]] = {}
        for shard in self.shards:
            by_variable.setdefault(shard.variable, []).append(shard)
        width = max((len(name) for name in by_variable), default=0)
        lines = [f"placement over {self.num_ps} ps task(s) (optimizer slots included):"]
        for name, shards in by_variable.items():
            where = " ".join(f"ps:{s.ps_task}" for s in shards)
            total = sum(s.bytes for s in shards)
            lines.append(f"  {name:<{width}}  {len(shards)} shard(s) on {where:<12} "
                         f"{human_size(total):>10}")
        lines += [f"  {name}  not a variable (a lookup table or other resource): not placed"
                  for name in self.others]
        lines += [f"  ps:{i}  {human_size(b):>10}" for i, b in enumerate(self.ps_bytes)]
        lines.append(f"  max/mean = {self.balance:.3f}")
        return lines


def placement(variables: Iterable[tf.Variable], num_ps: int) -> Placement:
    """Where `variables` (ShardedVariables expanded) live among the ps tasks; entries
    that are not variables (Keras lists lookup tables among a model's weights) are
    named in `others`."""
    shards, others = [], []
    for var in _unique(variables):
        if not is_variable(var):
            others.append(weight_name(var))
            continue
        for part in getattr(var, "variables", None) or [var]:
            task = tf.DeviceSpec.from_string(part.device).task
            if task is None:
                raise ValueError(f"variable {part.name} is on {part.device!r}, not a ps task")
            shards.append(Shard(base_name(part.name), task, tuple(part.shape), _bytes(part)))
    return Placement(num_ps, tuple(shards), tuple(others))


def _bytes(variable: tf.Variable) -> int:
    """The bytes `variable` holds; one whose shape is not fixed (tf_keras' adapted
    `Discretization` keeps a summary of shape (2, None)) counts what it holds now."""
    elements = variable.shape.num_elements()
    if elements is None:
        elements = int(tf.size(variable))
    return elements * variable.dtype.size


def gather_weights(model) -> list[np.ndarray]:
    """`model.get_weights()` with each ShardedVariable's parts joined into one array,
    as the same model built without a partitioner holds them."""
    # The parts of one ShardedVariable, by its name; every other weight on its own
    # (names repeat: two metrics of a subclassed model each have a "total").
    parts: dict[str, list] = {}
    for weight in model.weights:
        name = getattr(weight, "name", "")
        sharded = is_variable(weight) and base_name(name) != name.removesuffix(":0")
        parts.setdefault(base_name(name) if sharded else f"#{id(weight)}", []).append(weight)
    arrays = []
    for group in parts.values():
        if not is_variable(group[0]):
            # A lookup table's handler: its tensors, as get_weights() lists them.
            arrays += [t.numpy() for t in group[0].get_tensors()]
        else:
            arrays.append(np.concatenate([v.numpy() for v in group]) if len(group) > 1
                          else group[0].numpy())
    return arrays


def weight_name(weight) -> str:
    """A model weight's name; a lookup table's handler has none: its layer's."""
    layer = getattr(weight, "_layer", None)  # Keras' VocabWeightHandler keeps its layer so
    return getattr(weight, "name", None) or (
        f"{layer.name}/vocabulary" if layer is not None else type(weight).__name__)


def is_variable(weight) -> bool:
    """Whether an entry of `model.weights` is a variable (or a shard of one), not
    the handler of a lookup table or other resource (Keras lists those too)."""
    return isinstance(weight, tf.Variable) or hasattr(weight, "variables")


def _unique(variables: Iterable[tf.Variable]) -> list[tf.Variable]:
    seen, out = set(), []
    for var in variables:
        if id(var) not in seen:
            seen.add(id(var))
            out.append(var)
    return out


def base_name(name: str) -> str:
    name = name.removesuffix(":0")
    head, sep, tail = name.rpartition("/part_")
    return head if sep and tail.isdigit() else name


def human_size(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return ""
