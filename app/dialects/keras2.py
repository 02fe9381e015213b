"""Keras 2 (`import tf_keras`): the dialect the project's machinery was first written in.

Its optimizers (`app.dialects.keras2_optimizers`), backup (`app.dialects.keras2_backup`) and the
ParameterServerStrategy path of Keras' own `fit` are tf_keras' own; this module
is the face they show the trainer (see `app.dialects`).
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf
import tf_keras as keras

from app import strategy as strategies
from app.config import DebugConfig, PSConfig, SyncConfig, TrainConfig
from app.dialects import keras2_backup, keras2_sync
from app.dialects import keras2_optimizers as optimizers
from app.distribute.ps import coordinated
from app.distribute.ps import evaluation as ps_evaluation
from app.state.workdir import save_dir

log = logging.getLogger(__name__)

# The dialect interface (app.dialects.INTERFACE); what else is here is this module's own.
__all__ = ["NAME", "LABEL", "IMPORT", "keras", "owns", "set_precision", "use_variable_rng",
           "schedules", "optimizer", "optimizer_class", "check_runner", "compile",
           "build_optimizer", "fit", "backup", "tensorboard", "evaluate", "export", "variables",
           "tf_variable", "slots", "build_coordinated", "fit_coordinated",
           "resumes_by_callback", "ps_evaluator", "sync_steps"]

NAME = "tf_keras"
LABEL = "Keras 2 (tf_keras)"
IMPORT = "import tf_keras as keras"


def owns(obj: Any) -> bool:
    return any(c.__module__.split(".")[0] == "tf_keras" for c in type(obj).__mro__)


def set_precision(policy: str) -> Callable[[], None]:
    """tf_keras' global dtype policy `policy`; returns what puts the previous one back."""
    previous = keras.mixed_precision.global_policy().name
    keras.mixed_precision.set_global_policy(policy)
    return lambda: keras.mixed_precision.set_global_policy(previous)


def use_variable_rng() -> Callable[[], None]:
    """From now on, the random layers built (Dropout, GaussianNoise, the augmentation
    layers) draw from a `tf.random.Generator`, whose state is a variable that
    `keras2_backup.Backup` saves, instead of TF1's stateful random ops, whose state lives
    in each op's kernel and starts over in a new process or a new tf.function (a
    resumed run's dropout masks would be those of the run's first steps). Returns
    what puts tf_keras' previous choice back (the choice is process-global)."""
    experimental = keras.backend.experimental
    was_on = experimental.is_tf_random_generator_enabled()
    experimental.enable_tf_random_generator()
    return (lambda: None) if was_on else experimental.disable_tf_random_generator


def optimizer(kind: str, learning_rate: Any, sync: SyncConfig, ps: PSConfig
              ) -> keras.optimizers.Optimizer:
    """`train.optimizer`, with the configured gradient compression."""
    cls, kwargs = optimizer_class(kind), {"momentum": 0.9} if kind == "sgd" else {}
    if sync.compression == "fp16":
        cls = optimizers.fp16_all_reduce(cls)
    if ps.compression == "fp16" and ps.mode == "async":  # sync's exchange sends float16
        cls = optimizers.fp16_push(cls)
    return cls(learning_rate, **kwargs)


def optimizer_class(kind: str) -> type:
    """The optimizer class of `kind` ("adam", "adagrad", "sgd"): the project's own Adam
    and Adagrad (`app.dialects.keras2_optimizers`, fused kernels), tf_keras' SGD."""
    return {"adam": optimizers.Adam, "adagrad": optimizers.Adagrad,
            "sgd": keras.optimizers.SGD}[kind]


def schedules():
    return keras.optimizers.schedules


def compile(model: keras.Model, optimizer, task, train: TrainConfig) -> None:
    """Compile `model` with the task's loss and metrics."""
    model.compile(optimizer=optimizer, loss=task.loss(), metrics=task.metrics(),
                  loss_weights=task.loss_weights(), weighted_metrics=task.weighted_metrics(),
                  steps_per_execution=train.steps_per_execution,
                  jit_compile=train.jit_compile)


