"""Optimizers: Keras' Adam with a fused update, and the gradient compressions.

Keras' Adam updates a variable with about ten element-wise ops, each a full
pass over the variable and its two slots. TensorFlow's `ResourceApplyAdam`
kernel (the one the TF1 and legacy Keras optimizers used) does the same
arithmetic in one pass, and on CPU the update is bound by memory, so the
passes are what it costs. Every strategy pays for the update; a
MultiWorkerMirrored worker pays for all of it on its share of the cores.

Keras can compile its update with XLA instead, but turns that off without a
GPU (`Optimizer.jit_compile`); forced on, the single process trained slower.

`fp16_all_reduce` and `fp16_push` wrap any Keras optimizer class so that the
gradients cross the network as float16 (`sync.compression`, `ps.compression`).
"""

from __future__ import annotations

import tensorflow as tf
import tf_keras as keras


def initial_slot(variable, shape=None, value: float = 0.0):
    """A function that makes the initial value of `variable`'s slot (`value`
    everywhere) on the variable's own device.

    Keras' optimizers make each slot's initial value eagerly, as a tensor of the
    variable's shape, where the optimizer is built, and then create the slot
    beside its variable: under ParameterServerStrategy the chief made every
    table shard's slot and sent it over gRPC to its ps task (a ps receiving a
    155 MiB shard holds it two or three times over while it arrives). Given this
    function instead, the variable's task makes the value itself.
    """
    dtype = getattr(variable, "true_dtype", variable.dtype)  # not the mixed-precision cast

    def make():
        with tf.device(variable.device):
            return tf.fill(variable.shape if shape is None else shape, tf.cast(value, dtype))
    return make


class SlotsInPlace:
    """Mixin for a Keras optimizer: slots of zeros start on their variable's device
    (`initial_slot`)."""

    def add_variable_from_reference(self, model_variable, variable_name, shape=None,
                                    initial_value=None):
        if initial_value is None:
            initial_value = initial_slot(model_variable, shape)
        return super().add_variable_from_reference(model_variable, variable_name, shape,
                                                   initial_value)


class Adagrad(SlotsInPlace, keras.optimizers.Adagrad):
    """`keras.optimizers.Adagrad` whose accumulators start on their variable's device:
    the same update, slots and checkpoint."""

    def build(self, var_list):
        keras.optimizers.Optimizer.build(self, var_list)
        if getattr(self, "_built", False):
            return
        self._built = True
        self._accumulators = [
            self.add_variable_from_reference(
                var, "accumulator",
                initial_value=initial_slot(var, value=self.initial_accumulator_value))
            for var in var_list]


class Adam(SlotsInPlace, keras.optimizers.Adam):
    """`keras.optimizers.Adam`, updating dense gradients with one fused kernel.

    The same update, slots and checkpoint as Keras' Adam (the class keeps its
    name, so checkpoints written by either restore into the other). Sparse
    gradients (`IndexedSlices`, from embedding lookups) and `amsgrad` take
    Keras' own path. Its slots start on their variable's device.
    """

    def update_step(self, gradient, variable):
        if isinstance(gradient, tf.IndexedSlices) or self.amsgrad:
            return super().update_step(gradient, variable)
        dtype = variable.dtype
        step = tf.cast(self.iterations + 1, dtype)
        beta_1, beta_2 = tf.cast(self.beta_1, dtype), tf.cast(self.beta_2, dtype)
        key = self._index_dict[self._var_key(variable)]
        return tf.raw_ops.ResourceApplyAdam(
            var=variable.handle, m=self._momentums[key].handle,
            v=self._velocities[key].handle,
            beta1_power=tf.pow(beta_1, step), beta2_power=tf.pow(beta_2, step),
            lr=tf.cast(self.learning_rate, dtype), beta1=beta_1, beta2=beta_2,
            epsilon=tf.cast(self.epsilon, dtype), grad=tf.cast(gradient, dtype))


def fp16_all_reduce(optimizer_class: type) -> type:
    """`optimizer_class`, with the gradients summed over replicas as float16.

    Keras sums the replicas' gradients in `aggregate_gradients`, its hook for
    custom aggregation. Casting to float16 around it halves the bytes each
    all-reduce sends, as Horovod's `Compression.fp16` and DDP's
    `fp16_compress_hook` do. Keras scales the loss by the global batch, so the
    sum is already the mean gradient and stays well inside float16's range;
    the optimizer updates the float32 variables with the sum cast back.
    """

    class FP16AllReduce(optimizer_class):
        def aggregate_gradients(self, grads_and_vars):
            pairs = [(_cast(g, tf.float16), v) for g, v in grads_and_vars]
            return [(_cast(g, v.dtype), v) for g, v in super().aggregate_gradients(pairs)]

    # Saved under the base class's name: what is saved is that optimizer and its
    # state (the compression is how replicas talk), so an exported model loads
    # without this class.
    FP16AllReduce.__name__ = FP16AllReduce.__qualname__ = optimizer_class.__name__
    return FP16AllReduce


def fp16_push(optimizer_class: type) -> type:
    """`optimizer_class`, with each gradient sent to its variable as float16.

    Under ParameterServerStrategy a worker computes the gradients and the
    update runs where the variable lives, on a ps task, so every gradient
    crosses the network. The cast to float16 happens on the worker, after
    Keras' `aggregate_gradients`; the cast back happens in `update_step`,
    which Keras runs colocated with the variable: the push carries half the
    bytes and the ps updates the float32 variable and its slots as before.
    """

    class FP16Push(optimizer_class):
        def aggregate_gradients(self, grads_and_vars):
            summed = super().aggregate_gradients(grads_and_vars)
            return [(_cast(g, tf.float16), v) for g, v in summed]

        def update_step(self, gradient, variable):
            return super().update_step(_cast(gradient, variable.dtype), variable)

    FP16Push.__name__ = FP16Push.__qualname__ = optimizer_class.__name__  # as FP16AllReduce
    return FP16Push


def _cast(gradient, dtype):
    return None if gradient is None else tf.cast(gradient, dtype)
