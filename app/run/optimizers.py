"""The optimizer a run trains with: the task's own, else `train.optimizer` at
`train.learning_rate` and its schedule, in the task's Keras. The trainer and the
planner (`app.planning.model`, which sizes its slots) build it here alike."""

from __future__ import annotations

from typing import Any

from app.config import Config
from app.task import Task


def optimizer(config: Config, task: Task, steps_per_epoch: int, dialect):
    """The task's own optimizer, else `train.optimizer`, in the task's Keras (`dialect`)."""
    lr = learning_rate(config, steps_per_epoch, dialect)
    own = task.optimizer(lr)
    if own is not None:
        return own
    return dialect.optimizer(config.train.optimizer, lr, config.sync, config.ps)


def learning_rate(config: Config, steps_per_epoch: int, dialect) -> Any:
    """The learning rate, or its schedule over optimizer steps."""
    t = config.train
    schedules = dialect.schedules()
    if t.lr_schedule == "cosine":
        return schedules.CosineDecay(
            t.learning_rate, decay_steps=t.epochs * steps_per_epoch, alpha=t.final_lr_fraction)
    if t.lr_schedule == "cosine_restarts":
        return schedules.CosineDecayRestarts(
            t.learning_rate, first_decay_steps=t.lr_cycle_epochs * steps_per_epoch,
            t_mul=1.0, m_mul=t.lr_cycle_decay, alpha=t.final_lr_fraction)
    return t.learning_rate
