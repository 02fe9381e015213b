"""What `ps.mode = sync` needs of a Keras 2 task: its loss, one value per example.

The synchronous loop's step (app/distribute/ps/sync.py) is written in tf_keras and
computes the task's loss itself, of (features, labels); `runners.SyncPS` trains
Keras 2 models only (`keras3.check_runner` refuses the others before this).
"""

from __future__ import annotations

import tf_keras as keras

from app.config import ConfigError


def task_loss(model: keras.Model, task) -> keras.losses.Loss:
    """The task's loss as one `keras.losses.Loss` of per-example values, or a
    ConfigError naming what the synchronous step cannot train."""
    loss = task.loss()
    # The sync step computes one loss of (features, labels): what Keras' compile
    # would add for several outputs or a model's own train_step is not there.
    if isinstance(loss, dict | list | tuple):
        raise ConfigError(
            f"ps.mode = sync trains one loss, and task {type(task).__name__} gives one per "
            "output (a model of several outputs); use ps.mode = async or MultiWorkerMirrored")
    task_loss_ = keras.losses.get(loss)
    if not isinstance(task_loss_, keras.losses.Loss):
        raise ConfigError(
            f"ps.mode = sync needs the task's loss as a keras.losses.Loss, and task "
            f"{type(task).__name__} gives a {type(loss).__name__}; wrap it in "
            "keras.losses.LossFunctionWrapper or use ps.mode = async")
    # Per-example losses: the sync loop averages them itself (Keras refuses a batch
    # mean inside a function the coordinator schedules).
    task_loss_.reduction = keras.losses.Reduction.NONE
    for step in ("train_step", "compute_loss"):
        # The sync loop computes the task's loss itself: a model's own compute_loss
        # would not run either, and the model would train silently on another loss.
        if getattr(type(model), step) is not getattr(keras.Model, step):
            raise ConfigError(
                "ps.mode = sync runs its own training step (app/distribute/ps/sync.py), so "
                f"the {step} of {type(model).__name__} would not run; use ps.mode = async "
                "or MultiWorkerMirrored")
    return task_loss_
