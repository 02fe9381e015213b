"""Click-through prediction with sharded embedding tables: the workload parameter
servers exist for.

The data is `ctr_data`'s synthetic Criteo-shaped click log (13 dense counts,
26 categorical ids from Zipf laws, clicks from a planted teacher), generated
from the example index wherever it is read; the model is DLRM (`dlrm`),
whose tables train with Adagrad (or SGD), which touches only the rows a batch
looked up, and its MLPs with Adam.

Because the teacher is known, metrics.json reports the Bayes-optimal AUC and
log-loss of the test set (from the teacher's click probabilities) beside the
model's, and the gap. When the tables live on parameter servers it also
reports, per ps task, the bytes a training step moves: predicted from the Zipf
laws (the expected number of distinct ids per table in a batch, as
`python -m tools.plan` predicts it) and counted on sampled training batches.

    python -m app.train --config configs/recommender.toml
    python -m app.train --config configs/recommender.toml --set task.train_offset=5000000

(the second trains on examples [5M, 6M) and tests on the same examples as the first).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import numpy as np
import tensorflow as tf

from app import dialects, indexed
from app.config import ConfigError, field
from app.task import Task
from app.tasks import ctr_data, dlrm, dlrm_keras3

MAX_ROWS = 2**31 - 1  # the spread permutation multiplies ids in int64
_TABLE_NAME = re.compile(r"(?:^|/)table_(\d+)/embeddings")
# The model's code, one module per Keras, each written in its module's `keras`.
MODELS = (dlrm, dlrm_keras3)
_INDEX_BYTES = 8  # one int64 per row: the id looked up, and the gradient's index


@dataclasses.dataclass(frozen=True)
class Params:
    # Rows of the 26 tables: Criteo's (ctr_data.CRITEO_ROWS, 33.8M rows in all,
    # the largest 10.1M) times this, each at least 2.
    table_scale: float = field(0.001, above=0)
    # s of the Zipf law each feature's ids follow: rank r has probability ~ (r + 1.5)^-s.
    zipf_exponent: float = field(1.05, above=0)
    # "spread": the hot ids are scattered over each table by a permutation;
    # "ranked": id = popularity rank, so the hot rows sit at the front of the
    # table, all on the first row shard.
    ids: str = field("spread", choices=("spread", "ranked"))
    # The generator's seed: the same data whatever train.seed is.
    data_seed: int = field(0, minimum=0)
    # Generated examples in one epoch of training (each split is drawn from its
    # own range of the generator's example indices).
    train_examples: int = field(1_000_000, above=0)
    # Index of the first training example: training reads examples
    # [train_offset, train_offset + train_examples). The validation and test
    # examples stay where train_offset = 0 puts them, right after
    # [0, train_examples), so windows of one size are compared on one test set;
    # a window must start at 0 or after the test examples.
    train_offset: int = field(0, minimum=0)
    # Examples held out for validation after each epoch (0 = none).
    validation_examples: int = field(0, minimum=0)
    # Examples of the test split (its Bayes-optimal AUC and log-loss are reported).
    test_examples: int = field(100_000, above=0)
    # Width of every embedding table's rows, and of the bottom MLP's output.
    embedding_dim: int = field(16, above=0)
    # The bottom MLP's hidden layer widths on the dense features, comma-separated
    # (it ends in a layer of embedding_dim).
    bottom_mlp: str = "64"
    # The top MLP's hidden layer widths on the interactions, comma-separated
    # (it ends in the one click logit).
    top_mlp: str = "128,64"
    # The tables' optimizer: one whose update touches only the rows a step looked
    # up (the dense layers use train.optimizer).
    table_optimizer: str = field("adagrad", choices=("adagrad", "sgd"))
    # The tables' learning rate (the dense layers use train.learning_rate).
    table_learning_rate: float = field(0.05, above=0)
    # Training batches sampled after training to count the rows each step reads
    # (the `ps_traffic` figures of parameter-server runs); 0 = do not count.
    traffic_batches: int = field(20, minimum=0)
    # The Keras the model is written in: "tf_keras" (Keras 2) or "keras" (Keras 3).
    keras: str = field("tf_keras", choices=dialects.NAMES)

    def __post_init__(self):
        for name in ("bottom_mlp", "top_mlp"):
            widths(name, getattr(self, name))
        held_out = self.train_examples + self.validation_examples + self.test_examples
        if 0 < self.train_offset < held_out:
            raise ConfigError(
                f"task.train_offset = {self.train_offset} trains on examples "
                f"[{self.train_offset}, {self.train_offset + self.train_examples}), which "
                f"overlap the validation and test examples [{self.train_examples}, {held_out}); "
                f"use 0 or at least {held_out}")
        largest = max(ctr_data.table_rows(self.table_scale))
        if largest > MAX_ROWS:
            raise ConfigError(
                f"task.table_scale = {self.table_scale} makes the largest table {largest} "
                f"rows; the generator allows at most {MAX_ROWS}: lower task.table_scale to "
                f"{MAX_ROWS / max(ctr_data.CRITEO_ROWS):.0f} or less")


def widths(name: str, text: str) -> tuple[int, ...]:
    """Layer widths of "256,64" (empty: none), or a ConfigError naming task.`name`."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        values = (0,)
    if any(v < 1 for v in values):
        raise ConfigError(f"task.{name} = {text!r} must be positive layer widths separated "
                          "by commas, e.g. '256,64' (or '' for none)")
    return values


