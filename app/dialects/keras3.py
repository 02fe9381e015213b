"""Keras 3 (`import keras`, and `tf.keras` since TensorFlow 2.16), on TensorFlow.

One process, MirroredStrategy and MultiWorkerMirroredStrategy train through Keras
3's own `fit` in the strategy's scope. Keras 3's `fit` has no
ParameterServerStrategy (keras-team/keras#18624): there the project runs its own
loop on the ClusterCoordinator (`app.dialects.keras3_ps`).
"""

from __future__ import annotations

import logging
import os
import pathlib
import tempfile
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from app import strategy as strategies
from app import tf_internal
from app.config import ConfigError, DebugConfig, PSConfig, SyncConfig, TrainConfig
from app.dialects import keras3_build, keras3_internal, keras3_ps, keras3_sync
from app.distribute.ps import coordinated
from app.distribute.ps import evaluation as ps_evaluation
from app.state import backup as backups
from app.state.workdir import save_dir

log = logging.getLogger(__name__)

# The dialect interface (app.dialects.INTERFACE); what else is here is this module's own.
__all__ = ["NAME", "LABEL", "IMPORT", "keras", "owns", "set_precision", "use_variable_rng",
           "schedules", "optimizer", "optimizer_class", "check_runner", "compile",
           "build_optimizer", "fit", "backup", "tensorboard", "evaluate", "export", "variables",
           "tf_variable", "slots", "build_coordinated", "fit_coordinated",
           "resumes_by_callback", "ps_evaluator", "sync_steps"]

NAME = "keras"
LABEL = "Keras 3 (keras, tf.keras)"
IMPORT = "import keras"
# Beside the SavedModel: the native Keras 3 file of the trained model.
KERAS_FILE = "model.keras"


def owns(obj: Any) -> bool:
    return any(c.__module__.split(".")[0] == "keras" for c in type(obj).__mro__)


def set_precision(policy: str) -> Callable[[], None]:
    """Keras 3's global dtype policy `policy`; returns what puts the previous one back."""
    previous = keras.config.dtype_policy().name
    keras.config.set_dtype_policy(policy)
    return lambda: keras.config.set_dtype_policy(previous)


def use_variable_rng() -> Callable[[], None]:
    """Keras 3's random layers always draw from a `SeedGenerator`, whose state is a
    variable (`Backup` saves it): nothing to change. Returns what undoes nothing."""
    return lambda: None


def optimizer(kind: str, learning_rate: Any, sync: SyncConfig, ps: PSConfig
              ) -> keras.optimizers.Optimizer:
    """`train.optimizer`, as Keras 3 has it; the gradient compressions are Keras 2's,
    but for ps.mode = sync's, which its exchange makes whatever the Keras."""
    for key, value in (("sync.compression", sync.compression),
                       ("ps.compression", ps.compression if ps.mode == "async" else "none")):
        if value != "none":
            raise ConfigError(f"{key} = {value} compresses the gradients of Keras 2 (tf_keras) "
                              "models; this task's model is Keras 3. Set it to none")
    if kind == "sgd":
        return keras.optimizers.SGD(learning_rate, momentum=0.9)
    if kind == "adam":
        return _fused_adam(keras.optimizers.Adam(learning_rate))
    return keras.optimizers.Adagrad(learning_rate)


def _fused_adam(adam: keras.optimizers.Adam) -> keras.optimizers.Adam:
    """`adam`, its dense updates made by TensorFlow's fused ResourceApplyAdam kernel,
    as Keras 2's Adam's are.

    Keras 3.15's Adam writes its update as ten elementwise ops, each a pass over
    the variable or a slot (`python experiments/step_ops.py`): the MNIST CNN's step
    took 16% more CPU under Mirrored than Keras 2's. The kernel computes the same
    formula in one pass. Sparse gradients and amsgrad keep Keras' own update.
    Set on the instance, not a subclass: the optimizer saved in `model.keras`
    stays Keras' own Adam, which loads anywhere.
    """
    keras_update = adam.update_step

    def update_step(gradient, variable, learning_rate):
        if adam.amsgrad or isinstance(gradient, tf.IndexedSlices):
            return keras_update(gradient, variable, learning_rate)
        momentum, velocity = keras3_internal.adam_slots(adam, variable)
        var = tf_variable(variable)
        dtype = var.dtype
        step = tf.cast(adam.iterations + 1, dtype)
        beta_1, beta_2 = tf.cast(adam.beta_1, dtype), tf.cast(adam.beta_2, dtype)
        # Inside strategy.extended.update, a mirrored variable's handle is this
        # device's copy's.
        tf.raw_ops.ResourceApplyAdam(
            var=var.handle, m=tf_variable(momentum).handle, v=tf_variable(velocity).handle,
            beta1_power=tf.pow(beta_1, step), beta2_power=tf.pow(beta_2, step),
            lr=tf.cast(learning_rate, dtype), beta1=beta_1, beta2=beta_2,
            epsilon=tf.cast(adam.epsilon, dtype), grad=tf.cast(gradient, dtype))

    adam.update_step = update_step
    return adam


