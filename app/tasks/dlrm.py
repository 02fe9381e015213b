"""DLRM (Naumov et al., 2019) in Keras, and the optimizer pair that trains it.

The model: a bottom MLP turns the dense features into a vector the size of
an embedding; each categorical feature looks up its row of its own table;
every pair of those vectors meets in a dot product; a top MLP reads the dots
and the bottom vector and gives the click logit. Nothing in it knows about
strategies: under ParameterServerStrategy the tables become ShardedVariables
and `Table` reads only the rows a batch needs.

`SplitOptimizer` trains the tables with an optimizer whose update touches only
the looked-up rows (Adagrad or SGD) and everything else with another (Adam):
Keras' Adam would rewrite every row of every table and both its slots each step.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import tensorflow as tf
import tf_keras as keras

# Keras names an Embedding's weight "embeddings"; a ShardedVariable's parts end in /part_<i>.
_TABLE = re.compile(r"(^|/)embeddings(/part_\d+)?(:\d+)?$")


def is_table(variable: tf.Variable) -> bool:
    """Whether `variable` (or a part of it) is an embedding table, read by lookup."""
    return bool(_TABLE.search(variable.name))


@keras.saving.register_keras_serializable("recommender")
class Table(keras.layers.Embedding):
    """An embedding table that fetches each distinct id of a batch once.

    Keras' Embedding gathers one row per id: on parameter servers every
    repeat of a popular id would be one more row sent. This looks up the
    batch's unique ids and expands them on the worker, so a step moves each
    row it needs once, and the gradient goes back as IndexedSlices of exactly
    those rows.
    """

    def call(self, ids):
        flat = tf.reshape(ids, [-1])
        unique, position = tf.unique(flat)
        rows = tf.gather(tf.nn.embedding_lookup(_local(self.embeddings), unique), position)
        rows = tf.reshape(rows, tf.concat([tf.shape(ids), [self.output_dim]], 0))
        if self.compute_dtype != self.dtype:  # mixed precision: cast the rows, as Embedding does
            rows = tf.cast(rows, self.compute_dtype)
        return rows


def _local(table: tf.Variable) -> tf.Variable:
    """This replica's own copy of a mirrored `table`; any other table as it is.

    TF 2.21's embedding_lookup gathers rows in place only from a resource
    variable (or a ShardedVariable's parts); a MirroredVariable it reads whole
    first, and the step's sparse update of the table then copies all of it
    (copy-on-write), so each step cost time in proportion to the table's size.
    The replica's component is a resource variable, gathered row by row.
    """
    context = tf.distribute.get_replica_context()
    copies = tf.distribute.get_strategy().experimental_local_results(table)
    if context is None or len(copies) == 1:
        return copies[0] if len(copies) == 1 else table
    replica = tf.get_static_value(context.replica_id_in_sync_group)
    return table if replica is None else copies[replica % len(copies)]


@keras.saving.register_keras_serializable("recommender")
class DotInteraction(keras.layers.Layer):
    """DLRM's interaction: the dot product of every pair of the given vectors."""

    def call(self, vectors):
        n = len(vectors)
        stacked = tf.stack(vectors, axis=1)  # [batch, n, dim]
        dots = tf.matmul(stacked, stacked, transpose_b=True)
        below_diagonal = [i * n + j for i in range(n) for j in range(i)]
        return tf.gather(tf.reshape(dots, [-1, n * n]), below_diagonal, axis=1)


def model(rows: Sequence[int], dim: int, bottom: Sequence[int], top: Sequence[int],
          num_dense: int) -> keras.Model:
    """DLRM over raw features: "dense" counts [batch, num_dense] and "cat" ids
    [batch, len(rows)], table f holding rows[f] rows of `dim` floats."""
    layers = keras.layers
    dense = keras.Input((num_dense,), name="dense")
    cat = keras.Input((len(rows),), name="cat", dtype="int64")
    x = tf.math.log1p(tf.nn.relu(dense))  # counts span decades; the export takes them raw
    for i, units in enumerate((*bottom, dim)):
        x = layers.Dense(units, activation="relu", name=f"bottom_{i}")(x)
    ids = tf.unstack(cat, axis=1)
    vectors = [Table(n, dim, name=f"table_{f}")(ids[f]) for f, n in enumerate(rows)]
    h = layers.Concatenate(name="top_input")([x, DotInteraction(name="interaction")([x, *vectors])])
    for i, units in enumerate(top):
        h = layers.Dense(units, activation="relu", name=f"top_{i}")(h)
    # float32 logits under a mixed-precision policy, so the loss is computed in full precision.
    return keras.Model({"dense": dense, "cat": cat},
                       layers.Dense(1, dtype="float32", name="logit")(h), name="dlrm")


class _CallableList(list):
    """A list that is also callable, as Keras' `optimizer.variables` is (property or method)."""

    def __call__(self):
        return self


@keras.saving.register_keras_serializable("recommender")
class SplitOptimizer(keras.optimizers.Optimizer):
    """Embedding tables (`is_table`) with one optimizer, all other variables with another.

    Each step hands each optimizer its own (gradient, variable) pairs, so each
    does what Keras' optimizers do under every strategy: aggregate over
    replicas, then update each variable where it lives (on its ps task, under
    ParameterServerStrategy) inside a merge call. The tables' gradients stay
    IndexedSlices all the way, and Adagrad and SGD update only their rows.
    Both count the same steps; `iterations` is the dense optimizer's count.
    Checkpoints hold both, with their slots, as `tables` and `dense`.
    """

    def __init__(self, tables: keras.optimizers.Optimizer, dense: keras.optimizers.Optimizer,
                 name: str = "SplitOptimizer", **kwargs):
        super().__init__(name=name, jit_compile=False, **kwargs)
        self.tables, self.dense = tables, dense

    def _create_iteration_variable(self):
        pass  # no counter of its own: `iterations` is the dense optimizer's

    @property
    def iterations(self):
        return self.dense.iterations

    @property
    def learning_rate(self):
        return self.dense.learning_rate

    @learning_rate.setter
    def learning_rate(self, value):
        self.dense.learning_rate = value

    @property
    def _learning_rate(self):  # what Keras' TensorBoard callback reads for a schedule
        return self.dense._learning_rate

    @property
    def variables(self):
        return _CallableList([*self.tables.variables, *self.dense.variables])

    def build(self, var_list):
        if getattr(self, "_built", False):
            return
        self.tables.build([v for v in var_list if is_table(v)])
        self.dense.build([v for v in var_list if not is_table(v)])
        self._built = True

    def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation=False,
                        **kwargs):
        pairs = list(grads_and_vars)
        tables = [(g, v) for g, v in pairs if is_table(v)]
        dense = [(g, v) for g, v in pairs if not is_table(v)]
        if tables:
            self.tables.apply_gradients(
                tables, skip_gradients_aggregation=skip_gradients_aggregation, **kwargs)
        return self.dense.apply_gradients(
            dense, skip_gradients_aggregation=skip_gradients_aggregation, **kwargs)

    def update_step(self, gradient, variable):
        raise NotImplementedError("SplitOptimizer applies gradients through its two optimizers")

    def get_config(self):
        return {"name": self.name, "tables": keras.optimizers.serialize(self.tables),
                "dense": keras.optimizers.serialize(self.dense)}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        tables = keras.optimizers.deserialize(config.pop("tables"), custom_objects=custom_objects)
        dense = keras.optimizers.deserialize(config.pop("dense"), custom_objects=custom_objects)
        return cls(tables, dense, name=config.get("name", "SplitOptimizer"))
