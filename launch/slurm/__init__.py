"""`python -m launch.slurm`: turn one task of a SLURM job step into a TF_CONFIG task.

Run under `srun`, one task per node or several (see `launch/slurm/train.sbatch`).
From SLURM's environment each task works out every task's address and its own
role, sets TF_CONFIG and becomes `python -m app.train` with the remaining
arguments. The nodes come from SLURM_STEP_NODELIST and how many tasks each
runs from SLURM_STEP_TASKS_PER_NODE (the job's variables outside a step); the
tasks of a node listen on `--port` + their SLURM_LOCALID. Ranks are numbered
node by node (SLURM's block distribution, srun's default), so rank order is
address order:

- with `--ps N` (N > 0): rank 0 is the chief, ranks 1..N the ps tasks, the
  rest workers (parameter-server training);
- with `--ps 0`: every rank is a worker (synchronous training; rank 0 writes);
- with `--data-workers N`, the last N + 1 ranks are not TF tasks but the
  tf.data service (app/distribute/data_service.py): its dispatcher, then N tf.data workers.

TensorFlow's `SlurmClusterResolver` does the same mapping, but it cannot run
on CPU-only nodes: with no GPU it computes `range(0, 0, 0)` and fails
(tensorflow/python/distribute/cluster_resolver/slurm_cluster_resolver.py,
`cluster_spec`), and it orders jobs by name, not chief first. Hence this module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


class SlurmError(ValueError):
    """SLURM's environment is missing or does not fit the requested cluster."""


def hostnames(nodelist: str) -> list[str]:
    """Expand SLURM's compressed node list: 'n[01-03,07],gpu5' -> n01 n02 n03 n07 gpu5."""
    hosts = []
    for prefix, ranges in re.findall(r"([^,\[]+)(?:\[([^\]]*)\])?,?", nodelist):
        if not ranges:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            m = _RANGE.match(part)
            if not m:
                raise SlurmError(f"cannot read the node range {part!r} in {nodelist!r}")
            first, last = m[1], m[2] or m[1]
            hosts += [f"{prefix}{i:0{len(first)}d}" for i in range(int(first), int(last) + 1)]
    return hosts


def tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM's tasks-per-node list: '2(x3),1' -> [2, 2, 2, 1]."""
    counts = []
    for part in spec.split(","):
        m = re.match(r"^(\d+)(?:\(x(\d+)\))?$", part)
        if not m:
            raise SlurmError(f"cannot read the tasks-per-node entry {part!r} in {spec!r}")
        counts += [int(m[1])] * int(m[2] or 1)
    return counts


def _var(env: Mapping[str, str], *names: str) -> str:
    for name in names:
        if env.get(name):
            return env[name]
    raise SlurmError(f"{names[0]} is not set: run this under srun, inside a SLURM allocation "
                     "(see launch/slurm/train.sbatch)")


def _check_block_distribution(env: Mapping[str, str], rank: int, addresses: list[str],
                              hosts: list[str], port: int) -> None:
    """This task's own address, from its node and local id, must be its rank's.

    Under another distribution (`srun -m cyclic`) rank r is not the r-th address
    in node order, and two tasks would claim one port."""
    node, local = env.get("SLURM_NODEID"), env.get("SLURM_LOCALID")
    if node is None or local is None or not 0 <= int(node) < len(hosts):
        return  # an older SLURM, or a hand-made environment: trust the rank
    own = f"{hosts[int(node)]}:{port + int(local)}"
    if rank < len(addresses) and addresses[rank] != own:
        raise SlurmError(f"SLURM_PROCID {rank} on node {node} with SLURM_LOCALID {local} "
                         f"listens on {own}, but rank {rank}'s address in node order is "
                         f"{addresses[rank]}: run srun with --distribution=block")


