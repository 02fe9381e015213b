"""`train.steps_per_execution` under every strategy, in both Kerases, by index and from
a pipeline: every step runs once, and evaluation counts every test example once.

Each run trains 2 epochs of 32 steps at 3 steps per execution, then evaluates 64
validation and 101 test examples in batches of 32: neither the steps nor the batches
divide by 3. The test and validation datasets do not know their size, as those read
from files do not (tf_keras refuses several steps per execution over such data unless
told how many batches there are). Run as a script, this file is one worker of a
MultiWorkerMirrored pair (TF_CONFIG set) and prints each case's metrics as JSON.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import sys

import numpy as np
import pytest
import tensorflow as tf

from app import config as cfg
from app import strategy as strategies
from app import trainer

STEPS = 3
KERASES = ("tf_keras", "keras")
INPUTS = ("by_index", "pipeline")
CASES = [(keras, source) for keras in KERASES for source in INPUTS]
EPOCHS, STEPS_PER_EPOCH = 2, 512 // 16


def config(keras: str, source: str, *overrides: str) -> cfg.Config:
    return cfg.load(None, [f"task.keras={keras}", "task.model=mlp", f"train.epochs={EPOCHS}",
                           "train.global_batch_size=16", "eval.batch_size=32",
                           f"train.steps_per_execution={STEPS}", "train.verbose=0",
                           f"data.by_index={'true' if source == 'by_index' else 'false'}",
                           *overrides])


def sizeless_task(config: cfg.Config):
    """The tiny MNIST task, its evaluation datasets of unknown size (as files are)."""
    from tests.conftest import tiny_task

    task = tiny_task(config)
    eval_dataset = task.eval_dataset

    def sizeless(split, batch_size):
        return eval_dataset(split, batch_size).filter(lambda *_: True)

    task.eval_dataset = sizeless
    assert int(sizeless("test", 32).cardinality()) == tf.data.UNKNOWN_CARDINALITY
    return task


def train(keras: str, source: str, workdir: pathlib.Path, *overrides: str, **kwargs) -> dict:
    run_config = config(keras, source, *overrides)
    return trainer.run(run_config, workdir, task=sizeless_task(run_config), **kwargs)


def check(metrics: dict, workdir: pathlib.Path, keras: str, source: str) -> None:
    """Every step ran once; the test metrics are those of every test image, once."""
    from tests.conftest import tiny_split

    assert (metrics["keras"], metrics["input"].split("_")[0]) == (keras, source.split("_")[0])
    assert metrics["steps_per_execution"] == STEPS
    assert metrics["steps"] == EPOCHS * STEPS_PER_EPOCH
    assert [sorted(k for k in row if k.startswith("val_")) for row in metrics["history"]] == [
        ["val_accuracy", "val_loss"]] * EPOCHS
    images, labels = tiny_split(101, seed=2)
    exported = tf.saved_model.load(str(workdir / "export"))
    logits = getattr(exported, "serve", exported)(tf.constant(images)).numpy()
    assert metrics["num_test_examples"] == 101
    assert metrics["test_accuracy"] == pytest.approx(
        float(np.mean(np.argmax(logits, axis=1) == labels)), abs=1e-6)
    loss = tf.keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)
    assert metrics["test_loss"] == pytest.approx(float(np.mean(loss)), rel=1e-4)


# First in the file: it waits more than it computes (tests/conftest.py, LONGEST_FIRST).
@pytest.mark.slow
def test_multi_worker_mirrored(tmp_path):
    from tests.launching import run_workers

    outputs = run_workers(__file__, str(tmp_path), timeout=900)
    results = json.loads(outputs[0].split("RESULTS ", 1)[1].splitlines()[0])
    assert list(results) == [f"{keras}-{source}" for keras, source in CASES]
    for keras, source in CASES:
        metrics = results[f"{keras}-{source}"]
        assert (metrics["strategy"], metrics["num_workers"]) == ("MultiWorkerMirroredStrategy", 2)
        check(metrics, tmp_path / f"{keras}-{source}", keras, source)


@pytest.mark.parametrize("keras,source", CASES)
@pytest.mark.parametrize("kind", ["default", "mirrored"])
def test_one_host(kind, keras, source, tmp_path):
    metrics = train(keras, source, tmp_path, strategy=strategies.create(kind))
    check(metrics, tmp_path, keras, source)
    assert metrics["num_replicas"] == (2 if kind == "mirrored" else 1)


@pytest.mark.cluster
@pytest.mark.parametrize("keras,source", CASES)
def test_parameter_servers(keras, source, ps_strategy, ps_cluster, tmp_path):
    # The closures of the project's loop read the variables every 2 of their 3 steps
    # (ps.read_every), as float16 (ps.read_compression): those reads' gradients reach the
    # variables in both Kerases' train steps. (A tf_keras pipeline trains through
    # tf_keras' fit, which honours neither.)
    metrics = train(keras, source, tmp_path, "ps.read_every=2", "ps.read_compression=fp16",
                    strategy=ps_strategy, cluster=ps_cluster)
    check(metrics, tmp_path, keras, source)


def test_the_loop_reads_its_settings_from_the_config_once():
    # The runner reads them (runners.AsyncPS.fit) and both dialects pass them on whole.
    from app.distribute.ps import coordinated

    chosen = cfg.load(None, ["train.steps_per_execution=8", "ps.read_every=2",
                             "ps.read_compression=fp16", "ps.unroll=false"])
    assert coordinated.Closures.of(chosen.train, chosen.ps) == coordinated.Closures(
        steps=8, read_every=2, half_reads=True, unroll=False)
    assert coordinated.Closures.of(chosen.train, chosen.ps).reads_fewer
    defaults = cfg.load(None)
    assert coordinated.Closures.of(defaults.train, defaults.ps) == coordinated.ONE_STEP
    assert not coordinated.ONE_STEP.reads_fewer


@pytest.mark.cluster
@pytest.mark.parametrize("unroll, most", [(True, 8), (True, 2), (False, 8)])
def test_a_closure_runs_its_steps_each_on_its_own_batch(unroll, most, ps_strategy, ps_cluster,
                                                        tmp_path, monkeypatch):
    # The numbered task counts each example's visits on the ps: 2 epochs of 32 steps at 5
    # a closure (the last of an epoch 2) visit each of its 512 examples twice, the
    # steps unrolled (ps.unroll), unrolled in groups of at most `most` inside a loop
    # (coordinated.UNROLLED_AT_MOST: groups of 2 and a last of 1), or as a loop.
    from app.distribute.ps import coordinated

    monkeypatch.setattr(coordinated, "UNROLLED_AT_MOST", most)
    closures, counts_as, by_index = [], [], coordinated._by_index

    def recorded(*args, **kwargs):
        schedule = by_index(*args, **kwargs)
        counts_as.append(args[-1])  # how a closure's count reaches its function

        def record(first: int, count: int):
            closures.append((first, count))
            return schedule(first, count)
        return record

    monkeypatch.setattr(coordinated, "_by_index", recorded)
    config = cfg.load(None, ["task.name=tests.numbered:IndexedNumbered", "task.examples=512",
                             "train.epochs=2", "train.global_batch_size=16", "train.verbose=0",
                             "train.steps_per_execution=5", f"ps.unroll={str(unroll).lower()}"])
    metrics = trainer.run(config, tmp_path, strategy=ps_strategy, cluster=ps_cluster)
    assert closures == [(epoch * 32 + step, min(5, 32 - step))
                        for epoch in range(2) for step in range(0, 32, 5)]
    # A Python int unrolls the steps (coordinated._loop); a tensor loops.
    assert len(counts_as) == 1 and isinstance(counts_as[0](5), int) == unroll
    assert metrics["steps"] == 64
    assert (metrics["visits_min"], metrics["visits_max"]) == (2, 2)


# (ps.read_every, ps.read_compression = fp16) of a closure's reads.
READS = [(1, False), (2, False), (3, False), (1, True), (3, True)]


# How `_loop` gets a closure's 5 steps: a Python int of at most `most` (every step traced
# one after another), a larger int (a loop over groups of at most `most`, each unrolled,
# the last group shorter), or a tensor (a loop of single steps).
# (Made in the test: a tensor made on import would start TensorFlow's context before
# main() configures the MultiWorkerMirrored pair's collectives.)
SHAPES = {"unrolled": (int, 8), "grouped": (int, 2), "loop": (tf.constant, 8)}


@pytest.mark.cluster
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("every, half", READS)
def test_a_closures_steps_take_their_gradients_at_the_weights_last_read(every, half, shape,
                                                                        ps_strategy):
    # Five SGD steps with momentum in one closure on a worker, the variable read once
    # every `every` steps (ps.read_every), as float16 with `half` (ps.read_compression):
    # each step's gradient is the one at the weights of the last read, rounded to float16
    # with `half`, and the momentum (a slot, on the ps) still goes on step by step. The
    # same whether the steps are traced one after another (ps.unroll: each read after
    # the updates before it only by TensorFlow's ordering of a function's ops on one
    # variable), in unrolled groups inside a loop, or as a loop.
    import tf_keras

    from app.distribute.ps import coordinated

    x, y = tf.constant([[1.0, 2.0], [3.0, -1.0]]), tf.constant([1.0, 0.5])
    start = [1.0001, -2.0003]  # neither is a float16

    def model():
        return tf_keras.optimizers.SGD(0.1, momentum=0.9), tf.Variable(start)

    def gradient(w):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((tf.linalg.matvec(x, w) - y) ** 2)
        return tape.gradient(loss, [w])

    coordinator = tf.distribute.coordinator.ClusterCoordinator(ps_strategy)
    with ps_strategy.scope():
        optimizer, w = model()
        optimizer.build([w])

    def step(_):
        ps_strategy.run(lambda: optimizer.apply_gradients(zip(gradient(w), [w], strict=True)))

    @tf.function
    def closure():
        count_as, most = SHAPES[shape]
        coordinated._loop(count_as(5), step, variables=[w], every=every, half=half, most=most)

    coordinator.schedule(closure)
    coordinator.join()
    expected = {}
    for period, rounded in READS:
        local_optimizer, local = model()  # the same three steps in this process
        for i in range(5):
            if i % period == 0:
                read = tf.Variable(tf.cast(tf.cast(local, tf.float16), tf.float32)
                                   if rounded else local)
                read_gradient = gradient(read)
            local_optimizer.apply_gradients(zip(read_gradient, [local], strict=True))
        expected[period, rounded] = local.numpy()
    assert min(np.abs(expected[a] - expected[b]).max()
               for a, b in itertools.combinations(expected, 2)) > 1e-5  # all differ
    np.testing.assert_allclose(w.numpy(), expected[every, half], rtol=1e-6)
    assert int(optimizer.iterations.numpy()) == 5


@pytest.mark.cluster
@pytest.mark.parametrize("keras", KERASES)
def test_a_keras_layer_reads_its_kernel_as_float16(keras, ps_strategy):
    # With ps.read_compression = fp16 a layer's forward pass in a closure sees its kernel
    # rounded to float16, in either Keras: its reads go through the loop's read scope.
    import importlib

    from app import dialects
    from app.distribute.ps import coordinated

    module, dialect = importlib.import_module(keras), dialects.named(keras)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(ps_strategy)
    with ps_strategy.scope():
        layer = module.layers.Dense(1, use_bias=False, kernel_initializer=module.initializers
                                    .Constant([[1.0001], [-2.0003]]))  # neither is a float16
        layer.build((None, 2))
        out = tf.Variable(0.0)
    variables = [dialect.tf_variable(v) for v in layer.trainable_variables]

    def step(_):
        ps_strategy.run(lambda: out.assign(tf.reshape(layer(tf.ones([1, 2])), [])))

    def closure(half: bool):
        return tf.function(lambda: coordinated._loop(tf.constant(1), step, variables=variables,
                                                      every=1, half=half))

    for half, expected in ((False, 1.0001 - 2.0003), (True, 1.0 - 2.0)):
        coordinator.schedule(closure(half))
        coordinator.join()
        assert float(out.numpy()) == pytest.approx(expected, abs=1e-6)


def main() -> int:
    """One worker of a MultiWorkerMirrored pair: every case in turn, in one cluster."""
    from app.cluster import tf_config as clusters

    workdir = pathlib.Path(sys.argv[1])
    cluster = clusters.read()
    strategy = strategies.create("auto", cluster, cfg.Config())
    results = {f"{keras}-{source}": train(keras, source, workdir / f"{keras}-{source}",
                                          strategy=strategy, cluster=cluster)
               for keras, source in CASES}
    print("RESULTS " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    sys.exit(main())
