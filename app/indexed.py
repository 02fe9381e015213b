"""Training examples read by index, in one global order that failures do not change.

A task that can give its training examples by index (`Task.train_source`) trains
on batches that are a function of the step alone: global batch `step` is a fixed
set of example indices, drawn from a permutation of the examples that depends on
(`train.seed`, epoch) only (`Order`). Which strategy runs, how many workers,
replicas or ps tasks there are, and what failed change who reads a batch, never
what it holds. The whole state of the input is then one number, the next step,
which every backup already holds (the optimizer's step counter).

Why not TensorFlow's own pieces: a distributed iterator cannot be checkpointed
(tensorflow#56372); a ClusterCoordinator runs a closure at least once and a
recovered worker rebuilds its dataset from the start; Keras' resume gives a fresh
iterator. So the pipeline is built from the step: `dataset` for Keras' fit (one
process, Mirrored, MultiWorkerMirrored), `batch` inside a step scheduled on a
parameter-server worker, which takes its step as an argument and reads the same
batch however often it runs. The order uses the public
`tf.random.experimental.index_shuffle` permutation (`Dataset.global_shuffle` is
private in TF 2.21).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import tensorflow as tf

# A dataset of batches, for each step from the first the reader needs, without end.
_ENDLESS = 2**62


@dataclasses.dataclass(frozen=True)
class Source:
    """A task's training examples, by index.

    - `size`: how many there are; an epoch is a permutation of range(size).
    - `read(loaded, indices)`: the batch of examples `indices` (an int64 vector), as
      the model's fit takes it: (features, labels) or (features, labels, weights).
      It runs inside TensorFlow functions where the data is read (on each worker
      under parameter servers), so it must not call Python code per batch.
    - `load()`: what `read` reads from, made once per reading process and cached
      there (arrays read from files, say); None if `read` needs nothing
      (`loaded` is then None).
    - `augment(batch, seeds)`: per-example randomness, seeded by `seeds`, an int64
      [n, 2] tensor from (train.seed, epoch, index): a re-read example is the same
      example. For `tf.random.stateless_*` ops.
    """

    size: int
    read: Callable[[Any, tf.Tensor], Any]
    load: Callable[[], Any] | None = None
    augment: Callable[[Any, tf.Tensor], Any] | None = None

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"Source.size must be at least 1, got {self.size}")


@dataclasses.dataclass(frozen=True)
class Order:
    """Which examples global batch `step` holds: positions step*batch .. of its epoch
    in the permutation of (seed, epoch). An epoch longer than the examples goes on
    to a new permutation (seed, epoch, pass)."""

    size: int
    batch: int
    steps_per_epoch: int
    seed: int

    def indices(self, step: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """The example indices of global batch `step` (int64 [batch]), and their
        augmentation seeds (int64 [batch, 2])."""
        step = tf.cast(step, tf.int64)
        epoch = step // self.steps_per_epoch
        positions = (step % self.steps_per_epoch) * self.batch + tf.range(self.batch,
                                                                          dtype=tf.int64)
        passes = positions // self.size
        seed = tf.stack([tf.fill([self.batch], tf.constant(self.seed, tf.int64)),
                         tf.fill([self.batch], epoch), passes], axis=1)
        # The raw op takes one seed per index; tf.random.experimental.index_shuffle
        # pads a [n, 2] seed along the wrong axis for that.
        indices = tf.raw_ops.RandomIndexShuffle(
            index=positions % self.size, seed=seed,
            max_index=tf.constant(self.size - 1, tf.int64), rounds=4)
        seeds = tf.stack([tf.fill([self.batch], self.seed + epoch * 2**32), indices], axis=1)
        return indices, seeds


def batch(source: Source, order: Order, loaded: Any, step: tf.Tensor) -> Any:
    """Global batch `step`, whole: what one parameter-server worker trains on."""
    indices, seeds = order.indices(step)
    return _examples(source, loaded, indices, seeds)


def _examples(source: Source, loaded: Any, indices: tf.Tensor, seeds: tf.Tensor) -> Any:
    examples = source.read(loaded, indices)
    return source.augment(examples, seeds) if source.augment else examples


def loaded_dataset(source: Source) -> tf.data.Dataset:
    """`source.load()`, made once and then repeated without end: one element, the same
    tensors each time (a per-worker iterator of it has no position to lose)."""
    def load(_):
        return source.load()

    return tf.data.Dataset.from_tensors(0).map(load).cache().repeat()


def dataset(source: Source, order: Order, context: tf.distribute.InputContext,
            first_step: Callable[[], tf.Tensor]) -> tf.data.Dataset:
    """This input pipeline's part of every global batch from `first_step()` on, one
    element per replica it feeds: pipeline i of n takes the i-th n-th of each global
    batch, and its replicas that part's consecutive slices. `first_step` is read when
    the pipeline starts (after a backup was restored), not when it is built."""
    pipelines, pipeline = context.num_input_pipelines, context.input_pipeline_id
    replicas = max(context.num_replicas_in_sync // pipelines, 1)
    per_replica = context.get_per_replica_batch_size(order.batch)

    def parts(step):
        indices, seeds = order.indices(step)
        return (tf.reshape(indices, [pipelines, replicas, per_replica])[pipeline],
                tf.reshape(seeds, [pipelines, replicas, per_replica, 2])[pipeline])

    def steps(_):
        return tf.data.Dataset.range(first_step(), _ENDLESS)

    return _read(source, tf.data.Dataset.range(1).flat_map(steps).map(parts).unbatch())


def pipeline(source: Source, indices: tf.data.Dataset, batch_size: int,
             seed: int) -> tf.data.Dataset:
    """`source`'s examples `indices` (this pipeline's shard), shuffled, repeated and
    batched, as a task's `train_dataset` gives them: for the runs that read a
    pipeline (data.by_index = false, the tf.data service, ps.mode = sync). Each
    example's augmentation seed is (seed, index): no epoch is known here."""
    shuffled = (indices.shuffle(min(source.size, 1 << 20), seed=seed,
                                reshuffle_each_iteration=True)
                .repeat().batch(batch_size, drop_remainder=True))

    def with_seeds(ids):
        return ids, tf.stack([tf.fill(tf.shape(ids), tf.constant(seed, tf.int64)), ids], 1)

    return _read(source, shuffled.map(with_seeds))


def _read(source: Source, batches: tf.data.Dataset) -> tf.data.Dataset:
    """The examples of `batches` of (indices, seeds), augmented, prefetched.

    The read is one call per batch (a gather, or examples made from their index) and
    runs in order: with parallel calls, on 2 cores, the reads took the cores training
    needed (a single process trained 4% fewer examples/s, `python -m tools.bench --rows
    baseline,baseline_pipeline`). Augmentation, per example and maybe heavy, runs in
    parallel, as `data.batches` runs a pipeline's."""
    if source.load is None:
        def read(indices, seeds):
            return source.read(None, indices), seeds
    else:
        batches = tf.data.Dataset.zip(loaded_dataset(source), batches)

        def read(loaded, indices_seeds):
            indices, seeds = indices_seeds
            return source.read(loaded, indices), seeds

    def without_seeds(examples, seeds):
        return examples

    examples = batches.map(read)
    if source.augment:
        examples = examples.map(source.augment, num_parallel_calls=tf.data.AUTOTUNE,
                                deterministic=True)
    else:
        examples = examples.map(without_seeds)
    return examples.prefetch(tf.data.AUTOTUNE)