def build_optimizer(model: keras.Model, dataset_fn, slot_device) -> None:
    """The model's variables, then the optimizer's slots of them, now (under
    `slot_device`), so that they can be placed.

    Also before a backup is restored, which this order needs: tf_keras 2.21 restores
    the slots of a sharded variable only into slots that exist; restored before they
    are built, they stay at their initial values, silently (keras-team/tf-keras#838,
    tests/test_resume_shards.py)."""
    _build_layers(model, dataset_fn)
    with slot_device:
        model.optimizer.build(model.trainable_variables)


def _build_layers(model: keras.Model, dataset_fn) -> None:
    """Create the variables of `model` if it is not built yet, from the shapes and
    dtypes of the features `dataset_fn`'s elements hold.

    A model with no `Input` (a subclassed one without `build(shape)`, as tf_keras'
    "Customizing what happens in fit()" guide writes it, or a `Sequential` without
    an `Input`) is built at its first call. Keras' own fit builds the optimizer at its
    first `apply_gradients` (tf_keras 2.21 optimizer.py); built here before the model,
    it knew no variable and the first step failed with "The optimizer cannot recognize
    variable". A symbolic call, as a functional model's construction makes.
    """
    if model.built:
        return
    spec = dataset_fn(tf.distribute.InputContext()).element_spec
    features = keras.utils.unpack_x_y_sample_weight(spec)[0]
    model(tf.nest.map_structure(lambda s: keras.Input(s.shape[1:], dtype=s.dtype), features))


def ps_evaluator(model: keras.Model, coordinator, workers: int):
    """Exact evaluation of `model` on the workers of `coordinator`, all at once: every
    metric update of tf_keras is one op on its variable (assign_add), so workers
    evaluating shards at once count each batch once."""
    return ps_evaluation.evaluator(model, coordinator, workers, parallel=True)


def resumes_by_callback(by_index: bool) -> bool:
    """Whether `fit_coordinated` resumes from the `backup` callback in its list.

    tf_keras' fit drives a ClusterCoordinator itself, with `keras2_backup.Backup`
    among its callbacks, for a task that gives only a training pipeline. A task whose
    examples are read by index (`by_index`) trains in the project's own loop
    (app.distribute.ps.coordinated), which passes each step its number, with that
    loop's backup."""
    return not by_index


def build_coordinated(model: keras.Model, task, dataset_fn, slot_device) -> None:
    build_optimizer(model, dataset_fn, slot_device)


def fit_coordinated(model: keras.Model, built, coordinator, dataset_fn, callbacks_: list,
                    epochs: int, steps_per_epoch: int, verbose, backup_dir: pathlib.Path,
                    every_steps: int, reading=None, with_worker: bool = False,
                    workers: int = 1, closures: coordinated.Closures = coordinated.ONE_STEP
                    ) -> keras.callbacks.History:
    if reading is None:
        if closures.reads_fewer:
            log.warning("ps.read_every and ps.read_compression apply to the project's loop "
                        "(a task read by index, or Keras 3); this task trains through "
                        "tf_keras' fit, whose steps read every variable as float32")
        return fit(model, dataset_fn, coordinator.strategy, callbacks_, epochs,
                   steps_per_epoch, verbose)
    return coordinated.fit(model, model.train_step, coordinator, keras, epochs=epochs,
                           steps_per_epoch=steps_per_epoch, callbacks=callbacks_,
                           verbose=verbose, reading=reading, with_worker=with_worker,
                           workers=workers, closures=closures,
                           variables=model.trainable_variables,
                           backup=coordinated.LoopBackup(coordinator, model, backup_dir,
                                                         every_steps))


def sync_steps(model: keras.Model, built, task):
    """What ps.mode = sync's contributions run (the model's own train_step) and the
    update path of tf_keras' optimizers (`keras2_sync`)."""
    keras2_sync.check_optimizer(model.optimizer, task)
    return model.train_step, keras2_sync.UpdatePath()


def tf_variable(variable):
    """The TensorFlow variable of a model's variable: itself."""
    return variable


def variables(model: keras.Model, optimizer) -> list:
    """The variables of the model and of `optimizer` (its slots, its step)."""
    return model.variables + optimizer.variables()


