"""The tf.data service: training input pipelines run by processes of their own.

`python -m app.distribute.data_service dispatcher` and
`python -m app.distribute.data_service worker` are TensorFlow's `DispatchServer`
and `WorkerServer`; with `data.service` set to the dispatcher's host:port, every
trainer reads its training batches from them.
The task's own `train_dataset` is what the service runs: the trainer builds it
once, as one input pipeline, and registers its graph with the dispatcher; the
tf.data workers run that graph, and every trainer of the run reads one shared
job of it. Evaluation does not go through the service: its exact, in-order
datasets (app/data.py, `exact`) are read where they always were.

One processing mode for every strategy: `ShardingPolicy.DYNAMIC`. The dispatcher
hands out splits of the dataset's source (records of a file, elements of a range)
to the tf.data workers on demand, so an example goes to at most one trainer, and
a dead trainer or tf.data worker loses only what it held, without anything being
read twice (docs/data_service.md measures it). A task's training data repeats and
every trainer takes `steps_per_epoch` whole batches an epoch, so synchronous
replicas (MultiWorkerMirrored, sync ps) stay in lockstep without coordinated reads.
The other modes would not keep an epoch exact: `OFF` makes every tf.data worker
produce the whole dataset (an epoch read once per tf.data worker), and the static
policies (`FILE`, `DATA`) tie a shard to a tf.data worker, so a trainer's steps
depend on how many there are.

    python -m app.distribute.data_service dispatcher --port 5050 --work-dir runs/x/data_service
    python -m app.distribute.data_service worker --dispatcher host:5050 --port 5051
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable

import tensorflow as tf

from app.cluster import chief_failure
from app.cluster.tf_config import wait_until_reachable
from app.config import ConfigError

log = logging.getLogger(__name__)

service = tf.data.experimental.service
DatasetFn = Callable[[tf.distribute.InputContext], tf.data.Dataset]

# TensorFlow's defaults (30 s heartbeats, a worker dropped after 10 min of silence)
# would leave the splits a dead tf.data worker held unassigned for minutes.
HEARTBEAT_MS, WORKER_TIMEOUT_MS = 1_000, 10_000
# How long the lead training task's port stays closed before a watching service
# task takes training to be over (a chief writing its export answers throughout;
# SLURM restarts no task inside a job).
GONE_S = 60.0

# Batches a trainer asks for ahead of its step: enough to hide a fetch, and a bound
# on what a killed trainer had fetched (TensorFlow's default autotunes it).
MAX_OUTSTANDING_REQUESTS = 2

# Ops a tf.data worker cannot run: they call back into the Python of the process
# that built the dataset, and a tf.data worker has none of it.
PYTHON_OPS = {"PyFunc": "tf.numpy_function or Dataset.from_generator",
              "PyFuncStateless": "tf.numpy_function",
              "EagerPyFunc": "tf.py_function"}


def wait_for_dispatcher(address: str, timeout_s: float, poll_s: float = 0.5) -> None:
    """Return once the dispatcher accepts connections; else ConfigError naming it.

    TensorFlow itself would retry without end when registering a dataset."""
    target = address.removeprefix("grpc://")
    if wait_until_reachable({"dispatcher": target}, timeout_s, poll_s):
        raise ConfigError(
            f"no tf.data service dispatcher answers at data.service = {target} within "
            f"cluster.connect_timeout_s = {timeout_s:g} s; start it (python -m "
            "app.distribute.data_service dispatcher, or launch.local --data-workers N), fix the "
            "address, or set data.service = \"\" to read input in the trainers")


def python_ops(dataset: tf.data.Dataset) -> list[str]:
    """The ops of `dataset`'s graph that call Python (PYTHON_OPS), in its functions too."""
    graph = tf.compat.v1.GraphDef()
    graph.ParseFromString(dataset._as_serialized_graph().numpy())  # no public accessor
    ops = {node.op for node in graph.node}
    ops |= {node.op for function in graph.library.function for node in function.node_def}
    return sorted(ops & PYTHON_OPS.keys())


def check_runnable(dataset: tf.data.Dataset, task_name: str) -> None:
    """ConfigError when a tf.data worker could not run `dataset`: it calls Python."""
    if found := python_ops(dataset):
        instead = ", ".join(f"{op} ({PYTHON_OPS[op]})" for op in found)
        raise ConfigError(
            f"data.service: the training dataset of task {task_name} calls Python through "
            f"{instead}, which a tf.data worker cannot run; write that step with TensorFlow "
            "ops (tf.data, tf.io, tf.image, tf.strings), or set data.service = \"\" to read "
            "input in the trainers")