def optimizer_class(kind: str) -> type:
    """Keras 3's own optimizer class of `kind` ("adam", "adagrad", "sgd")."""
    return {"adam": keras.optimizers.Adam, "adagrad": keras.optimizers.Adagrad,
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
    """The model's variables, then the optimizer's slots of them (under `slot_device`,
    so that they can be placed), then the metrics' and the loss tracker's variables."""
    keras3_build.build_layers(model, dataset_fn)
    with slot_device:
        model.optimizer.build(model.trainable_variables)
    keras3_build.prebuild(model, dataset_fn)


def ps_evaluator(model: keras.Model, coordinator, workers: int):
    """Exact evaluation of `model` on the workers of `coordinator`, one worker at a time.

    Keras 3.15's confusion-matrix metrics (AUC, Precision, Recall, ...), F-scores and
    IoU update their variables as `v.assign(v + x)` (metrics_utils.py): two workers
    doing so at once under parameter servers lose one's batch (measured: the
    recommender's weights after its last epoch, evaluated twice by two workers at
    once, gave test AUCs of 0.8013 and 0.8045)."""
    return ps_evaluation.evaluator(model, coordinator, workers, parallel=False)


def resumes_by_callback(by_index: bool) -> bool:
    """Whether `fit_coordinated` resumes from the `backup` callback in its list: never.
    Under a ClusterCoordinator the loop is the project's own (app.distribute.ps.coordinated),
    and so is its backup (coordinated.LoopBackup)."""
    return False


def build_coordinated(model: keras.Model, task, dataset_fn, slot_device):
    """Ready `model` for steps scheduled on a ClusterCoordinator: what they run."""
    keras3_ps.atomic_updates()
    keras3_build.build_layers(model, dataset_fn)  # the variables Steps builds the optimizer for
    steps = keras3_ps.Steps(model, task, slot_device)
    keras3_build.prebuild(model, dataset_fn)
    return steps


def fit_coordinated(model: keras.Model, built, coordinator, dataset_fn, callbacks_: list,
                    epochs: int, steps_per_epoch: int, verbose, backup_dir: pathlib.Path,
                    every_steps: int, reading=None, with_worker: bool = False,
                    workers: int = 1, closures: coordinated.Closures = coordinated.ONE_STEP
                    ) -> keras.callbacks.History:
    """The project's loop on the coordinator (Keras 3's fit has none)."""
    trainable = [tf_variable(v) for v in model.trainable_variables]
    return coordinated.fit(model, built.train, coordinator, keras, epochs=epochs,
                           steps_per_epoch=steps_per_epoch, callbacks=callbacks_,
                           verbose=verbose, dataset_fn=dataset_fn, reading=reading,
                           with_worker=with_worker, workers=workers, closures=closures,
                           variables=trainable,
                           backup=coordinated.LoopBackup(coordinator, model, backup_dir,
                                                         every_steps))


def sync_steps(model: keras.Model, built, task):
    """What ps.mode = sync's contributions run (the train step `build_coordinated`
    readied) and the update path of Keras 3's optimizers (`keras3_sync`)."""
    keras3_sync.check_optimizer(model.optimizer, task)
    return built.train, keras3_sync.UpdatePath(tf_variable)


def tf_variable(variable):
    """The TensorFlow variable behind a Keras 3 variable (itself, for anything else)."""
    return variable.value if isinstance(variable, keras.Variable) else variable


def slots(model: keras.Model, optimizer) -> dict[int, int]:
    """id(slot) -> id(its variable), TensorFlow variables, for `optimizer`'s slots of
    the model's trainable variables: Keras 3.15 names a slot "<the variable's path,
    / as _>_<slot>" (BaseOptimizer.add_variable_from_reference) and colocates it with
    its variable."""
    prefixes = sorted(((v.path.replace("/", "_") + "_", id(tf_variable(v)))
                       for v in model.trainable_variables), key=lambda p: -len(p[0]))
    out = {}
    for slot in optimizer.variables:
        primary = next((id_ for prefix, id_ in prefixes if slot.name.startswith(prefix)), None)
        if primary is not None:
            out[id(tf_variable(slot))] = primary
    return out


def variables(model: keras.Model, optimizer) -> list:
    """The TensorFlow variables of the model and `optimizer` (a Keras 3 variable
    wraps one, a ShardedVariable under a partitioner)."""
    return [tf_variable(v) for v in [*model.variables, *optimizer.variables]]


class Backup(keras3_internal.BackupAndRestore, backups.Backup):
    """Keras 3's BackupAndRestore in <workdir>/backup: saved at each epoch's end, every
    `every_steps` steps, and at the first step after SIGTERM, after which it raises
    `preemption.Preempted`.

    A resumed fit() goes on from the step after the saved one. Keras 3's own
    restores the epoch only (its fit() has no initial step, and the backup's
    "batch" is 0 both at an epoch's start and after its first step): this class
    records the steps done in the epoch as well, and `fit` starts that epoch
    there. An epoch's last step is saved at the epoch's end, after its
    evaluations, as under Keras 2. Only the task that checkpoints writes
    (MultiWorkerMirrored: worker 0); every worker reads. Which steps are due a
    save is Keras' count (its `save_freq`), which steps_per_execution > 1 makes
    one short at an epoch's start.
    """

    def __init__(self, backup_dir: str, every_steps: int = 0):
        keras3_internal.BackupAndRestore.__init__(
            self, backup_dir, save_freq=every_steps or "epoch", double_checkpoint=True)
        backups.Backup.__init__(self, backup_dir, every_steps)
        self.steps_done = 0  # in the epoch of the backup restored

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)  # restores the backup, if there is one
        # MultiWorkerMirrored: the workers agree on the step to save at, as under
        # Keras 2. TensorFlow's handler restores a step counter of its own from a
        # checkpoint manager, and saves only through `save`: an empty checkpoint,
        # never written, gives every worker the same counter (0) in each run.
        self.listen(self.model.distribute_strategy,
                    tf.train.CheckpointManager(tf.train.Checkpoint(), self.backup_dir,
                                               max_to_keep=1))

    def restored(self, metadata: dict) -> None:
        self.steps_done = metadata.get(STEPS_DONE, 0)
        self.resume_after_batch(max(self.steps_done - 1, 0))
        set_seed_states(self.model, metadata.get(SEED_STATES))

    def on_train_batch_end(self, batch, logs=None):
        self.at(self.current_epoch, batch + 1)
        if self.step >= self.params["steps"]:
            return  # the epoch's last step: saved at the epoch's end
        super().on_train_batch_end(batch, logs)  # saves every `every_steps`
        self.stop_if_asked()

    def on_epoch_end(self, epoch, logs=None):
        self.at(epoch + 1, 0)  # Keras' `_current_epoch` from here on
        super().on_epoch_end(epoch, logs)  # saves if every_steps is 0
        if self.save_freq != "epoch":
            self.save()
        self.stop_if_saved_and_asked()

    def on_train_end(self, logs=None):
        if self._writes():
            super().on_train_end(logs)  # deletes the backup
        self.close()

    def _writes(self) -> bool:
        return self.model.distribute_strategy.extended.should_checkpoint

    def save(self) -> None:
        self.save_now()

    def saving(self, metadata: dict) -> None:
        metadata[STEPS_DONE] = self.step
        metadata[SEED_STATES] = seed_states(self.model)


