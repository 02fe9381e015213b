"""`debug.slow_worker`: one worker of a parameter-server run made slow on purpose.

Worker `worker` sleeps, between computing its gradients and sending them, until
each of its steps took `factor` times as long: in the synchronous mode's
contributions (`app.distribute.ps.sync`), and in tf_keras' asynchronous steps
(`StragglingModel`). The benchmark's straggler rows and the backup-worker tests
use it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import tensorflow as tf
import tf_keras as keras

from app import tf_internal
from app.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Straggler:
    """Worker `worker` sleeps until each of its steps took `factor` times as long."""

    worker: int
    factor: float


def straggle(values, is_slow: tf.Tensor, factor: float, started: tf.Tensor):
    """`values`, once a slow worker has slept (factor - 1) times the time since `started`."""
    def wait(ready: list[tf.Tensor]) -> tf.Tensor:
        with tf.control_dependencies(ready):
            seconds = (factor - 1.0) * (tf.timestamp() - started)
        return tf_internal.sleep(tf.cast(seconds * 1e6, tf.int64))

    return hold(values, is_slow, wait)


def hold(values, is_slow: tf.Tensor, wait: Callable[[list[tf.Tensor]], tf.Tensor]):
    """`values` (flattened, Nones kept), once `wait(values)`, an int64 tensor computed
    after them, has run where `is_slow`."""
    values = tf.nest.flatten(values)
    present = [v for v in values if v is not None]
    done = tf.cond(is_slow, lambda: wait(present), lambda: tf.constant(0, tf.int64))
    with tf.control_dependencies([done]):
        return [None if v is None else tf.identity(v) for v in values]


def with_worker_id(dataset_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset]):
    """`dataset_fn` whose batches also carry the index of the worker reading them
    (a ParameterServerStrategy dataset_fn: it runs on that worker)."""
    def fn(context: tf.distribute.InputContext) -> tf.data.Dataset:
        index = tf.distribute.coordinator.experimental_get_current_worker_index()
        worker = tf.cast(index, tf.int32)
        return dataset_fn(context).map(lambda features, labels: (features, labels, worker))
    return fn


def check_pairs(dataset_fn: Callable[[tf.distribute.InputContext], tf.data.Dataset]) -> None:
    """ConfigError unless `dataset_fn`'s batches are (features, labels), which the
    asynchronous straggler's step unpacks. Asked on the chief before the coordinator
    traces `dataset_fn`: an error raised while it traces reaches the user as
    autograph's StagingError, a traceback."""
    spec = dataset_fn(tf.distribute.InputContext()).element_spec
    if not (isinstance(spec, tuple) and len(spec) == 2):
        raise ConfigError(
            "debug.slow_worker in ps.mode = async trains on (features, labels) batches, and "
            f"this task's training data yields {_elements(spec)}; use ps.mode = sync, or "
            "set debug.slow_worker = -1")


def _elements(spec) -> str:
    if isinstance(spec, tuple) and len(spec) == 3:
        return "(features, labels, sample weights)"
    return f"{len(spec)} elements" if isinstance(spec, tuple) else "one element"


class StragglingModel(keras.Model):
    """A functional model whose train step lets one worker straggle: `debug.slow_worker`
    in asynchronous runs. Its batches carry the worker index (`with_worker_id`)."""

    straggler: Straggler

    @classmethod
    def wrap(cls, model: keras.Model, straggler: Straggler) -> StragglingModel:
        wrapped = cls(inputs=model.inputs, outputs=model.outputs, name=model.name)
        wrapped.straggler = straggler
        return wrapped

    def train_step(self, data):
        # Keras' own train step, with the straggler's sleep before the update.
        features, labels, worker = data
        started = tf.timestamp()
        with tf.GradientTape() as tape:
            predictions = self(features, training=True)
            loss = self.compute_loss(features, labels, predictions)
        grads = tape.gradient(loss, self.trainable_variables)
        grads = straggle(grads, worker == self.straggler.worker, self.straggler.factor, started)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return self.compute_metrics(features, labels, predictions, None)
