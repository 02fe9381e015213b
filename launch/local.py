"""`python -m launch.local`: every task of a cluster as a process on this machine.

Each task is `python -m app.train` with its own TF_CONFIG (local ports the
launcher holds from their pick to its own exit, so that nothing else can take
one before its task binds it: launch/ports.py) and the remaining arguments; each
line it prints comes out prefixed with its task, `[ps:0]`, `[worker:1]`. The
launcher returns the exit code of the lead task: the chief, or worker 0 when
there are no ps (synchronous training). When the lead succeeds the others end by
themselves; when it fails they are stopped. Under parameter servers a worker
that dies early is left dead and the chief carries on without it; in synchronous
training all are stopped, and `--max-restarts` relaunches them. It relaunches
after any exit code but 2 (a configuration or storage error), 5 (a task out of
its memory limit, `--memory-limit-gib`, app/cluster/memory.py) and 6 (a trained
run whose export failed), which would fail again: 203 is a lost task, 204 a
preemption whose backup was saved (app/cluster/preemption.py). With
`--restart task` only the failed task is relaunched (each up to `--max-restarts`
times, 3 unless given), as Kubernetes restarts one pod (launch/processes.py),
and the others keep running. SIGTERM to the launcher itself (a scheduler
stopping the job) goes to every task, as if each had been preempted, and the
launcher exits with the lead's code, without relaunching.

    python -m launch.local --workers 2 --ps 1 --config configs/mnist_ps.toml
    python -m launch.local --workers 2 --ps 0 --config configs/mnist_sync.toml
    python -m launch.local --workers 2 --ps 1 --evaluator --config configs/mnist_ps.toml
    python -m launch.local --workers 2 --ps 1 --restart task --config configs/mnist_ps.toml
    python -m launch.local --workers 2 --ps 2 --memory-limit-gib 4 --config configs/mnist_ps.toml

With `--data-workers N` the training input runs in a tf.data service: a
dispatcher (journaling in the workdir) and N tf.data workers, processes of
their own started before the trainers and stopped after the lead; each is
relaunched alone if it dies (app/distribute/data_service.py, docs/data_service.md):

    python -m launch.local --workers 2 --ps 1 --data-workers 2 --config configs/mnist_ps.toml

With `--memory-limit-gib` (or runtime.memory_limit_gib in the config) the
launcher first runs `tools.plan`'s memory check of the cluster shape and starts
nothing if a task's predicted peak exceeds the limit (exit 2).

With `--link RATE[,DELAY]` the cluster runs in a private network namespace
where every task has a link of its own (launch/network.py says how, and what
such a link cannot shape); `--partition TASK@SECONDS[+DURATION]` then cuts a
task off the network for a while, without stopping it (needs root), or
`TASK@stepN[+DURATION]` once the chief has logged step N (`debug.log_every_steps`); after
a failure, the relaunched cluster (`--max-restarts`) runs without the cuts:

    python -m launch.local --workers 2 --ps 2 --link 1gbit --config configs/mnist_ps.toml
    python -m launch.local --workers 2 --ps 1 --link 10gbit,0.1ms --partition worker:1@40+30
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

from app import config as cfg
from app.state.workdir import default_path
from app.state.workdir import given as given_workdir
from launch import network
from launch.inprocess import cluster_spec
from launch.ports import Ports
from launch.processes import (
    NOT_RETRIED,
    PREEMPTED,
    DataProcess,
    Process,
    announce,
    exit_text,
    grace,
    not_retried,
    restart_alone,
    stop_data,
)

TASK_RESTARTS = 3  # --max-restarts under --restart task unless given
# Set by SIGTERM to the launcher itself: the scheduler or the machine is stopping
# the whole job. Every task is then sent SIGTERM too (training tasks save a backup,
# app/cluster/preemption.py) and nothing is relaunched.
_TERMINATED = threading.Event()


def _on_sigterm(signum, frame) -> None:
    _TERMINATED.set()


def intra_op_threads(num_workers: int) -> int:
    """Each task's share of this host's cores when `num_workers` workers share it."""
    return max(1, (os.cpu_count() or 1) // num_workers)


def thread_settings(num_workers: int, train_args: list[str]) -> list[str]:
    """`--set` thread pools so that the tasks sharing this host share its cores, and
    sleep rather than spin when idle, unless the arguments (`--set`, or the `--config`
    file) already choose them."""
    settings = {"runtime.intra_op_threads": intra_op_threads(num_workers),
                # Fewer than workers + 1 can deadlock a ps serving all workers at once.
                "runtime.inter_op_threads": num_workers + 1,
                # A pool that spins for its next op takes the cores from the tasks
                # beside it: never slower in the medians of docs/benchmarks.md, and
                # a little less CPU in make test (docs/testing.md).
                "runtime.thread_spinning": "false"}
    return cfg.unless_chosen(settings, train_args)


def start_tasks(args: argparse.Namespace, train_args: list[str]
                ) -> tuple[list[Process], network.Links | None]:
    """Pick the ports, give them links when asked (in this process's own network
    namespace), start every task; (the tasks, their links or None)."""
    host = task_host(args)
    spec = cluster_spec(args.workers, args.ps, args.ports, host)
    if args.evaluator:  # listed in the cluster, as Kubeflow does; it serves nothing
        spec["evaluator"] = args.ports.addresses(host, 1)
    links = None
    if args.link:
        links = network.Links(args.link, network.task_ports(spec), announce)
        announce(f"every task's port limited to {args.link_text} each way")
    tasks = data_tasks(args, host)  # first: the trainers wait for the dispatcher
    hear = links.heard if links and args.partitions else None
    tasks += [Process(job, i, spec, train_args, hear)
              for job in ("ps", "worker", "chief", "evaluator")
              for i in range(len(spec.get(job, ())))]
    if links:
        links.schedule(args.partitions, serving=task_labels(args),
                       lead="chief:0" if args.ps else "worker:0")
    return tasks, links


def task_host(args: argparse.Namespace) -> str:
    """The host every task listens on: the namespace's address with --link."""
    return network.HOST if args.link else "localhost"