class Reader:
    """Wraps a task's dataset_fn so that the trainers read it through the service.

    `run_key` names the run (its workdir): a chief that restarts from the backup
    rejoins the job its first life started, so the dispatcher goes on handing out
    the splits not yet read instead of starting the data over.
    """

    def __init__(self, address: str, run_key: str, task_name: str, timeout_s: float):
        self.address = address  # [grpc://]host:port: TensorFlow's protocol is grpc by default
        self.job = "train-" + hashlib.sha256(run_key.encode()).hexdigest()[:16]
        self.task_name, self.timeout_s = task_name, timeout_s
        self._registered: tuple[tf.Tensor, tf.TensorSpec] | None = None

    def wrap(self, dataset_fn: DatasetFn) -> DatasetFn:
        def fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
            dataset_id, spec = self._register(dataset_fn, context)
            return service.from_dataset_id(
                service.ShardingPolicy.DYNAMIC, self.address, dataset_id, spec,
                job_name=self.job, max_outstanding_requests=MAX_OUTSTANDING_REQUESTS)
        return fn

    def _register(self, dataset_fn: DatasetFn, context: tf.distribute.InputContext):
        """The dataset's id at the dispatcher and its element spec, registered once."""
        if self._registered is None:
            # Eagerly, in this process, even where the coordinator traces `fn` for its
            # workers: they then only read, by id.
            with tf.init_scope():
                # One pipeline: the dispatcher shards, not the task.
                dataset = dataset_fn(tf.distribute.InputContext(
                    num_replicas_in_sync=context.num_replicas_in_sync))
                check_runnable(dataset, self.task_name)
                wait_for_dispatcher(self.address, self.timeout_s)
                dataset_id = service.register_dataset(self.address, dataset,
                                                      dataset_id=self.job)
                self._registered = dataset_id, dataset.element_spec
            log.info("training input from the tf.data service at %s, job %s (dynamic "
                     "sharding)", self.address, self.job)
        return self._registered


# -- the servers --------------------------------------------------------------------------


def serve_dispatcher(port: int, work_dir: str | None) -> service.DispatchServer:
    """A dispatcher; with `work_dir`, fault-tolerant: it journals its state there and a
    dispatcher restarted on the same directory and port picks up the jobs it had."""
    config = service.DispatcherConfig(port=port, work_dir=work_dir,
                                      fault_tolerant_mode=bool(work_dir),
                                      worker_timeout_ms=WORKER_TIMEOUT_MS)
    return service.DispatchServer(config)


def serve_worker(dispatcher: str, port: int, host: str) -> service.WorkerServer:
    """A tf.data worker: it registers with the dispatcher and runs the datasets it is given."""
    return service.WorkerServer(service.WorkerConfig(
        dispatcher_address=dispatcher.removeprefix("grpc://"), port=port,
        worker_address=f"{host}:%port%", heartbeat_interval_ms=HEARTBEAT_MS))


def watch(lead: str, label: str, stop: threading.Event, gone_s: float = GONE_S,
          poll_s: float = 1.0) -> int:
    """Serve while the run's lead training task (the chief, or worker 0) is there; the
    exit code. Under SLURM nothing else ends a tf.data service task: a job step
    lasts until its every task has ended. The lead's port closed for `gone_s` (or
    never open so long) means training is over: 0. A chief that failed for good
    says so on its port (app/cluster/chief_failure.py): its exit code, as its ps and
    workers exit."""
    last_seen = time.monotonic()
    while not stop.wait(poll_s):
        answered, said = chief_failure.ask(lead, label)
        if said is not None:
            error = chief_failure.failed(lead, said, label)
            log.error("%s", error)
            return error.exit_code
        if answered:
            last_seen = time.monotonic()
        elif time.monotonic() - last_seen > gone_s:
            log.info("the training tasks' lead at %s has not answered for %g s: training is "
                     "over; stopping", lead, gone_s)
            return 0
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m app.distribute.data_service",
                                     description=__doc__.split("\n")[0])
    roles = parser.add_subparsers(dest="role", required=True)
    dispatcher = roles.add_parser("dispatcher", help="the dispatcher (one per service)")
    dispatcher.add_argument("--port", type=int, required=True)
    dispatcher.add_argument("--work-dir", help="journal here, to survive a restart "
                                               "(fault-tolerant mode); a shared directory")
    worker = roles.add_parser("worker", help="a tf.data worker (one per core or machine)")
    worker.add_argument("--dispatcher", required=True, help="the dispatcher's host:port")
    worker.add_argument("--port", type=int, default=0, help="0: any free port")
    worker.add_argument("--host", default="localhost",
                        help="the name trainers reach this worker by (the dispatcher gives it "
                             "to them)")
    for role in (dispatcher, worker):
        role.add_argument("--watch", metavar="HOST:PORT",
                          help="stop once the lead training task at HOST:PORT (the chief, "
                               "or worker 0) is gone, or with its code if it failed for good; "
                               "without it, serve until SIGTERM")
        role.add_argument("--gone-s", type=float, default=GONE_S, metavar="SECONDS",
                          help="with --watch: how long the lead's port must stay closed "
                               f"(default {GONE_S:g}; longer where a restarted lead takes "
                               "longer to come back, as a rescheduled pod may)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[{args.role}] %(message)s")
    stop = threading.Event()
    # A scheduler's SIGTERM is the end of the job: a server has nothing to save.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if args.role == "dispatcher":
        server = serve_dispatcher(args.port, args.work_dir)
    else:
        server = serve_worker(args.dispatcher, args.port, args.host)
    log.info("serving: %s", server.target if args.role == "dispatcher"
             else f"a worker of the dispatcher at {args.dispatcher}")
    if args.watch:
        return watch(args.watch, args.role, stop, gone_s=args.gone_s)
    stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
