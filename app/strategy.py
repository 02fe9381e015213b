"""Turn a strategy name, the cluster and the local devices into a tf.distribute strategy.

`choose` decides (pure, so every branch is tested without devices);
`create` builds. `configure_runtime` must run before anything else touches
TensorFlow's devices: logical CPU devices and thread pools are fixed at start-up.
"""

from __future__ import annotations

import logging

import tensorflow as tf

from app import tf_internal
from app.cluster.tf_config import Cluster, check_strategy, wait_for_tasks
from app.config import Config, ConfigError, PSConfig, RuntimeConfig, SyncConfig
from app.distribute.ps.variables import partitioner

log = logging.getLogger(__name__)

NAMES = ("default", "mirrored", "multi_worker_mirrored", "parameter_server")


def configure_runtime(runtime: RuntimeConfig) -> None:
    """Apply thread pools and logical CPU devices; call before any TF op runs."""
    if runtime.intra_op_threads:
        tf.config.threading.set_intra_op_parallelism_threads(runtime.intra_op_threads)
    if runtime.inter_op_threads:
        tf.config.threading.set_inter_op_parallelism_threads(runtime.inter_op_threads)
    if not runtime.thread_spinning:
        try:
            tf_internal.stop_thread_spinning()
        except RuntimeError:
            raise ConfigError(
                "runtime.thread_spinning = false, but TensorFlow already started with its "
                "thread pools spinning; set it before any TensorFlow op runs") from None
    gpus = tf.config.list_physical_devices("GPU")
    if runtime.gpu_devices and not gpus:
        raise ConfigError(f"runtime.gpu_devices = {runtime.gpu_devices}, but this machine has "
                          "no GPU; use runtime.cpu_devices to split the CPU instead")
    for i, gpu in enumerate(gpus):
        if i == 0 and runtime.gpu_devices:
            tf.config.set_logical_device_configuration(gpu, [
                tf.config.LogicalDeviceConfiguration(memory_limit=runtime.gpu_device_memory_mib)
                for _ in range(runtime.gpu_devices)])
        else:
            # Co-located processes (local clusters, tests) must not each grab all memory.
            tf.config.experimental.set_memory_growth(gpu, True)
    if runtime.cpu_devices:
        split_cpu(runtime.cpu_devices)