def data_tasks(args: argparse.Namespace, host: str) -> list[Process]:
    """With --data-workers N: the tf.data service's dispatcher, journaling in the
    workdir (fault-tolerant), and N tf.data workers, each on a port of its own that
    a restart keeps, as a pod's address stays."""
    if not args.data_workers:
        return []
    dispatcher = f"{host}:{args.dispatcher_port}"
    tasks = [DataProcess("dispatcher", 0, {}, ["dispatcher", "--port", str(args.dispatcher_port),
                                             "--work-dir", str(args.workdir / "data_service")])]
    return tasks + [DataProcess("data_worker", i, {}, [
        "worker", "--dispatcher", dispatcher, "--host", host, "--port", str(port)])
        for i, port in enumerate(args.data_worker_ports)]


def close_links(links: network.Links | None) -> None:
    """Stop the links' scheduled cuts and report the bytes each task's link carried."""
    if links:
        links.cancel()
        announce(f"bytes through each task's link: {links.report()}")


def run_cluster(args: argparse.Namespace, train_args: list[str]) -> tuple[int, bool]:
    """Start every task, wait for the lead one; (its exit code, whether a worker failed).

    The lead task is the chief, or worker 0 of a cluster without ps. Under
    parameter servers a dead worker is the coordinator's business; in
    synchronous training it stalls the others, so all are stopped.
    """
    tasks, links = start_tasks(args, train_args)
    lead = lead_task(args, tasks)
    synchronous = not args.ps
    failed = None
    restarts: dict[str, int] = {}
    try:
        while lead.process.poll() is None and failed is None and not _TERMINATED.is_set():
            time.sleep(0.5)
            relaunch_data(tasks, restarts)
            if synchronous:
                failed = next((t for t in tasks if t.process.poll() not in (None, 0)), None)
    except KeyboardInterrupt:
        for task in tasks:
            task.stop()
        for task in tasks:
            task.finish()
        raise
    finally:
        close_links(links)
    if failed is not None:
        announce(f"{failed.label} exited with {exit_text(failed.process.returncode)}; "
                 "stopping the others")
    code = lead.process.poll()
    others = [t for t in tasks if t is not lead]
    finished = failed is None and code == 0 and not _TERMINATED.is_set()
    if _TERMINATED.is_set():
        announce("SIGTERM: passing it to every task (training tasks save a backup); "
                 "no restart")
        for task in tasks:
            task.stop()
        code = lead.finish()  # first: ps tasks serve the chief until it has saved
        announce(f"{lead.label} exited with {exit_text(code)}")
    elif finished:  # the others see the run end and exit by themselves
        announce(f"{lead.label} exited with 0; waiting for the other tasks to finish")
        stop_data(tasks)
    else:
        if failed is None:
            announce(f"{lead.label} exited with {exit_text(code)}; stopping the other tasks")
        # Synchronous workers whose peer died wait for it inside an all-reduce and never
        # reach the step boundary where SIGTERM is acted on; after a preemption (204) they
        # are saving the backup with it.
        now = failed is not None and failed.process.returncode != PREEMPTED
        for task in tasks:
            task.stop(now)
    for task in others:
        exited = task.finish(grace(task, lead_finished=finished))
        if task is not failed:  # announced already
            announce(f"{task.label} exited with {exit_text(exited)}")
    code = lead.finish()
    if failed is not None and failed is not lead:
        announce(f"{lead.label} exited with {exit_text(code)}")
        # The failed task's reason (a preempted worker's 204); a death by signal is 1.
        code = max(failed.process.returncode, 0) or 1
    return code, failed is not None


