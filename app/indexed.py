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

# The functions below marked `_plain` hold no Python `if` or loop on a tensor and call
# no task code, so autograph has nothing to convert in them. Left to it, tf.data
# converted them each time a process built its pipeline: 0.7 of the 5.8 CPU s of a
# short one-process run (docs/testing.md). A task's own functions (`Source.read`,
# `load`, `augment`, `span`, `decode`) are still converted where they are called, as
# tf.data converts any function it maps.
_plain = tf.autograph.experimental.do_not_convert


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
    - `span(loaded, starts, counts)` and `decode(raw)`, for examples stored in files
      (`app.data.indexed_records`): the raw records of examples `starts[k]` ..
      `starts[k] + counts[k] - 1` for each k, one string each, read in order; and the
      batch those raw records make. With them a reader holds a window of raw records
      rather than the data set (`Order.shard`), and `read` is `decode` of the
      records read one by one.
    - `stored_bytes`: the bytes of the files the examples are read from (0: in
      memory), for the log and the memory check of a window.
    """

    size: int
    read: Callable[[Any, tf.Tensor], Any]
    load: Callable[[], Any] | None = None
    augment: Callable[[Any, tf.Tensor], Any] | None = None
    span: Callable[[Any, tf.Tensor, tf.Tensor], tf.Tensor] | None = None
    decode: Callable[[tf.Tensor], Any] | None = None
    stored_bytes: int = 0

    def __post_init__(self):
        if self.size < 1:
            raise ValueError(f"Source.size must be at least 1, got {self.size}")
        if (self.span is None) != (self.decode is None):
            raise ValueError("Source.span and Source.decode go together: give both or neither")


@dataclasses.dataclass(frozen=True)
class Order:
    """Which examples global batch `step` holds: positions step*batch .. of its epoch
    in the permutation of (seed, epoch). An epoch longer than the examples goes on
    to a new permutation (seed, epoch, pass).

    `shard` = 0: one permutation of all the examples (`RandomIndexShuffle`): a batch
    reads `batch` places anywhere in the data. `shard` > 0, a windowed permutation,
    as MosaicML Streaming's shuffles are: the examples in shards of `shard`
    consecutive indices (the last one shorter), the shards permuted (the short one
    kept last), and the examples of each window of `window` consecutive shards of
    that permutation shuffled among themselves: in a window of whole shards, each
    shard in its own random order, the window takes its shards' examples in turn
    (position u of the window is example u // window of shard u % window), so that
    every `window` consecutive positions hold one example of each shard; the last,
    short window is shuffled as one. A reader of the synchronous strategies reads
    each window once per epoch, each shard in one run (`dataset`), and input
    pipeline i of n only the shards in turns i, i + n, ... of it when n divides
    `window` and `window` divides `batch` (`pipeline_shards`); a parameter-server
    step reads its batch's records one by one, from `window` shards at most
    (`batch`). Both are pure functions of (seed, epoch, index): the number of workers
    does not enter."""

    size: int
    batch: int
    steps_per_epoch: int
    seed: int
    shard: int = 0
    window: int = 0

    def __post_init__(self):
        if self.shard and self.window < 1:
            raise ValueError(f"Order.window must be at least 1 with shards, got {self.window}")

    @property
    def shards(self) -> int:
        return -(-self.size // self.shard)

    @property
    def window_examples(self) -> int:
        return self.shard * self.window

    def describe(self) -> str:
        if not self.shard:
            return "one permutation of all the examples"
        return (f"a windowed permutation: {self.shards} shards of {self.shard} examples "
                f"permuted, the examples shuffled within windows of {self.window} shards "
                f"({self.window_examples} examples)")

    def pipeline_shards(self, pipelines: int) -> bool:
        """Whether each of `pipelines` input pipelines can take its part of every global
        batch from shards of its own (the turns i, i + n, ... of each whole window): the
        pipelines divide a window's turns, the turns divide a batch, and an epoch is one
        pass, so that every batch starts at a window's first turn."""
        return (self.shard > 0 and self.window % pipelines == 0 and self.batch % self.window == 0
                and self.steps_per_epoch * self.batch <= self.size)

    @_plain
    def indices(self, step: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """The example indices of global batch `step` (int64 [batch]), and their
        augmentation seeds (int64 [batch, 2])."""
        step = tf.cast(step, tf.int64)
        epoch = step // self.steps_per_epoch
        positions = (step % self.steps_per_epoch) * self.batch + tf.range(self.batch,
                                                                          dtype=tf.int64)
        passes = positions // self.size
        epochs = tf.fill([self.batch], epoch)
        if self.shard:
            _, indices = self.in_window(positions % self.size, epochs, passes)
        else:
            indices = _shuffle(positions % self.size, self.seed, epochs, passes, self.size)
        return indices, augment_seeds(self.seed, epochs, indices)

    @_plain
    def in_window(self, positions: tf.Tensor, epochs: tf.Tensor,
                  passes: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """For positions within a pass of a windowed order: each one's place among its
        window's examples (the window's shards read in their order, concatenated), and
        its example index."""
        per_window = self.window_examples
        windows = positions // per_window
        in_window = positions - windows * per_window
        # Streams of seeds apart from the shards' permutation (pass * 2**32, shard_at):
        # one per shard of a whole window, one for the last window.
        streams = passes * 2**32 + 1
        turns = in_window % self.window
        within = _shuffle(in_window // self.window, self.seed, epochs,
                          streams + windows * self.window + turns, self.shard)
        short = self.size - windows * per_window
        last = _shuffle(in_window, self.seed, epochs, streams + self.shards,
                        tf.maximum(tf.minimum(short, per_window), 1))
        place = tf.where(short >= per_window, turns * self.shard + within, last)
        slots = windows * self.window + place // self.shard
        return place, self.shard_at(slots, epochs, passes) * self.shard + place % self.shard

    @_plain
    def shard_at(self, slots: tf.Tensor, epochs: tf.Tensor, passes: tf.Tensor) -> tf.Tensor:
        """The shard in place `slots` of the shards' permutation of (epoch, pass): the
        full shards permuted, the short one (if any) last."""
        full = self.size // self.shard
        if full == 0:
            return slots
        permuted = _shuffle(tf.minimum(slots, full - 1), self.seed, epochs, passes * 2**32, full)
        return tf.where(slots < full, permuted, slots)


@_plain
def _shuffle(positions: tf.Tensor, seed: int, epochs: tf.Tensor, streams: tf.Tensor,
             size: tf.Tensor | int) -> tf.Tensor:
    """`positions` through the permutation of range(size) of (seed, epoch, stream), one
    of each per position."""
    n = tf.shape(positions)[0]
    seed = tf.stack([tf.fill([n], tf.constant(seed, tf.int64)), epochs, streams], axis=1)
    # The raw op takes one seed per index; tf.random.experimental.index_shuffle
    # pads a [n, 2] seed along the wrong axis for that.
    return tf.raw_ops.RandomIndexShuffle(
        index=positions, seed=seed,
        max_index=tf.cast(size, tf.int64) - 1 + tf.zeros_like(positions), rounds=4)


@_plain
def augment_seeds(seed: int, epochs: tf.Tensor, indices: tf.Tensor) -> tf.Tensor:
    """The augmentation seeds of examples `indices` read in `epochs` (int64 [n, 2])."""
    return tf.stack([seed + epochs * 2**32, indices], axis=1)


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
    batch (or, reading a windowed order from files, the examples of its own shards:
    `Order.pipeline_shards`), and its replicas that part's consecutive slices.
    `first_step` is read when the pipeline starts (after a backup was restored), not
    when it is built.

    Examples stored in files (`Source.span`) in a windowed order are read a window at
    a time, its shards each in one sequential read, the next window read while this
    one's batches train (`_window_batches`); others are read batch by batch."""
    pipelines, pipeline = context.num_input_pipelines, context.input_pipeline_id
    replicas = max(context.num_replicas_in_sync // pipelines, 1)
    per_replica = context.get_per_replica_batch_size(order.batch)

    if order.shard and source.span is not None:
        def decode(raw, indices, epochs):
            return source.decode(raw), augment_seeds(order.seed, epochs, indices)

        def replica_parts(*tensors):
            return tuple(tf.reshape(t, [replicas, per_replica]) for t in tensors)

        batches = _window_batches(source, order, first_step, pipelines, pipeline)
        return _finish(source, batches.map(replica_parts).unbatch().map(decode))

    def part(tensor):
        return tf.reshape(tensor, [pipelines, replicas, per_replica])[pipeline]

    def step_parts(step):
        indices, seeds = order.indices(step)
        return part(indices), tf.reshape(seeds, [pipelines, replicas, per_replica, 2])[pipeline]

    def steps(_):
        return tf.data.Dataset.range(first_step(), _ENDLESS)

    return _read(source, tf.data.Dataset.range(1).flat_map(steps).map(step_parts).unbatch())


def _window_batches(source: Source, order: Order, first_step: Callable[[], tf.Tensor],
                    pipelines: int, pipeline: int) -> tf.data.Dataset:
    """This pipeline's part of every global batch from `first_step()` on as (raw
    records, example indices, epochs), read window by window: each of the window's
    shards it needs in one sequential read (`Source.span`), its examples then taken in
    the window's order, a batch at a time. The window in use and the one read ahead
    (prefetch): what a reader holds, whatever the size of the data set."""
    part = order.batch // pipelines

    def read(loaded, segment):
        starts, counts, taken, indices, epochs = _window_plan(order, pipelines, pipeline,
                                                              segment)
        raw = source.span(None if source.load is None else loaded, starts, counts)
        return raw, taken, indices, epochs

    @_plain
    def batches(raw, taken, indices, epochs):
        """The window's examples in its order, a batch at a time: each batch gathered
        from the window as it is read, not the window copied into its order."""
        def batch(start):
            end = tf.minimum(start + part, tf.size(taken, out_type=tf.int64))
            return tf.gather(raw, taken[start:end]), indices[start:end], epochs[start:end]

        return tf.data.Dataset.range(0, tf.size(taken, out_type=tf.int64), part).map(batch)

    segments = tf.data.Dataset.range(1).flat_map(lambda _: _segments(order, first_step()))
    loaded = loaded_dataset(source) if source.load else tf.data.Dataset.from_tensors(0).repeat()
    return (tf.data.Dataset.zip(loaded, segments).map(read)
            .prefetch(1).flat_map(batches).rebatch(part))


@_plain
def _segments(order: Order, first: tf.Tensor) -> tf.data.Dataset:
    """(epoch, pass, window, first position, end): the positions of each epoch that
    each window serves, from step `first`'s on."""
    per_epoch = order.steps_per_epoch * order.batch
    windows = -(-order.size // order.window_examples)
    passes = -(-per_epoch // order.size)
    first_epoch = first // order.steps_per_epoch
    first_position = (first % order.steps_per_epoch) * order.batch

    def of_epoch(epoch):
        return tf.data.Dataset.range(passes * windows).map(
            lambda k: (epoch, k // windows, k % windows))

    def bounds(epoch, pass_, window):
        start = pass_ * order.size + window * order.window_examples
        end = tf.minimum(tf.minimum(start + order.window_examples, (pass_ + 1) * order.size),
                         per_epoch)
        start = tf.where(epoch == first_epoch, tf.maximum(start, first_position), start)
        return epoch, pass_, window, start, end

    return (tf.data.Dataset.range(first_epoch, _ENDLESS).flat_map(of_epoch).map(bounds)
            .filter(lambda epoch, pass_, window, start, end: start < end))


@_plain
def _window_plan(order: Order, pipelines: int, pipeline: int,
                 segment: tuple[tf.Tensor, ...]) -> tuple[tf.Tensor, ...]:
    """What one segment reads, for this pipeline's positions only: the shards' first
    examples and lengths (for `Source.span`, which reads them in that order), where
    each position's example is among the records read, the example indices, and the
    epochs."""
    epoch, pass_, window, start, end = segment
    own_shards = order.pipeline_shards(pipelines)
    positions = tf.range(start, end)
    if own_shards:  # every batch starts at a window's first turn
        mine = (positions % order.window) % pipelines == pipeline
    else:
        mine = (positions % order.batch) // (order.batch // pipelines) == pipeline
    positions = tf.boolean_mask(positions, mine) - pass_ * order.size
    epochs = tf.fill(tf.shape(positions), epoch)
    place, indices = order.in_window(positions, epochs, tf.fill(tf.shape(positions), pass_))
    # The window's turns this pipeline takes examples from: its own, in a whole
    # window of its own shards; else all of them.
    whole = order.size - window * order.window_examples >= order.window_examples
    first, every = ((pipeline, pipelines) if own_shards else (0, 1))
    first = tf.where(whole, tf.constant(first, tf.int64), 0)
    every = tf.where(whole, tf.constant(every, tf.int64), 1)
    turns = tf.range(first, tf.minimum(order.shards - window * order.window, order.window),
                     every)
    slots = window * order.window + turns
    shards = order.shard_at(slots, tf.fill(tf.shape(slots), epoch),
                            tf.fill(tf.shape(slots), pass_))
    taken = ((place // order.shard - first) // every) * order.shard + place % order.shard
    return (shards * order.shard, tf.minimum(order.size - shards * order.shard, order.shard),
            taken, indices, epochs)


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

    return _finish(source, batches.map(read))


def _finish(source: Source, examples: tf.data.Dataset) -> tf.data.Dataset:
    """(examples, seeds) batches augmented (in parallel: per example, maybe heavy) or
    without their seeds, prefetched."""
    def without_seeds(examples, seeds):
        return examples

    if source.augment:
        examples = examples.map(source.augment, num_parallel_calls=tf.data.AUTOTUNE,
                                deterministic=True)
    else:
        examples = examples.map(without_seeds)
    return examples.prefetch(tf.data.AUTOTUNE)
