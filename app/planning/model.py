"""A config's model built on paper (`build`), without a cluster: where its variables
would live on N ps tasks and the bytes each ps task would send and receive per
training step (`place`, `Traffic`); `step_time_bound` and `allreduce_bytes` turn
bytes into the least time a step can take. `python -m tools.plan` prints it (its
docstring says how the prediction is made); `launch.local` and the evaluator's
memory check (`planning.memory`) use it before anything starts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from app import config as cfg
from app.distribute.ps.variables import Placement, Shard, base_name


@dataclasses.dataclass(frozen=True)
class Traffic:
    read_bytes: list[int]  # ps -> worker per step: the trainable variables
    gradient_scale: float = 1.0  # gradient bytes per variable byte: 0.5 when sent as float16
    # worker -> ps per step besides gradient values: for tables read by lookup, the
    # int64 ids looked up and the indices of the gradient's rows (empty: none).
    index_bytes: list[int] = dataclasses.field(default_factory=list)
    # Per ps task, the bytes of the trainable shards it holds, whole (tables too).
    trainable_bytes: list[int] = dataclasses.field(default_factory=list)
    # Per ps task, the bytes of `read_bytes` that cross as float16, at half their size
    # (ps.read_compression = fp16: the float32 variables read whole; empty: none).
    halved_bytes: list[int] = dataclasses.field(default_factory=list)

    @property
    def sent_bytes(self) -> list[int]:
        """ps -> worker per step, as the bytes cross: `read_bytes`, less half of
        `halved_bytes`."""
        halved = self.halved_bytes or [0] * len(self.read_bytes)
        return [n - h // 2 for n, h in zip(self.read_bytes, halved, strict=True)]

    @property
    def written_bytes(self) -> list[int]:
        """worker -> ps per step: the gradients (and the ids of the rows looked up)."""
        extra = self.index_bytes or [0] * len(self.read_bytes)
        return [round(n * self.gradient_scale) + e
                for n, e in zip(self.read_bytes, extra, strict=True)]


@dataclasses.dataclass(frozen=True)
class Built:
    """A config's model and optimizer, built locally, and every variable in the
    order it was created: what `place` spreads over any number of ps tasks."""
    config: cfg.Config
    task: Any
    model: Any
    optimizer: Any
    created: list
    dialect: Any = None  # app.dialects' module of the model's Keras


def build(config: cfg.Config) -> Built:
    """Build `config`'s model and optimizer, recording every variable's creation."""
    import tensorflow as tf

    from app import dialects, tf_internal
    from app import task as tasks
    from app.run import optimizers

    created: list[tf.Variable] = []

    def record(next_creator, **kwargs):
        # A large variable has no memory behind it, so that a model larger than this
        # machine plans (Keras' optimizers still make each slot's initial value, one
        # at a time, before asking); small ones keep their values, which Keras reads.
        large = _large(kwargs)
        var = (tf_internal.uninitialized_variable(*large, kwargs.get("name"),
                                                  kwargs.get("trainable"))
               if large else next_creator(**kwargs))
        created.append(var)
        return var

    task, config = tasks.create(config)
    with tf.variable_creator_scope(record):
        model = task.build_model()
        dialect = dialects.of(model, task)
        optimizer = optimizers.optimizer(config, task, steps_per_epoch=1, dialect=dialect)
        optimizer.build(model.trainable_variables)
    return Built(config, task, model, optimizer, created, dialect)


def _large(kwargs: dict) -> tuple | None:
    """(shape, dtype) of what a variable creator's arguments ask for, if 1 MiB or more."""
    import tensorflow as tf

    value = kwargs.get("initial_value")
    shape = tf.TensorShape(kwargs.get("shape"))
    if not shape.is_fully_defined():
        shape = tf.TensorShape(getattr(value, "shape", None))
    dtype = kwargs.get("dtype") or getattr(value, "dtype", None)
    if dtype is None or not shape.is_fully_defined():
        return None
    dtype = tf.as_dtype(dtype)
    return (shape, dtype) if shape.num_elements() * dtype.size >= 1 << 20 else None


def predict(config: cfg.Config, num_ps: int) -> tuple[Placement, Traffic]:
    """The placement and per-step traffic of `config` on `num_ps` ps tasks."""
    return place(build(config), num_ps)


