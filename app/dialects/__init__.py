"""The Keras a task is written in: Keras 3 (`import keras`, `tf.keras`) or Keras 2
(`import tf_keras`), found from the objects the task returns.

One module per dialect, each with the same small set of names, `INTERFACE` (Keras 3
keeps one package per backend the same way, `keras/src/backend/`): `keras2` wraps
the `tf_keras` machinery the project grew up with, `keras3` speaks Keras 3. `of`
picks one for a built model, once per run, and `named` one for a built-in task's
`task.keras` field; nothing else asks which Keras it is. Each module's `__all__` is
`INTERFACE`; what else it holds is its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from app.config import ConfigError
from app.dialects import keras2, keras3

# What every dialect module defines, and all that code outside it uses of it.
INTERFACE = (
    "NAME",  # its short name: a built-in task's `task.keras`, metrics.json's `keras`
    "LABEL",  # how a message names it
    "IMPORT",  # how a task imports it, for messages
    "keras",  # the Keras module itself
    "owns",  # owns(obj): whether obj (a model, layer, loss, metric, optimizer) is of it
    "set_precision",  # set_precision(policy) -> restore: its global dtype policy
    "use_variable_rng",  # () -> restore: random layers built from now keep state in variables
    "schedules",  # () -> its learning rate schedules module
    "optimizer",  # optimizer(kind, learning_rate, sync, ps): `train.optimizer`, compressed
    "optimizer_class",  # optimizer_class(kind): its adam, adagrad or sgd class, as it is
    "check_runner",  # check_runner(debug, task, *, parameter_servers, synchronous_ps)
    "compile",  # compile(model, optimizer, task, train): the task's loss and metrics
    "build_optimizer",  # build_optimizer(model, dataset_fn, slot_device): slots now
    "fit",  # fit(model, dataset_fn, strategy, callbacks, epochs, steps_per_epoch, verbose)
    "backup",  # backup(backup_dir, every_steps): the callback fit() resumes from
    "tensorboard",  # tensorboard(log_dir): its TensorBoard callback
    "evaluate",  # evaluate(model, dataset) -> {"loss": ..., metric: ...}
    "export",  # export(model, directory): what the run exports, each file whole or absent
    "variables",  # variables(model, optimizer): the TensorFlow variables of both
    "tf_variable",  # tf_variable(v): the TensorFlow variable behind one of its variables
    "slots",  # slots(model, optimizer): id(slot) -> id(its variable)
    # Under ParameterServerStrategy (a ClusterCoordinator):
    "build_coordinated",  # (model, task, dataset_fn, slot_device) -> what its steps run
    "fit_coordinated",  # its loop on the coordinator
    "resumes_by_callback",  # (by_index) -> whether fit_coordinated resumes from `backup`
    "ps_evaluator",  # (model, coordinator, workers): exact evaluation on the workers
    "sync_steps",  # (model, built, task) -> (train step, update path) of ps.mode = sync
)

DIALECTS = (keras3, keras2)


def _dialect_of(obj: Any):
    return next((d for d in DIALECTS if d.owns(obj)), None)


def of(model: Any, task: Any):
    """The dialect of `model`, which `task` built; every Keras object the task gives
    with it must be of the same Keras (else a ConfigError naming the object)."""
    dialect = _dialect_of(model)
    name = type(task).__name__
    if dialect is None:
        raise ConfigError(
            f"task {name}: build_model returned a {type(model).__module__}."
            f"{type(model).__name__}, not a Keras model; return a keras.Model "
            f"({keras3.LABEL}) or a tf_keras.Model ({keras2.LABEL})")
    for what, obj in _task_objects(task):
        _same_keras(dialect, task, what, obj)
    return dialect


def _same_keras(dialect, task: Any, what: str, obj: Any) -> None:
    """A ConfigError naming `obj` (the task's `what`) if it is of the other Keras."""
    other = _dialect_of(obj)
    if other is not None and other is not dialect:
        raise ConfigError(
            f"task {type(task).__name__} mixes two Kerases: its model is {dialect.LABEL} and "
            f"its {what} ({type(obj).__name__}) is {other.LABEL}; build every object of a "
            f"task with one of them ({dialect.IMPORT} here)")


def _task_objects(task: Any) -> Iterator[tuple[str, Any]]:
    """(what, object) for each loss and metric the task gives, nested ones included."""
    for what, value in (("loss", task.loss()), ("metric", task.metrics()),
                        ("weighted metric", task.weighted_metrics())):
        yield from ((what, obj) for obj in _flatten(value))


def _flatten(value: Any) -> list:
    if isinstance(value, dict):
        return [x for v in value.values() for x in _flatten(v)]
    if isinstance(value, list | tuple):
        return [x for v in value for x in _flatten(v)]
    return [] if value is None else [value]


def check_optimizer(optimizer: Any, dialect, task: Any) -> None:
    """A task's own optimizer must be of its model's Keras."""
    _same_keras(dialect, task, "optimizer", optimizer)


def named(name: str):
    """The dialect a built-in task is written in, by its `task.keras` field: "keras"
    (Keras 3) or "tf_keras" (Keras 2)."""
    return next(d for d in DIALECTS if d.NAME == name)


def module(name: str) -> Any:
    """The Keras module a built-in task builds with, by its `task.keras` field."""
    return named(name).keras


# The `task.keras` field of the built-in tasks: the Keras their models are written in.
NAMES = tuple(d.NAME for d in DIALECTS)


def set_precision(policy: str) -> Any:
    """Set the dtype policy of both Kerases (which one the task uses is known only once
    its model is built, under the policy); returns what restores the previous ones."""
    restores = [d.set_precision(policy) for d in DIALECTS]
    return lambda: [restore() for restore in restores]


def use_variable_rng() -> Any:
    """Both Kerases' random layers built from now on keep their generators' state in
    variables that the backup saves; returns what restores the previous choice."""
    restores = [d.use_variable_rng() for d in DIALECTS]
    return lambda: [restore() for restore in restores]


def set_random_seed(seed: int) -> None:
    for d in DIALECTS:
        d.keras.utils.set_random_seed(seed)