def split_cpu(n: int) -> None:
    """Expose the CPU as `n` logical devices (only possible before TF initialises)."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)])
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have != n:
            raise ConfigError(
                f"runtime.cpu_devices = {n}, but TensorFlow already started with {have} "
                "CPU device(s); set it before any TensorFlow op runs") from None


def choose(name: str, cluster: Cluster | None, num_gpus: int) -> str:
    """The strategy to build for `name` ("auto" or one of NAMES) in this setting."""
    if name == "auto":
        if cluster is not None and cluster.num_ps > 0:
            return "parameter_server"
        if cluster is not None and cluster.is_multi_task:
            return "multi_worker_mirrored"
        return "mirrored" if num_gpus >= 2 else "default"
    check_strategy(name, cluster)
    if name in NAMES:
        return name
    raise ConfigError(f"Unrecognized strategy {name!r}; choose auto or one of {', '.join(NAMES)}")


def create(name: str, cluster: Cluster | None = None,
           config: Config | None = None) -> tf.distribute.Strategy:
    """Build the strategy `name` ("auto" or one of NAMES)."""
    config = config or Config()
    # Physical devices: listing logical ones would start TensorFlow's runtime,
    # after which MultiWorkerMirroredStrategy can no longer configure collectives.
    choice = choose(name, cluster, len(tf.config.list_physical_devices("GPU")))
    if choice == "default":
        return tf.distribute.get_strategy()
    if choice == "mirrored":
        gpus = tf.config.list_logical_devices("GPU")
        devices = [d.name for d in gpus or tf.config.list_logical_devices("CPU")]
        log.info("MirroredStrategy over %s", ", ".join(devices))
        tf_internal.new_collective_keys()
        return tf.distribute.MirroredStrategy(devices)
    if choice == "parameter_server":
        return parameter_server(cluster, config.ps, config.cluster.connect_timeout_s)
    if choice == "multi_worker_mirrored":
        return _multi_worker(cluster, config.sync)
    raise ConfigError(f"Unrecognized strategy {choice!r}")


def parameter_server(cluster: Cluster, ps: PSConfig,
                     connect_timeout_s: float) -> tf.distribute.Strategy:
    """The chief's strategy, once every ps and worker task answers (they serve it:
    `app.cluster.serving`), its variables split by `variables.partitioner`."""
    wait_for_tasks(cluster, connect_timeout_s, jobs=("ps", "worker"))
    return tf.distribute.ParameterServerStrategy(
        cluster.resolver(), variable_partitioner=partitioner(ps, cluster.num_ps))


def _multi_worker(cluster: Cluster | None, sync: SyncConfig) -> tf.distribute.Strategy:
    """MultiWorkerMirroredStrategy; its constructor waits until every worker has joined."""
    implementation = tf.distribute.experimental.CommunicationImplementation
    options = tf.distribute.experimental.CommunicationOptions(implementation={
        "auto": implementation.AUTO, "ring": implementation.RING,
        "nccl": implementation.NCCL}[sync.collective],
        bytes_per_pack=sync.bytes_per_pack)
    return MultiWorkerMirroredStrategy(
        cluster_resolver=cluster.resolver() if cluster else None,
        communication_options=options)


class MultiWorkerMirroredStrategy(tf.distribute.MultiWorkerMirroredStrategy):
    """TensorFlow's MultiWorkerMirroredStrategy, with a plain input path for CPU workers.

    TensorFlow feeds each worker's replicas through a MultiDeviceIterator: the
    collective strategy refuses the `PER_REPLICA` input mode that avoids it
    (only MirroredStrategy takes it). With one replica per worker on its own
    CPU that iterator copies nothing, yet it made 2-worker CNN training on a
    2-core host about 1.8x as slow (`python -m tools.bench --rows baseline,mwms_2w
    --set train.global_batch_size=128`: mwms_2w 0.42 of the baseline through it,
    0.772 with this class). When the replica is
    its worker's only one, the replica's input *is* the worker's input, so
    `PER_REPLICA` feeds exactly what `PER_WORKER` does: for that case this
    class calls TensorFlow's own `PER_REPLICA` path with the worker's input
    context (`input_options` asks for it), and leaves every other case to
    TensorFlow.
    """

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        per_replica = tf.distribute.InputReplicationMode.PER_REPLICA
        if (options is None or options.experimental_replication_mode != per_replica
                or len(self.extended.worker_devices) != 1):
            return super().distribute_datasets_from_function(dataset_fn, options)
        return tf_internal.distribute_per_replica(self, dataset_fn, options)


def input_options(strategy: tf.distribute.Strategy) -> tf.distribute.InputOptions | None:
    """How fit() should distribute the training input under `strategy`.

    By default a MirroredStrategy feeds its replicas through a MultiDeviceIterator,
    which copies every batch from the host to each device in a background
    thread. When the replicas *are* host CPU devices there is nothing to copy
    and that machinery only competes with the step for the cores; one plain
    iterator per replica (PER_REPLICA, no fetch to device) avoids it. GPUs keep
    TensorFlow's default, which overlaps the copy with the step. So do
    multi-worker runs with several replicas per worker.
    """
    if type(strategy) not in (tf.distribute.MirroredStrategy, MultiWorkerMirroredStrategy):
        return None
    devices = strategy.extended.worker_devices
    if type(strategy) is MultiWorkerMirroredStrategy and len(devices) != 1:
        return None  # several replicas per worker: TensorFlow's way (see the class)
    if not all(tf.DeviceSpec.from_string(d).device_type == "CPU" for d in devices):
        return None
    return tf.distribute.InputOptions(
        experimental_fetch_to_device=False,
        experimental_replication_mode=tf.distribute.InputReplicationMode.PER_REPLICA)


def describe(strategy: tf.distribute.Strategy) -> str:
    """The strategy's public class name (the default one's class is private)."""
    if isinstance(strategy, tf.distribute.ParameterServerStrategy):
        return "ParameterServerStrategy"  # also for a subclass of it
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return "MultiWorkerMirroredStrategy"  # not its implementation class's name
    name = type(strategy).__name__
    return "DefaultStrategy" if name == "_DefaultDistributionStrategy" else name


def check_batch(global_batch_size: int, num_replicas: int,
                what: str = "the number of replicas") -> int:
    """The per-replica batch; the global batch must split evenly over the replicas."""
    if global_batch_size % num_replicas:
        lower = global_batch_size - global_batch_size % num_replicas
        options = " or ".join(str(b) for b in (lower, lower + num_replicas) if b)
        raise ConfigError(
            f"train.global_batch_size ({global_batch_size}) must be divisible by "
            f"{what} ({num_replicas}); use {options}")
    return global_batch_size // num_replicas