def place(built: Built, num_ps: int) -> tuple[Placement, Traffic]:
    """The placement and per-step traffic of the built model on `num_ps` ps tasks."""
    from app.distribute.ps import variables as ps_variables

    config, task, model, created = built.config, built.task, built.model, built.created
    partitioner = ps_variables.partitioner(config.ps, num_ps)
    variable = built.dialect.tf_variable
    trainable = {id(variable(v)) for v in model.trainable_variables}
    every = built.dialect.variables(model, built.optimizer)
    slots = built.dialect.slots(model, built.optimizer)
    reported = {id(v) for v in every}

    shards: list[Shard] = []
    read = [0] * num_ps
    index_bytes = [0] * num_ps
    trainable_bytes = [0] * num_ps
    lookup, batch = task.lookup_rows, config.train.global_batch_size
    tasks_of: dict[int, list[int]] = {}
    counter = 0
    halved = [0] * num_ps
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
            if id(var) in trainable:
                trainable_bytes[task] += nbytes
            if id(var) in trainable and looked_up is not None:
                read[task] += round(looked_up[i] * nbytes / rows)  # the rows a batch reads
                index_bytes[task] += round(looked_up[i] * 2 * 8)  # their ids, there and back
            elif id(var) in trainable:
                read[task] += nbytes
                if config.ps.read_compression == "fp16" and var.dtype.name == "float32":
                    halved[task] += nbytes
    by_id = {id(v): v for v in created}
    for slot, primary in slots.items():
        var = by_id[slot]
        for task, rows in zip(tasks_of[primary], _shard_rows(var, partitioner), strict=True):
            shape = (rows, *var.shape[1:])
            shards.append(Shard(base_name(var.name), task, shape,
                                math.prod(shape) * var.dtype.size))
    scale = 0.5 if config.ps.compression == "fp16" else 1.0
    others = tuple(ps_variables.weight_name(w) for w in model.weights
                   if not ps_variables.is_variable(w))
    return Placement(num_ps, tuple(shards), others), Traffic(read, scale, index_bytes,
                                                                trainable_bytes, halved)


def allreduce_bytes(config: cfg.Config, num_workers: int) -> float:
    """The bytes each of `num_workers` MultiWorkerMirrored workers sends per
    training step, and receives (a ring is symmetric).

    A ring all-reduce of a dense gradient sends 2 (N-1)/N of its bytes from each
    worker: (N-1)/N to reduce it in parts, as much again to hand the sums round.
    A table read by lookup has a sparse gradient, which TensorFlow all-gathers
    instead: each worker passes on the rows each of the other N-1 workers' share
    of the batch looked up, every row with its int64 id. The values count half
    with sync.compression = fp16; the ids do not.
    """
    import tensorflow as tf  # started by the task's import

    from app import task as tasks

    task, config = tasks.create(config)
    model = task.build_model()
    scale = 0.5 if config.sync.compression == "fp16" else 1.0
    share = config.train.global_batch_size // num_workers
    total = 0.0
    for var in model.trainable_variables:
        # Keras 3's variables give their shape as a tuple and name their dtype.
        shape = tuple(var.shape)
        nbytes = math.prod(shape) * tf.as_dtype(var.dtype).size
        looked_up = task.lookup_rows(var, [shape[0]], share) if shape else None
        if looked_up is None:
            total += 2 * (num_workers - 1) / num_workers * nbytes * scale
        else:
            total += (num_workers - 1) * looked_up[0] * (nbytes / shape[0] * scale + 8)
    return total


def _shard_rows(var, partitioner) -> list[int]:
    """Rows (first axis) of each shard, as ParameterServerStrategy splits them."""
    if partitioner is None or not var.shape.rank:
        return [var.shape[0] if var.shape.rank else 1]
    num = partitioner(var.shape, var.dtype)[0]
    rows = var.shape[0]
    return [rows // num + (1 if i < rows % num else 0) for i in range(num)]


@dataclasses.dataclass(frozen=True)
class LinkLoad:
    """The bytes one direction of one task's link carries per training step."""
    task: str  # "ps:0", or "each worker"
    direction: str  # "sends" or "receives"
    nbytes: float


def link_loads(traffic: Traffic, num_workers: int) -> list[LinkLoad]:
    """Per step of the cluster (one batch on one worker), the bytes each direction
    of each task's link carries: a ps task sends its variables and receives their
    gradients; the workers share the steps, so each worker's link carries its share
    of all the ps tasks' bytes."""
    loads = []
    for i, (read, written) in enumerate(zip(traffic.sent_bytes, traffic.written_bytes,
                                            strict=True)):
        loads += [LinkLoad(f"ps:{i}", "sends", read), LinkLoad(f"ps:{i}", "receives", written)]
    return loads + [
        LinkLoad("each worker", "receives", sum(traffic.sent_bytes) / num_workers),
        LinkLoad("each worker", "sends", sum(traffic.written_bytes) / num_workers)]


def step_time_bound(traffic: Traffic, num_workers: int,
                    rate_bits: float) -> tuple[float, str]:
    """(the least seconds a training step of the cluster can take on links of
    `rate_bits` per second each way, what sets it).

    Two limits, the larger binds. Each direction of each link carries its bytes
    (`link_loads`), however the steps overlap. And a worker runs one step at a
    time, in which the gradients exist only after the variables have arrived:
    its step takes at least the slowest ps task's read, then its own push of
    every gradient, so `num_workers` workers finish a step at most every
    (read + push) / num_workers.
    """
    busiest = max(link_loads(traffic, num_workers), key=lambda load: load.nbytes)
    link_s = busiest.nbytes * 8 / rate_bits
    sent = traffic.sent_bytes
    slowest = max(range(len(sent)), key=lambda i: sent[i])
    chain_s = (sent[slowest] + sum(traffic.written_bytes)) * 8 / rate_bits
    if chain_s / num_workers > link_s * (1 + 1e-9):  # a tie names the link
        return chain_s / num_workers, (f"each worker's read from ps:{slowest} then push, "
                                       f"{num_workers} worker(s) in parallel")
    return link_s, f"what {busiest.task} {busiest.direction}"