def relaunch_data(tasks: list[Process], restarts: dict[str, int]) -> None:
    """Relaunch alone each tf.data service task that failed, up to TASK_RESTARTS times:
    it holds no training state (a dispatcher resumes from its journal), so the
    trainers need not stop for it. A task out of restarts stays dead: the trainers
    then read from the tf.data workers left, or stop on the service's error."""
    for i, task in enumerate(tasks):
        code = task.process.poll()
        if not task.serves_data or code in (None, 0) or restarts.get(task.label) == TASK_RESTARTS:
            continue
        restarts[task.label] = restarts.get(task.label, 0) + 1
        announce(f"{task.label} exited with {exit_text(code)}; restart "
                 f"{restarts[task.label]} of {TASK_RESTARTS}: {task.label} alone")
        tasks[i] = task.again()


def lead_task(args: argparse.Namespace, tasks: list[Process]) -> Process:
    """The task whose exit is the job's: the chief, or worker 0 without ps."""
    return next(t for t in tasks if t.label == ("chief:0" if args.ps else "worker:0"))


def run_alone(args: argparse.Namespace, train_args: list[str]) -> int:
    """`--restart task`: start every task, relaunch each that fails alone (see
    launch/processes.py); the exit code."""
    tasks, links = start_tasks(args, train_args)
    try:
        return restart_alone(tasks, lead_task(args, tasks), args.max_restarts, _TERMINATED)
    finally:
        close_links(links)


def task_labels(args: argparse.Namespace) -> list[str]:
    """The tasks that serve (all but the evaluator): "chief:0", "worker:0", ..."""
    labels = ["chief:0"] if args.ps else []
    labels += [f"worker:{i}" for i in range(args.workers)]
    return labels + [f"ps:{i}" for i in range(args.ps)]


def check_memory(args: argparse.Namespace, train_args: list[str]) -> int:
    """When the tasks' config sets runtime.memory_limit_gib, `tools.plan`'s check of
    this cluster shape against it, in a process of its own (it builds the model,
    which the launcher should not hold while the tasks run); 0, or 2 with the
    plan's error printed when a task's predicted peak exceeds the limit."""
    path, overrides = cfg.sources(train_args)
    try:
        limit = cfg.load(path, overrides).runtime.memory_limit_gib
    except cfg.ConfigError:
        return 0  # every task reports it, with exit code 2
    if not limit:
        return 0
    command = [sys.executable, "-m", "tools.plan", "--ps", str(args.ps),
               "--workers", str(args.workers)]
    command += [arg for s in overrides for arg in ("--set", s)]
    command += ["--config", path] if path else []
    done = subprocess.run(command, capture_output=True, text=True,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    if done.returncode:
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        print("\n".join(errors) or done.stderr, file=sys.stderr, flush=True)
        return done.returncode
    lines = done.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("predicted peak memory"))
    announce(f"predicted peak memory per task, each within runtime.memory_limit_gib = "
             f"{limit:g} GiB: {', '.join(' '.join(line.split()) for line in lines[first + 1:])}")
    return 0


def parse_network(args: argparse.Namespace) -> None:
    """Read --link and --partition into args.link (a Link or None), args.link_text
    and args.partitions; ValueError naming the flag and the fix."""
    args.link_text, args.partitions = args.link, []
    if args.partition and not args.link:
        raise ValueError("--partition needs --link: a partition cuts a task's link, and "
                         "tasks have links only with --link (e.g. --link 10gbit)")
    args.link = network.parse_link(args.link) if args.link else None
    # Not the evaluator: it reads checkpoints from the workdir, not the network.
    args.partitions = [network.parse_partition(p, task_labels(args)) for p in args.partition]


