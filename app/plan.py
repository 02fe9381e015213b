"""`python -m app.plan`: where a config's variables would live on N ps tasks, and
the bytes each ps task would send and receive per training step, without a cluster.

    python -m app.plan --config configs/mnist_ps.toml --ps 2

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
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from app import config as cfg
from app.parameter_server import Placement, Shard, base_name, human_size


@dataclasses.dataclass(frozen=True)
class Traffic:
    read_bytes: list[int]  # ps -> worker per step: the trainable variables
    gradient_scale: float = 1.0  # gradient bytes per variable byte: 0.5 when sent as float16
    # worker -> ps per step besides gradient values: for tables read by lookup, the
    # int64 ids looked up and the indices of the gradient's rows (empty: none).
    index_bytes: list[int] = dataclasses.field(default_factory=list)

    @property
    def written_bytes(self) -> list[int]:
        """worker -> ps per step: the gradients (and the ids of the rows looked up)."""
        extra = self.index_bytes or [0] * len(self.read_bytes)
        return [round(n * self.gradient_scale) + e
                for n, e in zip(self.read_bytes, extra, strict=True)]


def predict(config: cfg.Config, num_ps: int) -> tuple[Placement, Traffic]:
    """The placement and per-step traffic of `config` on `num_ps` ps tasks."""
    import tensorflow as tf

    from app import parameter_server, trainer
    from app import task as tasks

    created: list[tf.Variable] = []

    def record(next_creator, **kwargs):
        var = next_creator(**kwargs)
        created.append(var)
        return var

    task, config = tasks.create(config)
    with tf.variable_creator_scope(record):
        model = task.build_model()
        optimizer = trainer.optimizer(config, task, steps_per_epoch=1)
        optimizer.build(model.trainable_variables)
    partitioner = parameter_server.partitioner(config.ps, num_ps)
    trainable = {id(v) for v in model.trainable_variables}
    slots = _slots(optimizer, model.trainable_variables)
    reported = {id(v) for v in model.variables + optimizer.variables()}

    shards: list[Shard] = []
    read = [0] * num_ps
    index_bytes = [0] * num_ps
    lookup, batch = task.lookup_rows, config.train.global_batch_size
    tasks_of: dict[int, list[int]] = {}
    counter = 0
    for var in created:
        if id(var) in slots:
            continue
        tasks_of[id(var)] = []
        shard_rows = _shard_rows(var, partitioner)
        looked_up = lookup(var, shard_rows, batch) if id(var) in trainable else None
        for i, rows in enumerate(shard_rows):
            task = counter % num_ps
            counter += 1
            tasks_of[id(var)].append(task)
            shape = (rows, *var.shape[1:]) if var.shape.rank else ()
            nbytes = math.prod(shape) * var.dtype.size
            if id(var) in reported:
                shards.append(Shard(base_name(var.name), task, shape, nbytes))
            if id(var) in trainable and looked_up is not None:
                read[task] += round(looked_up[i] * nbytes / rows)  # the rows a batch reads
                index_bytes[task] += round(looked_up[i] * 2 * 8)  # their ids, there and back
            elif id(var) in trainable:
                read[task] += nbytes
    by_id = {id(v): v for v in created}
    for slot, primary in slots.items():
        var = by_id[slot]
        for task, rows in zip(tasks_of[primary], _shard_rows(var, partitioner), strict=True):
            shape = (rows, *var.shape[1:])
            shards.append(Shard(base_name(var.name), task, shape,
                                math.prod(shape) * var.dtype.size))
    scale = 0.5 if config.ps.compression == "fp16" else 1.0
    return Placement(num_ps, tuple(shards)), Traffic(read, scale, index_bytes)


def _slots(optimizer, variables) -> dict[int, int]:
    """id(slot) -> id(its variable): tf_keras names a slot "<slot>/<variable>"."""
    primaries = {v._shared_name: id(v) for v in variables}
    out = {}
    for var in optimizer.variables():
        _, sep, rest = var.name.removesuffix(":0").partition("/")
        if sep and rest in primaries:
            out[id(var)] = primaries[rest]
    return out


def _shard_rows(var, partitioner) -> list[int]:
    """Rows (first axis) of each shard, as ParameterServerStrategy splits them."""
    if partitioner is None or not var.shape.rank:
        return [var.shape[0] if var.shape.rank else 1]
    num = partitioner(var.shape, var.dtype)[0]
    rows = var.shape[0]
    return [rows // num + (1 if i < rows % num else 0) for i in range(num)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m app.plan", description=__doc__.split("\n")[0])
    parser.add_argument("--config")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--ps", type=int, required=True, help="number of ps tasks")
    args = parser.parse_args(argv)
    try:
        config = cfg.load(args.config, args.set)
        if args.ps < 1:
            raise cfg.ConfigError(f"--ps {args.ps}: need at least 1 ps task")
        placement, traffic = predict(config, args.ps)
    except cfg.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"ps.partitioner = {config.ps.partitioner}")
    print("\n".join(placement.report()))
    print("per training step (one batch on one worker):")
    for i in range(args.ps):
        print(f"  ps:{i}  sends {human_size(traffic.read_bytes[i]):>10} (variables), "
              f"receives {human_size(traffic.written_bytes[i]):>10} (gradients)")
    if any(traffic.index_bytes):
        print(f"  tables read by lookup move only the rows a batch of "
              f"{config.train.global_batch_size} looks up (its expected distinct ids), "
              "with an int64 id per row each way")
    return 0


if __name__ == "__main__":
    sys.exit(main())
