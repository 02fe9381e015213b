"""Exact evaluation under ParameterServerStrategy, on the workers, computed by Keras.

Every batch is evaluated once, by a worker against the ps-held variables, with
the model's own `test_step` (Keras' by default): sample weights, several
outputs, `add_loss` and regularization terms, `add_metric` and a custom
`test_step` count as they do in `evaluate` on one process. The batches are
split into shards, one closure each; the chief schedules them and reads the
totals from the metric variables, which live on the ps tasks.

Keras' own exact evaluation (`compile(..., pss_evaluation_shards=N)`) is not
used: in tf_keras 2.21 (training.py `_make_test_function_exact`) it skips
`test_step`, leaves `model.losses` out of the loss, passes a multi-output
model's whole output structure to each per-output metric (a TypeError) and
refuses `add_metric`; and inside the worker's function it cannot see the
dataset's sharding option, so it shards by file and fails on a test split in
fewer files than shards ("Could not apply FILE based sharding: the dataset only
has 1 file(s)"). What it does better: it counts each shard into copies local
to the worker, so a shard retried after a worker failure counts once. Here a
worker lost mid-evaluation has its shard run again elsewhere, and the batches
it had already evaluated count twice: exact unless a worker fails during it.
"""

from __future__ import annotations

from collections.abc import Callable

import tensorflow as tf

# Shards per worker: more balance the work (a shard is the unit a worker takes),
# fewer read less (each shard's pipeline reads the whole split and keeps every n-th batch).
SHARDS_PER_WORKER = 2

Evaluate = Callable[[tf.data.Dataset], dict[str, float]]


def evaluator(model, coordinator: tf.distribute.coordinator.ClusterCoordinator,
              num_workers: int, parallel: bool = True) -> Evaluate:
    """evaluate(dataset) -> {"loss": ..., metric: ...}: every batch of the finite,
    batched `dataset` once, on the workers, through `model`'s own test step (a compiled
    model of either Keras); with `parallel` False, on one worker at a
    time (for metrics whose updates two workers must not make at once)."""
    return _ShardedTestStep(model, coordinator,
                            SHARDS_PER_WORKER * num_workers if parallel else 1)


class _ShardedTestStep:
    """The model's own test_step over `shards` shards of the batches, one closure each."""

    def __init__(self, model, coordinator, shards: int):
        self.model, self.coordinator, self.shards = model, coordinator, shards
        strategy = model.distribute_strategy

        @tf.function
        def shard(dataset: tf.data.Dataset, index: tf.Tensor) -> None:
            for batch in dataset.shard(shards, index):
                strategy.run(model.test_step, args=(batch,))

        self._shard = shard

    def __call__(self, dataset: tf.data.Dataset) -> dict[str, float]:
        # The dataset's graph, sent to every worker once; `build()` makes each worker's
        # copy without an iterator (as tf_keras 2.21's exact evaluation does), so
        # that a shard can take its part.
        per_worker = self.coordinator.create_per_worker_dataset(dataset).build()
        self.model.reset_metrics()
        for index in range(self.shards):
            self.coordinator.schedule(self._shard,
                                      args=(per_worker, tf.constant(index, tf.int64)))
        self.coordinator.join()
        return _floats(self.model.get_metrics_result())


def _floats(results: dict) -> dict[str, float]:
    return {name: float(value) for name, value in results.items()}
