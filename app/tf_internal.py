"""The TensorFlow internals this project uses, walled off here (read from TF 2.21).

Everything else uses TensorFlow's public API. If TensorFlow moves either of
these, only this module breaks, and only the runs that use it:

- `distribute_per_replica`: MultiWorkerMirroredStrategy refuses the public
  `InputReplicationMode.PER_REPLICA`; `app.strategy.MultiWorkerMirroredStrategy`
  calls TensorFlow's own per-replica input path for one-replica workers. If it
  moves, those workers fail at the first fit(); the public fallback is to drop
  the subclass (TF's MultiDeviceIterator, slower on CPUs).
- `sleep`: tf.data's testing sleep transformation, the one sleep that can run
  inside a remote function without burning a core; only `debug.slow_worker`
  (straggler injection) imports it. If it moves, only that debug switch breaks.
"""

from __future__ import annotations

import tensorflow as tf


def distribute_per_replica(strategy, dataset_fn, options):
    """What MirroredStrategy does for PER_REPLICA input, for a worker's one replica."""
    from tensorflow.python.distribute import input_util

    extended = strategy.extended
    return input_util.get_distributed_datasets_from_function(
        dataset_fn, extended._input_workers_with_options(options),
        [extended._make_input_context()], strategy, options)


def sleep(microseconds: tf.Tensor) -> tf.Tensor:
    """Sleep `microseconds` inside a tf.function, without holding a core."""
    from tensorflow.python.data.experimental.ops.testing import sleep as transformation

    delay = tf.data.Dataset.from_tensors(tf.constant(0, tf.int64)).apply(
        transformation(microseconds))
    return next(iter(delay))


def uninitialized_variable(shape, dtype, name=None, trainable=None):
    """A resource variable of `shape` and `dtype` that holds no value."""
    from tensorflow.python.ops import resource_variable_ops

    return resource_variable_ops.UninitializedVariable(
        shape=shape, dtype=tf.as_dtype(dtype), name=name,
        trainable=True if trainable is None else trainable)
