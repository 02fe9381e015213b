"""Optimizers: Keras' Adagrad and Adam with their slots made in place, Adagrad's
sparse update made cheap under mirrored strategies, Adam's dense update fused, and
the gradient compressions.

Under MultiWorkerMirrored, Keras' Adagrad sent each embedding table's gradient
as its own all-reduce (three collectives in sequence) and read the whole
accumulator to update a few rows; `Adagrad` sends every table's rows in one
all-gather (`GatheredSlices`) and reads only those rows (`local_copy`).

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


def local_copy(slot, variable):
    """The copy of a mirrored `slot` on `variable`'s device; any other slot as it is.

    Inside the update of a MirroredVariable Keras passes the optimizer each copy
    of the variable, one device at a time, and its slots whole. Writes to a
    mirrored slot go to the copy being updated, but `tf.gather` of one reads the
    whole slot first (a DistributedVariable has no `sparse_read`): a sparse
    update then cost time in proportion to the table.
    """
    for copy in tf.distribute.get_strategy().experimental_local_results(slot):
        if copy.device == variable.device:
            return copy
    return slot


class GatheredSlices:
    """Mixin for a Keras optimizer: the replicas' sparse gradients cross in one all-gather.

    Keras sums each gradient over the replicas on its own; TensorFlow's collective
    all-reduce of an `IndexedSlices` (an embedding table's gradient: the rows a
    batch looked up) is three collectives in sequence: the lengths, the values,
    the indices. A model with 26 tables ran 78 of them a step. Here every
    sparse gradient of the step is packed into one float32 tensor (each
    gradient's row count, its values, its int64 indices bitcast) and crosses in
    one `ReplicaContext.all_gather` (which exchanges the lengths, then the data).
    Each replica gets every replica's rows, concatenated, as the all-reduce gives
    them; Keras then sums repeated rows before the update.
    """

    def aggregate_gradients(self, grads_and_vars):
        pairs = list(grads_and_vars)
        context = tf.distribute.get_replica_context()
        packed = [i for i, (g, _) in enumerate(pairs) if _packable(g)]
        if context is None or context.num_replicas_in_sync == 1 or len(packed) < 2:
            return super().aggregate_gradients(pairs)
        rest = [p for i, p in enumerate(pairs) if i not in packed]
        summed = iter(super().aggregate_gradients(rest) if rest else [])
        gathered = iter(gather_slices(context, [pairs[i][0] for i in packed]))
        return [(next(gathered), v) if i in packed else next(summed)
                for i, (_, v) in enumerate(pairs)]


def _packable(gradient) -> bool:
    return (isinstance(gradient, tf.IndexedSlices) and gradient.values.dtype == tf.float32
            and gradient.values.shape[1:].is_fully_defined())


def gather_slices(context, slices: list) -> list:
    """Every replica's rows of each of `slices` (IndexedSlices of float32 values), from
    one all-gather in replica `context`."""
    parts = [tf.cast(tf.stack([tf.shape(s.indices)[0] for s in slices]), tf.float32)]
    for s in slices:
        parts.append(tf.reshape(s.values, [-1]))
        parts.append(tf.reshape(tf.bitcast(tf.cast(s.indices, tf.int64), tf.float32), [-1]))
    gathered = context.all_gather(tf.concat(parts, 0), axis=0)

    rows = [([], []) for _ in slices]
    start = tf.constant(0)
    for _ in range(context.num_replicas_in_sync):  # each replica's part, in turn
        counts = tf.cast(gathered[start:start + len(slices)], tf.int32)
        start += len(slices)
        for t, ((values, indices), s) in enumerate(zip(rows, slices, strict=True)):
            count = counts[t]
            width = s.values.shape[1:].num_elements()
            values.append(tf.reshape(gathered[start:start + count * width],
                                     [-1, *s.values.shape[1:]]))
            start += count * width
            indices.append(tf.bitcast(tf.reshape(gathered[start:start + 2 * count], [-1, 2]),
                                      tf.int64))
            start += 2 * count
    return [tf.IndexedSlices(tf.concat(values, 0), tf.cast(tf.concat(indices, 0), s.indices.dtype),
                             s.dense_shape)
            for (values, indices), s in zip(rows, slices, strict=True)]


class Adagrad(GatheredSlices, SlotsInPlace, keras.optimizers.Adagrad):
    """`keras.optimizers.Adagrad`, the same update, slots and checkpoint, whose
    accumulators start on their variable's device, whose sparse gradients cross
    replicas in one all-gather (`GatheredSlices`), and whose sparse update reads
    only the looked-up rows of a mirrored accumulator (`local_copy`)."""

    def update_step(self, gradient, variable):
        if not isinstance(gradient, tf.IndexedSlices):
            return super().update_step(gradient, variable)
        lr = tf.cast(self.learning_rate, variable.dtype)
        accumulator = local_copy(
            self._accumulators[self._index_dict[self._var_key(variable)]], variable)
        accumulator.scatter_add(tf.IndexedSlices(gradient.values * gradient.values,
                                                 gradient.indices))
        rows = tf.gather(accumulator, gradient.indices)
        variable.scatter_add(tf.IndexedSlices(-lr * gradient.values / tf.sqrt(rows + self.epsilon),
                                              gradient.indices))

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