class Recommender(Task):
    """Click prediction on generated Criteo-shaped data; the headline metric is test AUC."""

    Params = Params
    metric, higher_is_better = "auc", True
    step_batch: int | None = None  # examples one replica's step looks up (as traced)

    @functools.cached_property
    def generator(self) -> ctr_data.Generator:
        p = self.params
        return ctr_data.Generator(ctr_data.table_rows(p.table_scale), p.zipf_exponent,
                                  p.ids == "spread", p.data_seed)

    @property
    def dialect(self):
        """The Keras the model is written in (`task.keras`), as `app.dialects` speaks it."""
        return dialects.named(self.params.keras)

    @property
    def keras(self):
        return self.dialect.keras

    @property
    def dlrm(self):
        """The model's module: the one of `MODELS` written in the task's Keras."""
        return next(m for m in MODELS if m.keras is self.keras)

    def build_model(self):
        p = self.params
        return self.dlrm.model(self.generator.rows, p.embedding_dim,
                               widths("bottom_mlp", p.bottom_mlp), widths("top_mlp", p.top_mlp),
                               ctr_data.NUM_DENSE)

    def train_dataset(self, context, global_batch_size):
        # Pipeline i of n generates examples i, i+n, ...: disjoint parts, nothing read.
        # The examples are independent draws, so their order needs no shuffle.
        self.step_batch = context.get_per_replica_batch_size(global_batch_size)
        p = self.params
        indices = self.shard(tf.data.Dataset.range(p.train_offset,
                                                   p.train_offset + p.train_examples), context)
        return self._batches(indices.repeat(), self.step_batch, drop_remainder=True)

    def train_source(self):
        # Generated from the example index: nothing to load, any example at once.
        offset, generate = self.params.train_offset, self.generator.examples

        def read(loaded, indices):
            # Traced where the batch of one replica's step is known (traffic, below).
            self.step_batch = indices.shape[0] or self.step_batch
            return generate(offset + indices)[:2]

        return indexed.Source(self.params.train_examples, read)

    def eval_dataset(self, split, batch_size):
        start, count = self._split(split)
        if not count:
            return None
        return self._batches(tf.data.Dataset.range(start, start + count), batch_size)

    def _split(self, split: str) -> tuple[int, int]:
        """First example index and size of "validation" or "test": after examples
        [0, train_examples), wherever task.train_offset puts the training window."""
        p = self.params
        if split == "validation":
            return p.train_examples, p.validation_examples
        return p.train_examples + p.validation_examples, p.test_examples

    def _batches(self, indices: tf.data.Dataset, batch: int,
                 drop_remainder: bool = False) -> tf.data.Dataset:
        generate = self.generator.examples
        return (indices.batch(batch, drop_remainder=drop_remainder)
                .map(lambda i: generate(i)[:2], num_parallel_calls=tf.data.AUTOTUNE)
                .prefetch(tf.data.AUTOTUNE))

    def train_examples(self) -> int:
        return self.params.train_examples

    def eval_examples(self, split):
        return self._split(split)[1]

    def loss(self):
        return self.keras.losses.BinaryCrossentropy(from_logits=True)

    def metrics(self):
        # 1000 thresholds: the interpolated AUC is then within about 1e-4 of the exact one.
        return [self.keras.metrics.AUC(num_thresholds=1000, from_logits=True, name="auc")]

    def optimizer(self, learning_rate):
        # Each Keras' optimizers as the dialect has them: Keras 3's own, or the project's
        # fused Adam and Adagrad for tf_keras (app.dialects.keras2_optimizers).
        p, kind = self.params, self.dialect.optimizer_class
        return self.dlrm.SplitOptimizer(tables=kind(p.table_optimizer)(p.table_learning_rate),
                                        dense=kind("adam")(learning_rate))

    def serving_model(self, model):
        # The layers alone, without the optimizer pair: a server needs no training state.
        return self.keras.Model(model.inputs, model.outputs, name="recommender")

    # -- what the teacher and the Zipf laws tell --------------------------------------

    def lookup_rows(self, variable, shard_rows, batch_size):
        found = _TABLE_NAME.search(variable.name)
        if found is None:
            return None
        return self.expected_rows(int(found.group(1)), shard_rows, batch_size)

    def expected_rows(self, feature: int, shard_rows: list[int], batch: int) -> list[float]:
        """E[distinct ids of `feature`] in a batch of `batch`, per row shard of its table."""
        gen = self.generator
        bounds = np.concatenate([[0], np.cumsum(shard_rows)]).tolist()
        return ctr_data.expected_distinct(
            gen.laws[feature], functools.partial(gen.id_map.ids_of, feature), bounds, batch)

    def report(self, model, test):
        ceiling = self.ceiling("test")
        figures: dict[str, Any] = {
            "bayes_test_auc": round(ceiling["auc"], 6),
            "bayes_test_loss": round(ceiling["loss"], 6),
            "test_auc_gap": round(ceiling["auc"] - test["auc"], 6),
            "test_loss_gap": round(test["loss"] - ceiling["loss"], 6),
            "test_click_rate": round(ceiling["click_rate"], 6)}
        traffic = self.traffic(model)
        if traffic:
            figures["ps_traffic"] = traffic
        return figures

    def ceiling(self, split: str) -> dict[str, float]:
        """The Bayes-optimal AUC and log-loss ("loss") of `split`, those of the teacher's
        own click probabilities, and its click rate."""
        start, count = self._split(split)
        generate = tf.function(self.generator.examples)
        clicks, probabilities = [], []
        for index in tf.data.Dataset.range(start, start + count).batch(50_000):
            _, click, probability = generate(index)
            clicks.append(click.numpy()[:, 0])
            probabilities.append(probability.numpy())
        y, p = np.concatenate(clicks), np.concatenate(probabilities)
        return {"auc": ctr_data.auc(y, p), "loss": ctr_data.log_loss(y, p),
                "click_rate": float(y.mean())}

    def traffic(self, model) -> dict[str, Any] | None:
        """Bytes each ps task sends and receives per training step, predicted and counted;
        None unless the tables live on ps tasks."""
        if not self.step_batch:
            return None
        shards = [_parts(model.get_layer(f"table_{f}").embeddings)
                  for f in range(len(self.generator.rows))]
        if not all(_ps_task(part) is not None for parts in shards for part in parts):
            return None
        parts = {id(part) for group in shards for part in group}
        trainable = [part for v in model.trainable_variables for part in _parts(v)]
        num_ps = 1 + max(_ps_task(v) for v in trainable)
        dense = [0] * num_ps  # every other variable is read whole and its gradient sent whole
        for var in trainable:
            if id(var) not in parts:
                dense[_ps_task(var)] += var.shape.num_elements() * var.dtype.size
        predicted, counted = [0.0] * num_ps, [0.0] * num_ps
        sample = self._sampled_ids()
        hottest = (1.0, "")  # the table whose shards read the most unevenly
        for f, group in enumerate(shards):
            rows = [part.shape[0] for part in group]
            expected = self.expected_rows(f, rows, self.step_batch)
            seen = _distinct_per_shard(sample[:, :, f], rows)
            for part, e, c in zip(group, expected, seen, strict=True):
                predicted[_ps_task(part)] += e
                counted[_ps_task(part)] += c
            hottest = max(hottest, (max(seen) * len(seen) / max(sum(seen), 1e-9), f"table_{f}"))
        figures = _traffic_figures(predicted, counted, dense, self.params.embedding_dim * 4,
                                   self.step_batch, len(sample))
        # A hot shard shows here even when the ps tasks' totals even out over tables.
        figures["most_uneven_table"] = {"table": hottest[1], "shard_rows_max_over_mean":
                                        round(hottest[0], 4)}
        return figures

    def _sampled_ids(self) -> np.ndarray:
        """The ids of the first `traffic_batches` training batches: [batches, batch, 26]."""
        p = self.params
        count = p.traffic_batches * self.step_batch
        batches = self._batches(tf.data.Dataset.range(p.train_offset, p.train_offset + count),
                                self.step_batch, True)
        ids = [features["cat"].numpy() for features, _ in batches]
        return np.stack(ids) if ids else np.zeros((0, self.step_batch, len(self.generator.rows)))