# The backup's record of the steps done in its epoch (beside Keras' "epoch", "batch").
STEPS_DONE = "steps_done"
# The backup's record of the model's random generators' states, in the model's order.
SEED_STATES = "seed_states"


def _seed_state_variables(model: keras.Model) -> list:
    """The state variable of each `SeedGenerator` of `model`'s random layers (Dropout,
    GaussianNoise, RandomFlip, ...): what `model.variables` holds beyond `model.weights`
    (Keras 3.15 Layer.variables), and what `save_weights` leaves out of the backup."""
    weights = {id(v) for v in model.weights}
    return [v for v in model.variables if id(v) not in weights]


def seed_states(model: keras.Model) -> list[list[int]]:
    """Each random layer's generator state: two integers, exact in JSON."""
    return [keras.ops.convert_to_numpy(v).tolist() for v in _seed_state_variables(model)]


def set_seed_states(model: keras.Model, states: list[list[int]] | None) -> None:
    """Put back `seed_states(model)` from a backup, so that a resumed run draws the
    dropout masks the uninterrupted one would have; without them (a backup of an
    earlier version) the generators start over, as Keras 3's BackupAndRestore alone
    resumes them."""
    if states is None:
        return
    variables = _seed_state_variables(model)
    if len(states) != len(variables):
        raise ValueError(f"the backup holds {len(states)} random generator state(s) and the "
                         f"model has {len(variables)} random layer generator(s): resume with "
                         "the model that wrote it, or start a new --workdir")
    for variable, state in zip(variables, states, strict=True):
        variable.assign(np.asarray(state, dtype=variable.dtype))


