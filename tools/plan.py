"""`python -m tools.plan`: where a config's variables would live on N ps tasks, and
the bytes each ps task would send and receive per training step, without a cluster.

    python -m tools.plan --config configs/mnist_ps.toml --ps 2

The model and optimizer are built locally while every variable creation is
recorded in order; ParameterServerStrategy's rules are then applied to that
order: each variable (each shard of a partitioned one) goes to the next ps task
round-robin, and optimizer slots sit with their variable. A test checks the
prediction against the placement of a real in-process cluster.

Per step, a worker reads every trainable variable from its ps task and sends a
gradient of the same size back (half the size with ps.compression = fp16);
optimizer slots never leave the ps. A variable the task reads by lookup (an
embedding table, `Task.lookup_rows`) moves only the rows a batch of
train.global_batch_size looks up, and the ids of those rows with them.

With `--link RATE` those bytes become a lower bound on the time of a training
step: every task has a full-duplex link of RATE, so each direction of each
link is a limit of its own; and a worker's step reads before it pushes, so
its read and push times add up (`step_time_bound`). `launch.local --link`
gives a local cluster such links, limiting what each task sends:

    python -m tools.plan --config configs/mnist_ps.toml --ps 2 --workers 2 --link 1gbit

Without `--ps`, under a memory limit (`--memory-limit-gib`, or the config's
runtime.memory_limit_gib), the plan is for the fewest ps tasks every task fits in:

    python -m tools.plan --config configs/recommender_large.toml --memory-limit-gib 2

With `--ps 0` the plan is MultiWorkerMirrored's instead: no ps, and each
worker sends (and receives) its part of a ring all-reduce of the gradients
every step (`allreduce_bytes`); with `--link` that too becomes a bound:

    python -m tools.plan --config configs/mnist_sync.toml --ps 0 --workers 2 --link 100mbit
"""

from __future__ import annotations

import argparse
import sys

from app import config as cfg
from app.planning import memory as plan_memory
from app.planning.model import Traffic, allreduce_bytes, build, link_loads, place, step_time_bound
from app.units import human_size


def print_bound(traffic: Traffic, num_workers: int, link_text: str, rate_bits: float) -> None:
    """The per-link times of one step and the bound they set."""
    print(f"over a {link_text} link per task (each direction on its own: links are full "
          f"duplex), per training step of the cluster, {num_workers} worker(s) sharing them:")
    for load in link_loads(traffic, num_workers):
        print(f"  {load.task:<12} {load.direction:<8} {human_size(round(load.nbytes)):>10}  "
              f"{load.nbytes * 8 / rate_bits * 1000:8.1f} ms")
    seconds, binding = step_time_bound(traffic, num_workers, rate_bits)
    print(f"lower bound on the step time: {seconds * 1000:.1f} ms, set by {binding} "
          f"(at most {1 / seconds:.1f} steps/s across the workers)")


def print_allreduce(config: cfg.Config, num_workers: int, link_text: str | None,
                    rate_bits: float | None) -> None:
    """MultiWorkerMirrored's bytes per step, and over `link_text` the bound they set."""
    nbytes = allreduce_bytes(config, num_workers)
    print(f"MultiWorkerMirrored, {num_workers} worker(s), sync.compression = "
          f"{config.sync.compression}: each worker sends and receives "
          f"{human_size(round(nbytes))} per training step (ring all-reduce)")
    if rate_bits:
        seconds = nbytes * 8 / rate_bits
        print(f"over a {link_text} link per task: lower bound on the step time "
              f"{seconds * 1000:.1f} ms, set by each worker's all-reduce "
              f"(at most {1 / seconds:.1f} steps/s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.plan",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--config")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--ps", type=int,
                        help="number of ps tasks; 0: MultiWorkerMirrored's all-reduce. Left "
                             "out under a memory limit: the fewest that fit")
    parser.add_argument("--workers", type=int, default=2,
                        help="workers sharing the steps (for --link)")
    parser.add_argument("--link", metavar="RATE",
                        help="each task's link, e.g. 1gbit: the least time a step can take")
    parser.add_argument("--memory-limit-gib", type=float, metavar="GIB",
                        help="same as --set runtime.memory_limit_gib=GIB: exit 2 if a task's "
                             "predicted peak memory exceeds it")
    args = parser.parse_args(argv)
    if args.memory_limit_gib is not None:
        args.set.append(f"runtime.memory_limit_gib={args.memory_limit_gib}")
    try:
        config = cfg.load(args.config, args.set)
        limit = config.runtime.memory_limit_gib
        if args.ps is None and not limit:
            raise cfg.ConfigError("--ps N: the number of ps tasks to plan for (0: "
                                  "MultiWorkerMirrored), or --memory-limit-gib GIB for the "
                                  "fewest that fit")
        if args.ps is not None and args.ps < 0:
            raise cfg.ConfigError(f"--ps {args.ps}: need 0 (MultiWorkerMirrored) or more")
        if args.workers < 1:
            raise cfg.ConfigError(f"--workers {args.workers}: need at least 1 worker")
        rate_bits = _link_rate(args.link)
        built = build(config)
        if args.ps is None:
            args.ps = plan_memory.fewest_ps(built, args.workers, limit, place)
            print(f"{args.ps} ps task(s) fit runtime.memory_limit_gib = {limit:g} GiB with "
                  f"{args.workers} worker(s) (--ps {args.ps}):")
        placement, traffic = place(built, args.ps) if args.ps else (None, None)
        peaks = plan_memory.check(built, args.ps, args.workers, limit, place,
                                  placed=(placement, traffic))
        if args.ps == 0:
            print_allreduce(config, args.workers, args.link, rate_bits)
            print("\n".join(plan_memory.report(peaks, limit)))
            return 0
    except (cfg.ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"ps.partitioner = {config.ps.partitioner}")
    print("\n".join(placement.report()))
    print("per training step (one batch on one worker):")
    for i in range(args.ps):
        print(f"  ps:{i}  sends {human_size(traffic.sent_bytes[i]):>10} (variables), "
              f"receives {human_size(traffic.written_bytes[i]):>10} (gradients)")
    if any(traffic.index_bytes):
        print(f"  tables read by lookup move only the rows a batch of "
              f"{config.train.global_batch_size} looks up (its expected distinct ids), "
              "with an int64 id per row each way")
    if rate_bits:
        print_bound(traffic, args.workers, args.link, rate_bits)
    print("\n".join(plan_memory.report(peaks, limit)))
    return 0


def _link_rate(text: str | None) -> float | None:
    """Bits per second of `--link`, read as `launch.local --link` reads it."""
    if text is None:
        return None
    from launch.network import parse_link  # the launcher's own parser: one syntax for both

    return parse_link(text).rate_bits


if __name__ == "__main__":
    sys.exit(main())
