"""DLRM in Keras 3, and its optimizer pair: `app.tasks.dlrm`'s model in `import keras`.

The same network as `dlrm.model` (see there), with Keras 3's own Embedding for
the tables: under parameter servers the project's loop looks up only the rows
a batch needs, shard by shard (`app.dialects.keras3_ps`). `SplitOptimizer`
trains the tables with an optimizer whose update touches only the looked-up
rows (Adagrad or SGD) and everything else with another (Adam).
"""

from __future__ import annotations

from collections.abc import Sequence

import keras

from app.tasks.dlrm import is_table as _is_table_variable


def is_table(variable) -> bool:
    """Whether a Keras 3 `variable` (or one shard of one) is an embedding table."""
    value = variable.value if isinstance(variable, keras.Variable) else variable
    return _is_table_variable(value)


@keras.saving.register_keras_serializable("recommender_keras3")
class DotInteraction(keras.layers.Layer):
    """DLRM's interaction: the dot product of every pair of the given vectors."""

    def call(self, vectors):
        n = len(vectors)
        stacked = keras.ops.stack(vectors, axis=1)  # [batch, n, dim]
        dots = keras.ops.matmul(stacked, keras.ops.transpose(stacked, (0, 2, 1)))
        below_diagonal = [i * n + j for i in range(n) for j in range(i)]
        return keras.ops.take(keras.ops.reshape(dots, (-1, n * n)), below_diagonal, axis=1)

    def compute_output_shape(self, shapes):
        n = len(shapes)
        return (shapes[0][0], n * (n - 1) // 2)


def model(rows: Sequence[int], dim: int, bottom: Sequence[int], top: Sequence[int],
          num_dense: int) -> keras.Model:
    """DLRM over raw features: "dense" counts [batch, num_dense] and "cat" ids
    [batch, len(rows)], table f holding rows[f] rows of `dim` floats."""
    layers = keras.layers
    dense = keras.Input((num_dense,), name="dense")
    cat = keras.Input((len(rows),), name="cat", dtype="int64")
    x = keras.ops.log1p(keras.ops.relu(dense))  # counts span decades; the export takes them raw
    for i, units in enumerate((*bottom, dim)):
        x = layers.Dense(units, activation="relu", name=f"bottom_{i}")(x)
    vectors = [layers.Embedding(n, dim, name=f"table_{f}")(cat[:, f]) for f, n in enumerate(rows)]
    h = layers.Concatenate(name="top_input")([x, DotInteraction(name="interaction")([x, *vectors])])
    for i, units in enumerate(top):
        h = layers.Dense(units, activation="relu", name=f"top_{i}")(h)
    # float32 logits under a mixed-precision policy, so the loss is computed in full precision.
    return keras.Model({"dense": dense, "cat": cat},
                       layers.Dense(1, dtype="float32", name="logit")(h), name="dlrm")


@keras.saving.register_keras_serializable("recommender_keras3")
class SplitOptimizer(keras.optimizers.Optimizer):
    """Embedding tables (`is_table`) with one Keras 3 optimizer, all other variables with
    another. Each applies its own gradients as it would alone (aggregated over
    replicas, each variable updated where it lives). `iterations` is the dense
    optimizer's count, and the pair's own counter counts the same steps; checkpoints
    hold both optimizers, with their slots, as `tables` and `dense`."""

    def __init__(self, tables: keras.optimizers.Optimizer, dense: keras.optimizers.Optimizer,
                 name: str = "split_optimizer", **kwargs):
        super().__init__(learning_rate=0.0, name=name, **kwargs)
        self.tables, self.dense = tables, dense

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
    def variables(self):
        return [*self.tables.variables, *self.dense.variables]

    def build(self, var_list):
        if self.built:
            return
        self.tables.build([v for v in var_list if is_table(v)])
        self.dense.build([v for v in var_list if not is_table(v)])
        self.built = True

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            self.build(trainable_variables)
        pairs = list(zip(grads, trainable_variables, strict=True))
        tables = [(g, v) for g, v in pairs if is_table(v)]
        dense = [(g, v) for g, v in pairs if not is_table(v)]
        if tables:
            self.tables.apply([g for g, _ in tables], [v for _, v in tables])
        self.dense.apply([g for g, _ in dense], [v for _, v in dense])
        # Keras' Optimizer has a counter of its own, which only its own `apply` moves:
        # a checkpoint's optimizer/_iterations read 0 after any number of steps, as
        # does whatever reads `_iterations` (Keras 3.15 base_optimizer.py: a schedule,
        # `_get_current_learning_rate`). Not shared with the dense optimizer's: a backup
        # written before this held 0 in it, and restoring that into a shared counter
        # set the dense one's (Adam's bias correction) back to 0.
        self._iterations.assign_add(1)

    def get_config(self):
        return {"name": self.name, "tables": keras.optimizers.serialize(self.tables),
                "dense": keras.optimizers.serialize(self.dense)}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        tables = keras.optimizers.deserialize(config.pop("tables"), custom_objects=custom_objects)
        dense = keras.optimizers.deserialize(config.pop("dense"), custom_objects=custom_objects)
        return cls(tables, dense, name=config.get("name", "split_optimizer"))

