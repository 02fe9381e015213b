"""The Keras a task is written in: Keras 3 (`import keras`, `tf.keras`) or Keras 2
(`import tf_keras`), found from the objects the task returns.

One module per dialect, each with the same small set of names (Keras 3 keeps one
package per backend the same way, `keras/src/backend/`): `keras2` wraps the
`tf_keras` machinery the project grew up with, `keras3` speaks Keras 3. `of`
picks one for a built model, once per run; nothing else asks which Keras it is.

Each dialect module has:

- `NAME`, `LABEL`: its short name (metrics.json's `keras`) and how a message names it;
- `keras`: the Keras module itself;
- `owns(obj)`: whether `obj` (a model, layer, loss, metric, optimizer) is of this Keras;
- `optimizer(kind, learning_rate, config)`, `learning_rate(config, steps_per_epoch)`;
- `compile(model, optimizer, task, config)`: compile, and build the optimizer's slots;
- `variables(model, optimizer)`, `tf_variable(v)`: the TensorFlow variables of both;
- `backup(backup_dir, every_steps)`, `tensorboard(log_dir)`: its callbacks;
- `use_variable_rng()`: random layers built from then on keep their state in variables
  (which its backup saves), for `train.deterministic`;
- `fit(model, dataset_fn, strategy, callbacks, epochs, steps_per_epoch, verbose)`;
- `evaluate(model, dataset)`, `export(model, directory)`;
- `check_runner(kind, config, task)`: refuse what this Keras cannot do under a strategy kind.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from app.config import ConfigError
from app.dialects import keras2, keras3

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


def module(name: str) -> Any:
    """The Keras module a built-in task builds with, by its `task.keras` field:
    "keras" (Keras 3) or "tf_keras" (Keras 2)."""
    return next(d.keras for d in DIALECTS if d.NAME == name)


# The `task.keras` field of the built-in tasks: the Keras their models are written in.
NAMES = tuple(d.NAME for d in DIALECTS)


def set_precision(policy: str) -> Any:
    """Set the dtype policy of both Kerases (which one the task uses is known only once
    its model is built, under the policy); returns what restores the previous ones."""
    previous = [(d, d.global_policy()) for d in DIALECTS]
    for d in DIALECTS:
        d.set_global_policy(policy)
    return lambda: [d.set_global_policy(p) for d, p in previous]


def use_variable_rng() -> Any:
    """Both Kerases' random layers built from now on keep their generators' state in
    variables that the backup saves; returns what restores the previous choice."""
    restores = [d.use_variable_rng() for d in DIALECTS]
    return lambda: [restore() for restore in restores]


def set_random_seed(seed: int) -> None:
    for d in DIALECTS:
        d.keras.utils.set_random_seed(seed)