def addresses_of(env: Mapping[str, str], port: int) -> tuple[int, list[str]]:
    """(this task's rank, every task's host:port in rank order)."""
    rank = int(_var(env, "SLURM_PROCID"))
    hosts = hostnames(_var(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"))
    counts = tasks_per_node(_var(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    if len(counts) != len(hosts):
        raise SlurmError(f"{len(hosts)} nodes but tasks-per-node lists {len(counts)}")
    # Tasks sharing a node get consecutive ports: the i-th listens on port + i, i
    # being its SLURM_LOCALID.
    addresses = [f"{host}:{port + i}" for host, n in zip(hosts, counts, strict=True)
                 for i in range(n)]
    _check_block_distribution(env, rank, addresses, hosts, port)
    return rank, addresses


def data_service(env: Mapping[str, str], port: int, data_workers: int,
                 workdir: str) -> tuple[str, list[str] | None]:
    """With `data_workers` N: the last N + 1 ranks are the tf.data service, its
    dispatcher and then its N tf.data workers. (The dispatcher's host:port, this
    task's `app.distribute.data_service` arguments or None for a training task.)"""
    rank, addresses = addresses_of(env, port)
    if len(addresses) < data_workers + 2:
        raise SlurmError(f"--data-workers {data_workers} needs {data_workers + 1} SLURM tasks "
                         f"for the service besides the training tasks, the step has "
                         f"{len(addresses)}; ask sbatch for more tasks (--ntasks)")
    first = len(addresses) - data_workers - 1
    dispatcher = addresses[first]
    if rank < first:
        return dispatcher, None
    # Rank 0 leads training (the chief, or worker 0): the service ends with it.
    if rank == first:
        return dispatcher, ["dispatcher", "--port", str(port_of(dispatcher)),
                            "--work-dir", f"{workdir}/data_service", "--watch", addresses[0]]
    own = addresses[rank]
    return dispatcher, ["worker", "--dispatcher", dispatcher, "--port", str(port_of(own)),
                        "--host", own.rpartition(":")[0], "--watch", addresses[0]]


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def tf_config(env: Mapping[str, str], num_ps: int, port: int, data_workers: int = 0) -> dict:
    """The TF_CONFIG of the SLURM task described by `env`; the last `data_workers` + 1
    ranks (the tf.data service, if any) are not in its cluster."""
    rank, addresses = addresses_of(env, port)
    if data_workers:
        addresses = addresses[:len(addresses) - data_workers - 1]
    if num_ps and len(addresses) < num_ps + 2:
        raise SlurmError(f"--ps {num_ps} needs at least {num_ps + 2} SLURM tasks (a chief, "
                         f"the ps tasks and a worker), the step has {len(addresses)}; "
                         "ask sbatch for more nodes or lower --ps")
    if num_ps:
        cluster = {"chief": addresses[:1], "ps": addresses[1:1 + num_ps],
                   "worker": addresses[1 + num_ps:]}
    else:
        cluster = {"worker": addresses}
    start = 0
    for job, members in cluster.items():
        if rank < start + len(members):
            return {"cluster": cluster, "task": {"type": job, "index": rank - start}}
        start += len(members)
    raise SlurmError(f"SLURM_PROCID {rank} is outside the step's {len(addresses)} tasks")


def thread_settings(env: Mapping[str, str], config: dict, train_args: list[str]) -> list[str]:
    """`--set` thread pools as launch.local chooses them, unless the arguments (`--set`,
    or the `--config` file) already choose them.

    Without cgroups a task sees every core of its node and TensorFlow would size
    its op pool for all of them, in each of the node's tasks: one op's threads
    are the task's SLURM_CPUS_PER_TASK instead. Fewer than workers + 1 ops at once
    can deadlock a ps serving every worker (as in launch.local). And the tasks that
    share a node sleep rather than spin when idle, as launch.local's tasks do: a
    pool spinning for its next op takes a core from a task beside it."""
    from app import config as cfg

    settings = {"runtime.inter_op_threads": len(config["cluster"].get("worker", [])) + 1}
    if env.get("SLURM_CPUS_PER_TASK", "").isdigit():
        settings["runtime.intra_op_threads"] = int(env["SLURM_CPUS_PER_TASK"])
    if _shares_its_node(env):
        settings["runtime.thread_spinning"] = "false"
    return cfg.unless_chosen(settings, train_args)


def _shares_its_node(env: Mapping[str, str]) -> bool:
    """Whether another task of the step runs on this task's node: a training task, or
    the tf.data service's (which the cluster leaves out)."""
    rank, addresses = addresses_of(env, 0)
    hosts = [address.rpartition(":")[0] for address in addresses]
    return hosts.count(hosts[rank]) > 1


def _workdir(train_args: list[str]) -> str:
    """The trainers' `--workdir`: the dispatcher journals in `<workdir>/data_service`."""
    from app.state import workdir

    found = workdir.given(train_args)
    if not found:
        raise SlurmError("--data-workers needs the run's --workdir (the dispatcher journals "
                         "in <workdir>/data_service, where a restarted one finds its jobs): "
                         "pass --workdir DIR, as train.sbatch does")
    return found


def main(argv: list[str] | None = None) -> int:
    import argparse
    import os
    import sys

    parser = argparse.ArgumentParser(prog="python -m launch.slurm",
                                     description=__doc__.split("\n")[0],
                                     epilog="Other arguments go to app.train.")
    parser.add_argument("--ps", type=int, default=1, help="parameter servers (0: synchronous)")
    parser.add_argument("--port", type=int, default=2222,
                        help="gRPC port of each node's first task; the others' follow it")
    parser.add_argument("--data-workers", type=int, default=0, metavar="N",
                        help="the last N + 1 tasks run a tf.data service (a dispatcher, N "
                             "tf.data workers) that the others read their training input from")
    parser.add_argument("--dry-run", action="store_true",
                        help="print TF_CONFIG and the command instead of running it")
    args, train_args = parser.parse_known_args(argv)
    try:
        service, config = None, None
        if args.data_workers:
            dispatcher, service = data_service(os.environ, args.port, args.data_workers,
                                               _workdir(train_args))
            train_args = [*train_args, "--set", f"data.service={dispatcher}"]
        if service is None:
            config = tf_config(os.environ, args.ps, args.port, args.data_workers)
    except SlurmError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if service is not None:
        command = [sys.executable, "-m", "app.distribute.data_service", *service]
    else:
        command = [sys.executable, "-m", "app.train",
                   *thread_settings(os.environ, config, train_args), *train_args]
    if args.dry_run:
        print(json.dumps({"TF_CONFIG": config, "command": command[1:]}))
        return 0
    if config is not None:
        os.environ["TF_CONFIG"] = json.dumps(config)
    os.execv(sys.executable, command)
    return 0  # not reached
