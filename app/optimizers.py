"""Optimizers that Keras has but runs slowly on CPU.

Keras' Adam updates a variable with about ten element-wise ops, each a full
pass over the variable and its two slots. TensorFlow's `ResourceApplyAdam`
kernel (the one the TF1 and legacy Keras optimizers used) does the same
arithmetic in one pass, and on CPU the update is bound by memory, so the
passes are what it costs. Every strategy pays for the update; a
MultiWorkerMirrored worker pays for all of it on its share of the cores.

Keras can compile its update with XLA instead, but turns that off without a
GPU (`Optimizer.jit_compile`); forced on, the single process trained slower.
"""

from __future__ import annotations

import tensorflow as tf
import tf_keras as keras


class Adam(keras.optimizers.Adam):
    """`keras.optimizers.Adam`, updating dense gradients with one fused kernel.

    The same update, slots and checkpoint as Keras' Adam (the class keeps its
    name, so checkpoints written by either restore into the other). Sparse
    gradients (`IndexedSlices`, from embedding lookups) and `amsgrad` take
    Keras' own path.
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