def slots(model: keras.Model, optimizer) -> dict[int, int]:
    """id(slot) -> id(its variable), for `optimizer`'s slots of the model's trainable
    variables: tf_keras names a slot "<slot>/<variable>"."""
    primaries = {v._shared_name: id(v) for v in model.trainable_variables}
    out = {}
    for slot in optimizer.variables():
        _, sep, rest = slot.name.removesuffix(":0").partition("/")
        if sep and rest in primaries:
            out[id(slot)] = primaries[rest]
    return out


def backup(backup_dir: pathlib.Path, every_steps: int):
    return keras2_backup.Backup(str(backup_dir), every_steps)


def tensorboard(log_dir: pathlib.Path):
    return keras.callbacks.TensorBoard(str(log_dir), update_freq="epoch")


def fit(model: keras.Model, dataset_fn, strategy, callbacks_: list, epochs: int,
        steps_per_epoch: int, verbose) -> keras.callbacks.History:
    """Keras' fit, each input pipeline made by `dataset_fn` on its worker (under a
    ClusterCoordinator too: tf_keras' fit drives it)."""
    return model.fit(
        keras.utils.experimental.DatasetCreator(
            dataset_fn, input_options=strategies.input_options(strategy)),
        epochs=epochs, steps_per_epoch=steps_per_epoch, callbacks=callbacks_, verbose=verbose)


def evaluate(model: keras.Model, dataset: tf.data.Dataset) -> dict[str, float]:
    """Keras' evaluate, every batch of `dataset` once, at the model's steps_per_execution."""
    return model.evaluate(dataset, steps=_batches(model, dataset), verbose=0, return_dict=True)


# The number of batches of each dataset `_batches` has counted, while the dataset lives.
_COUNTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _batches(model: keras.Model, dataset: tf.data.Dataset) -> int | None:
    """How many batches `dataset` holds, where tf_keras needs to be told: None where it
    finds out itself.

    tf_keras 2.21 runs several steps per execution only over data whose size it knows
    (data_adapter.py: "Could not infer the size of the data. With steps_per_execution >
    1, you must specify the number of steps"), and a dataset read from files, or
    filtered, has none; Keras 3 reads ahead with `get_next_as_optional` instead. Such a
    dataset's batches are counted once, in a pass over it, and the count kept for its
    next evaluation (the trainer evaluates the same datasets every epoch)."""
    steps = model.steps_per_execution
    if (steps is None or int(steps.numpy()) == 1
            or int(dataset.cardinality()) != tf.data.UNKNOWN_CARDINALITY):
        return None
    if dataset not in _COUNTED:
        _COUNTED[dataset] = int(dataset.reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))
    return _COUNTED[dataset]


def export(model: keras.Model, directory: pathlib.Path) -> None:
    """A SavedModel at `directory`/export, whole or absent."""
    with _valid_root_scopes(model):
        save_dir(directory / "export", lambda path: model.save(path, save_format="tf"))


# What tf_keras names a layer of a class whose name begins with `_` (`to_snake_case`).
_PRIVATE = "private"


@contextlib.contextmanager
def _valid_root_scopes(model: keras.Model) -> Iterator[None]:
    """Within it, each layer of `model` whose name begins with `_` is named as tf_keras
    names such a layer class's instances: with `private` before it.

    tf_keras 2.21's SavedModel traces each layer's call on its own (save_impl.py,
    `call_and_return_conditional_losses` calls `layer.call`, outside the layer's name
    scope), so the layers a model calls there enter their name scopes as root
    scopes, which may not begin with `_`: a layer the task named `_hidden` trains
    (under its model's scope) and its export failed with "'_hidden/' is not a valid
    root scope name". The SavedModel's Keras metadata holds the new names (what
    `tf_keras.models.load_model` gives); the model's names are back after it.
    """
    renamed = [layer for layer in [model, *model.submodules]
               if isinstance(layer, keras.layers.Layer) and layer.name.startswith("_")]
    for layer in renamed:
        layer._name = _PRIVATE + layer.name  # tf_keras 2.21: `name` reads `_name`
    try:
        yield
    finally:
        for layer in renamed:
            layer._name = layer.name.removeprefix(_PRIVATE)


def check_runner(debug: DebugConfig, task, *, parameter_servers: bool,
                 synchronous_ps: bool) -> None:
    """Every kind of run trains Keras 2 models."""