def enter_network(argv: list[str]) -> int | None:
    """With --link: re-run the launcher in a network namespace of its own (its exit
    code), or set up that namespace when this is it (None); 2 when links cannot be made."""
    try:
        if network.inside():
            network.setup_loopback()
            return None
        problem = network.preflight()
        if problem:
            raise network.NetworkError(problem)
    except network.NetworkError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return network.run_in_namespace(["-m", "launch.local", *argv])


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's own flags, checked (exit 2 naming the flag), and app.train's."""
    parser = argparse.ArgumentParser(prog="python -m launch.local",
                                     description=__doc__.split("\n")[0],
                                     epilog="Other arguments go to app.train, e.g. --config.")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=1,
                        help="parameter servers (0: synchronous training, workers only)")
    parser.add_argument("--evaluator", action="store_true",
                        help="also run an evaluator task: SidecarEvaluator on the checkpoints")
    parser.add_argument("--max-restarts", type=int, metavar="N",
                        help="relaunch up to N times after a failure, whatever its exit code "
                             f"but {not_retried()}, which would fail again; training resumes "
                             "from the workdir's backup. Default: 0 with --restart job, 3 "
                             "with --restart task")
    parser.add_argument("--restart", choices=("job", "task"), default="job",
                        help="what a failure relaunches: every task (job, like torchrun; the "
                             "default) or the failed task alone, with its TF_CONFIG and port "
                             "(task, as Kubernetes restarts one pod; needs --ps 1 or more), "
                             "each task up to --max-restarts times")
    parser.add_argument("--link", metavar="RATE[,DELAY]",
                        help="give every task a link of its own, RATE each way plus DELAY "
                             "(e.g. 1gbit, 10gbit,0.1ms), in a private network namespace; "
                             "needs root and iproute2")
    parser.add_argument("--partition", action="append", default=[],
                        metavar="TASK@SECONDS[+DURATION]",
                        help="with --link: cut TASK off the network SECONDS after every task "
                             "serves, for DURATION seconds or to the end (e.g. worker:1@40+30), "
                             "or once the chief (worker 0 without ps) logs step N, "
                             "TASK@stepN[+DURATION] (with debug.log_every_steps); a relaunch "
                             "after a failure runs without it")
    parser.add_argument("--data-workers", type=int, default=0, metavar="N",
                        help="run the training input pipelines in a tf.data service: a "
                             "dispatcher and N tf.data workers, each a process of its own "
                             "(sets data.service; app/distribute/data_service.py)")
    parser.add_argument("--memory-limit-gib", type=float, metavar="GIB",
                        help="limit every task's memory to GIB (runtime.memory_limit_gib, "
                             "app/cluster/memory.py); the cluster is not started if tools.plan "
                             "predicts a task's peak above it")
    args, train_args = parser.parse_known_args(argv)
    if args.max_restarts is None:  # naming a restart policy asks for restarts
        args.max_restarts = TASK_RESTARTS if args.restart == "task" else 0
    if args.workers < 1 or args.ps < 0 or args.max_restarts < 0 or args.data_workers < 0:
        parser.error("--workers must be at least 1, --ps, --max-restarts and --data-workers "
                     "at least 0")
    if args.restart == "task" and not args.ps:
        parser.error("--restart task needs parameter servers (--ps 1 or more): synchronous "
                     "workers all-reduce every step, so one restarted alone finds its peers "
                     "gone; use --restart job")
    try:
        parse_network(args)
    except ValueError as e:
        parser.error(str(e))
    return args, train_args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, train_args = parse_args(argv)
    if args.link and (code := enter_network(argv)) is not None:
        return code
    if args.memory_limit_gib is not None:  # the tasks' own flag, so that each applies it
        train_args += ["--set", f"runtime.memory_limit_gib={args.memory_limit_gib}"]
    if code := check_memory(args, train_args):  # before any task starts
        return code
    workdir = given_workdir(train_args)
    if workdir is None:  # one workdir for all tasks: the backup is shared
        workdir = str(default_path())
        train_args += ["--workdir", workdir]
    args.ports = Ports()  # every port handed to a task, held until the launcher exits
    with args.ports:
        if args.data_workers:  # ports kept by every relaunch: a dispatcher resumes its journal
            args.workdir = pathlib.Path(workdir)
            args.dispatcher_port = args.ports.take()
            args.data_worker_ports = [args.ports.take() for _ in range(args.data_workers)]
            train_args += ["--set", f"data.service={task_host(args)}:{args.dispatcher_port}"]
        train_args = thread_settings(args.workers, train_args) + train_args
        _TERMINATED.clear()
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            return (run_alone if args.restart == "task" else run_job)(args, train_args)
        finally:
            signal.signal(signal.SIGTERM, previous)


def run_job(args: argparse.Namespace, train_args: list[str]) -> int:
    """`--restart job`: run the cluster, and relaunch all of it after a failure, up to
    `--max-restarts` times; the exit code."""
    for attempt in range(args.max_restarts + 1):
        if attempt:
            announce(f"restart {attempt} of {args.max_restarts}")
            if args.partitions:  # an event of the job, not of each attempt
                announce("the relaunched cluster runs without the --partition cuts")
                args.partitions = []
        code, _ = run_cluster(args, train_args)
        if code in NOT_RETRIED or _TERMINATED.is_set():
            return code
    return code


if __name__ == "__main__":
    sys.exit(main())
