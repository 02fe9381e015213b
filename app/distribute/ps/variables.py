"""Where variables live on the ps tasks: the ShardedVariable partitioner that
`ps.partitioner` names, the placement that reports which ps task holds how many
bytes (`tools.plan` predicts the same without a cluster), and the names of a
model's weights across both Kerases.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np
import tensorflow as tf

from app.config import ConfigError, PSConfig
from app.units import human_size


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