def backup(backup_dir: pathlib.Path, every_steps: int):
    return Backup(str(backup_dir), every_steps)


def tensorboard(log_dir: pathlib.Path):
    return keras.callbacks.TensorBoard(str(log_dir), update_freq="epoch")


def fit(model: keras.Model, dataset_fn, strategy, callbacks_: list, epochs: int,
        steps_per_epoch: int, verbose) -> keras.callbacks.History:
    """Keras 3's fit, on one input pipeline per worker made by `dataset_fn`; a
    resumed run starts its first epoch at the step after its backup's, and every
    epoch runs its steps exactly (`keras3_internal.exact_epochs`: one step a call
    with several replicas, where Keras 3.15's multi-step loop fails)."""
    keras3_internal.reduce_logs_first_under_multi_worker()
    dataset = strategy.distribute_datasets_from_function(
        dataset_fn, options=strategies.input_options(strategy))
    backup_ = next((cb for cb in callbacks_ if isinstance(cb, Backup)), None)
    stepwise = model.steps_per_execution > 1 and strategy.num_replicas_in_sync > 1
    with keras3_internal.exact_epochs(lambda: backup_.steps_done if backup_ else 0, stepwise):
        return model.fit(dataset, epochs=epochs, steps_per_epoch=steps_per_epoch,
                         callbacks=callbacks_, verbose=verbose, shuffle=False)


def evaluate(model: keras.Model, dataset: tf.data.Dataset) -> dict[str, float]:
    """Keras 3's evaluate, its results read from the metrics themselves.

    Keras 3.15's evaluate returns the last step's logs as they are when a model's
    own test_step names them otherwise than its metrics (keras.io's guide returns
    `{m.name: m.result() for m in self.metrics}`, a nested dict): under
    MultiWorkerMirrored those are one worker's (test accuracy 0.700 against 0.675
    over both). `get_metrics_result`, read across replicas, counts every batch.
    """
    logs = model.evaluate(dataset, verbose=0, return_dict=True)
    return {k: float(v) for k, v in {**_flat(logs), **model.get_metrics_result()}.items()}


def _flat(logs: dict) -> dict:
    return {k: v for key, value in logs.items()
            for k, v in (_flat(value).items() if isinstance(value, dict) else [(key, value)])}


def export(model: keras.Model, directory: pathlib.Path) -> None:
    """`directory`/model.keras, then `directory`/export, a SavedModel whose `serve`
    takes the model's raw input and predicts as `model(inputs, training=False)` does;
    each whole or absent. The SavedModel is attempted whether or not the .keras file
    could be written; the first failure is raised once both are done."""
    failures = []
    for write in (lambda: _save_keras_file(model, directory),
                  lambda: save_dir(directory / "export", lambda path: _export(model, path))):
        try:
            write()
        except Exception as e:  # noqa: BLE001 - raised below, after the other one
            failures.append(e)
    if failures:
        raise failures[0]


def _save_keras_file(model: keras.Model, directory: pathlib.Path) -> None:
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".model-", suffix=".keras")
    os.close(fd)
    try:
        model.save(tmp)
        os.replace(tmp, directory / KERAS_FILE)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


# The root of every variable's name in the SavedModel's graph (`_export`).
_EXPORT_SCOPE = "model"


def _export(model: keras.Model, path: pathlib.Path) -> None:
    # What `model.export` writes, with the forward pass in inference mode: Keras 3.15
    # exports `model.__call__` with `training` unset, and its random layers
    # (RandomFlip, RandomRotation, ...) then augment each request. Its variables are
    # named under the project's own root scope: Keras' names, from its layers', may
    # not be valid roots (`tf_internal.exported_names`).
    archive = keras.export.ExportArchive()
    archive.track(model)
    archive.add_endpoint("serve", tf.function(lambda *inputs: model(*inputs, training=False)),
                         input_signature=keras3_internal.input_signature(model))
    with tf_internal.exported_names(lambda name: f"{_EXPORT_SCOPE}/{name}"):
        archive.write_out(str(path), verbose=False)


def check_runner(debug: DebugConfig, task, *, parameter_servers: bool,
                 synchronous_ps: bool) -> None:
    """Refuse what Keras 3 cannot do in a run: on asynchronous `parameter_servers` a
    debug.slow_worker slows the tf_keras step only (ps.mode = sync slows either Keras)."""
    name = type(task).__name__
    if parameter_servers and not synchronous_ps and debug.slow_worker >= 0:
        raise ConfigError(f"debug.slow_worker slows the asynchronous steps of Keras 2 (tf_keras) "
                          f"models, and task {name} builds a Keras 3 model; set it to -1, or "
                          "use ps.mode = sync")