def _parts(variable) -> list:
    """The TensorFlow variables of a model's variable: its shards, or itself (a Keras 3
    variable wraps a ShardedVariable or a variable; tf_keras lists the shards)."""
    if not isinstance(variable, tf.Variable):
        variable = getattr(variable, "value", variable)
    parts = None if isinstance(variable, tf.Variable) else getattr(variable, "variables", None)
    return list(parts) if parts else [variable]


def _ps_task(variable) -> int | None:
    spec = tf.DeviceSpec.from_string(variable.device)
    return spec.task if spec.job == "ps" else None


def _distinct_per_shard(ids: np.ndarray, shard_rows: list[int]) -> list[float]:
    """Mean over the batches (rows of `ids`) of the distinct ids each shard holds."""
    if not len(ids):
        return [float("nan")] * len(shard_rows)
    edges = np.cumsum(shard_rows)[:-1]
    counts = [np.bincount(np.searchsorted(edges, np.unique(batch), side="right"),
                          minlength=len(shard_rows)) for batch in ids]
    return np.mean(counts, axis=0).tolist()


def _traffic_figures(predicted: list[float], counted: list[float], dense: list[int],
                     row_bytes: int, batch: int, batches: int) -> dict[str, Any]:
    """Per ps task: ps -> worker bytes (table rows, whole dense variables) and
    worker -> ps bytes (the ids looked up and the gradient rows with their
    indices, whole dense gradients), for the predicted and the counted rows."""
    def read(rows):
        return [round(r * row_bytes + d) for r, d in zip(rows, dense, strict=True)]

    def written(rows):
        return [round(r * (row_bytes + 2 * _INDEX_BYTES) + d)
                for r, d in zip(rows, dense, strict=True)]

    def balance(values):
        return round(max(values) / (sum(values) / len(values)), 4) if sum(values) else 1.0

    return {
        "basis": (f"one training step ({batch} examples on one worker); counted = distinct "
                  f"ids in {batches} generated training batches, not bytes on the wire"),
        "predicted_table_rows": [round(r, 1) for r in predicted],
        "counted_table_rows": [round(r, 1) for r in counted],
        "predicted_read_bytes": read(predicted), "counted_read_bytes": read(counted),
        "predicted_written_bytes": written(predicted), "counted_written_bytes": written(counted),
        "counted_read_balance": balance(read(counted)),
        "predicted_read_balance": balance(read(predicted)),
    }
