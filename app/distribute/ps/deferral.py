"""What ps.mode = sync defers of a train step (app/distribute/ps/sync.py): the model
optimizer's one update, and what a step may not do for that.

The dialect gives its optimizers' update path (`UpdatePath`: app.dialects.keras3_sync,
keras2_sync), deferred while a contribution is traced; the trace records what the
step did with it (`Trace`), and `check` refuses, before training, a step whose
update cannot be deferred to one synchronous update: one that applies the model's
optimizer twice or never, applies another optimizer (a GAN's two), applies it inside
a conditional or a loop on a tensor, or writes a trainable variable itself (weight
clipping). `check` finds the last in the traced graph, in the functions it calls too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import tensorflow as tf

from app.config import ConfigError

# Ops that write a variable through its handle: a train_step's own update.
_WRITES = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
                     "ResourceStridedSliceAssign"})
_WRITE_PREFIXES = ("ResourceApply", "ResourceSparseApply", "ResourceScatter")
REFUSED = "; use ps.mode = async or MultiWorkerMirrored"
LOSS_SCALING = (
    "ps.mode = sync averages the workers' gradients before one update, and task {task}'s "
    "LossScaleOptimizer skips or applies each update by its gradients' values (dynamic loss "
    "scaling); use its inner optimizer, with train.precision = float32 or mixed_bfloat16, "
    "or use ps.mode = async")


class UpdatePath(Protocol):
    """What a dialect gives of its optimizers (app.dialects.keras3_sync, keras2_sync)."""

    def deferred(self, optimizer, deposit: Callable[[list, list], None],
                 other: Callable[[Any], None]) -> contextlib.AbstractContextManager:
        """Within it, `optimizer`'s update calls `deposit(grads, variables)` instead;
        any other optimizer of the dialect calls `other(itself)`, then updates."""

    def apply(self, optimizer, grads: list, variables: list) -> None:
        """`optimizer`'s real update, on the chief."""

    def tf_variable(self, variable) -> tf.Variable:
        """The TensorFlow variable behind a model variable."""


@contextlib.contextmanager
def replaced(cls: type, name: str, method: Callable) -> Iterator[None]:
    """Within it, `cls.<name>` is `method`: an update path deferred while a contribution
    traces (`UpdatePath.deferred`); after it, the class's own or inherited one again."""
    own = cls.__dict__.get(name)
    setattr(cls, name, method)
    try:
        yield
    finally:
        if own is None:
            delattr(cls, name)
        else:
            setattr(cls, name, own)


@dataclasses.dataclass
class Trace:
    """What one trace of a contribution saw of the optimizer updates."""

    graph: Any
    applies: int = 0
    others: list = dataclasses.field(default_factory=list)
    in_control_flow: bool = False
    unknown: list = dataclasses.field(default_factory=list)  # variables without slots
    deposited: tf.Tensor | None = None


@contextlib.contextmanager
def quiet(logger: logging.Logger) -> Iterator[None]:
    """Without the strategy's warning that `run` was called outside a scheduled
    function: a probe of the contribution is traced, never run."""
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def check(trace: Trace, concrete, model, path: UpdatePath, task) -> None:
    """A ConfigError if the traced contribution (`trace`, and `concrete`, its traced
    function) has an optimizer update that cannot be deferred to one synchronous update."""
    step = f"the train_step of {type(model).__name__} (task {type(task).__name__})"
    if trace.others:
        names = ", ".join(sorted({type(o).__name__ for o in trace.others}))
        raise ConfigError(
            f"ps.mode = sync defers the update of the model's optimizer to the chief, and "
            f"{step} applies another optimizer too ({names}){REFUSED}")
    if trace.applies != 1:
        times = "never applies" if not trace.applies else f"applies {trace.applies} times"
        raise ConfigError(
            f"ps.mode = sync averages one optimizer update per step over the workers, and "
            f"{step} {times} the model's optimizer (model.optimizer){REFUSED}")
    if trace.unknown:
        raise ConfigError(
            f"ps.mode = sync keeps the workers' gradients beside the model's trainable "
            f"variables, and {step} applies the model's optimizer to "
            f"{', '.join(trace.unknown)}, which is not one of them{REFUSED}")
    if trace.in_control_flow:
        raise ConfigError(
            f"ps.mode = sync averages one optimizer update per step over the workers, and "
            f"{step} applies the model's optimizer inside a conditional or a loop on a "
            f"tensor (tf.cond, tf.while_loop, or autograph's if and for){REFUSED}")
    written = _written(concrete, model, path)
    if written:
        raise ConfigError(
            f"ps.mode = sync updates the trainable variables on the chief only, and {step} "
            f"writes {', '.join(written)} itself (assign, assign_add, ...){REFUSED}")


def name(variable) -> str:
    """How a message names a model variable: its path (Keras 3), or its name."""
    return getattr(variable, "path", None) or variable.name.removesuffix(":0")


def _written(concrete, model, path: UpdatePath) -> list[str]:
    """The trainable variables of `model` that the traced function `concrete` writes
    (in its own graph or any function it calls: conditionals, loops)."""
    names = {}
    for variable in model.trainable_variables:
        storage = path.tf_variable(variable)
        for part in getattr(storage, "variables", [storage]):  # a ShardedVariable's shards
            names[id(part.handle)] = name(variable)
    graph = concrete.graph
    inside = {internal.op.name: names[id(external)] for external, internal in graph.captures
              if id(external) in names}
    graph_def = graph.as_graph_def()
    functions = {f.signature.name: f for f in graph_def.library.function}
    return sorted(set(_writes(graph_def.node, inside, functions)))


def _writes(nodes, handles: dict[str, str], functions: dict) -> list[str]:
    """The variables (`handles`: a node or argument name to its variable's name) that
    `nodes` write, following the handles into the functions they call."""
    found = []
    for node in nodes:
        inputs = [name.split(":")[0] for name in node.input if not name.startswith("^")]
        if (node.op in _WRITES or node.op.startswith(_WRITE_PREFIXES)) and inputs \
                and inputs[0] in handles:
            found.append(handles[inputs[0]])
        for attr in node.attr.values():
            called = [attr.func.name] if attr.func.name else [f.name for f in attr.list.func]
            for name in called:
                function = functions.get(name)
                if function is None:
                    continue
                # If and Case take their predicate or branch index first.
                args = inputs[1:] if node.op in ("If", "StatelessIf", "Case",
                                                 "StatelessCase") else inputs
                params = [arg.name for arg in function.signature.input_arg]
                inner = {param: handles[arg] for param, arg in zip(params, args, strict=False)
                         if arg in handles}
                if inner:
                    found += _writes(function.node_def, inner, functions)
    return found
