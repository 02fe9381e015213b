"""The fused Adam against Keras' own (the same updates, slots and checkpoints), and the
float16 all-reduce."""

import numpy as np
import tensorflow as tf
import tf_keras as keras

from app.dialects import keras2_optimizers as optimizers
from tests.conftest import one_device_reduction_mirrored


def _schedule():
    return keras.optimizers.schedules.CosineDecay(0.01, decay_steps=10)


def _train(optimizer, steps: int = 5, sparse: bool = False) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    dense = tf.Variable(rng.normal(size=(6, 3)).astype(np.float32))
    table = tf.Variable(rng.normal(size=(8, 2)).astype(np.float32))
    for _ in range(steps):
        grads = [tf.constant(rng.normal(size=(6, 3)).astype(np.float32))]
        variables = [dense]
        if sparse:
            grads.append(tf.IndexedSlices(tf.constant(rng.normal(size=(2, 2)), tf.float32),
                                          tf.constant([1, 5])))
            variables.append(table)
        optimizer.apply_gradients(zip(grads, variables, strict=True))
    return [v.numpy() for v in (dense, table)] + [v.numpy() for v in optimizer.variables()]


def test_fused_adam_updates_as_keras_adam_does():
    ours = _train(optimizers.Adam(_schedule()), sparse=True)
    theirs = _train(keras.optimizers.Adam(_schedule()), sparse=True)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
    # ...and the dense variable did move: the comparison is not of two no-ops.
    assert not np.allclose(ours[0], _train(optimizers.Adam(0.0))[0])


def test_fused_adam_runs_the_fused_kernel_for_dense_gradients_only():
    optimizer = optimizers.Adam(0.01)
    dense, table = tf.Variable(tf.ones((4, 2))), tf.Variable(tf.ones((5, 2)))

    @tf.function
    def step():
        optimizer.apply_gradients([(tf.ones((4, 2)), dense),
                                   (tf.IndexedSlices(tf.ones((1, 2)), tf.constant([3])), table)])

    graph = step.get_concrete_function().graph
    ops = [op for f in graph._functions.values() for op in f.graph.get_operations()]
    ops += graph.get_operations()
    assert sum(op.type == "ResourceApplyAdam" for op in ops) == 1


def test_fused_adam_reads_a_keras_adam_checkpoint(tmp_path):
    theirs = keras.optimizers.Adam(0.01)
    v = tf.Variable(tf.ones((3,)))
    theirs.apply_gradients([(tf.constant([1.0, 2.0, 3.0]), v)])
    path = tf.train.Checkpoint(optimizer=theirs, v=v).save(str(tmp_path / "ckpt"))

    ours, w = optimizers.Adam(0.01), tf.Variable(tf.zeros((3,)))
    ours.build([w])
    tf.train.Checkpoint(optimizer=ours, v=w).restore(path).assert_existing_objects_matched()
    for a, b in zip(ours.variables(), theirs.variables(), strict=True):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_fused_adam_under_mirrored_keeps_replicas_identical():
    strategy = one_device_reduction_mirrored()
    with strategy.scope():
        v = tf.Variable(tf.ones((4,)))
        optimizer = optimizers.Adam(0.1)

    @tf.function
    def step():
        def replica_fn():
            ctx = tf.distribute.get_replica_context()
            grad = tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32) * tf.ones((4,))
            optimizer.apply_gradients([(grad, v)])
        strategy.run(replica_fn)

    step()
    values = [t.numpy() for t in strategy.experimental_local_results(v)]
    for value in values[1:]:
        np.testing.assert_array_equal(value, values[0])
    # Adam's first step moves each weight by the learning rate, whatever the gradient.
    np.testing.assert_allclose(values[0], np.full(4, 0.9), rtol=1e-5)


def test_fp16_all_reduce_sums_float16_gradients_into_float32():
    s = one_device_reduction_mirrored()
    with s.scope():
        v = tf.Variable([0.0, 0.0])
        optimizer = optimizers.fp16_all_reduce(keras.optimizers.SGD)(1.0)

    @tf.function
    def step():
        replica = tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32)
        gradient = tf.constant([0.1, 1e-3]) * (1.0 + replica)  # 0.1 and 0.2, 1e-3 and 2e-3
        return optimizer.aggregate_gradients([(gradient, v)])[0][0]

    summed = s.experimental_local_results(s.run(step))[0].numpy()
    assert summed.dtype == np.float32
    f16 = np.float16
    expected = [f16(f16(0.1) + f16(0.2)), f16(f16(1e-3) + f16(2e-3))]
    np.testing.assert_array_equal(summed, np.array(expected, np.float32))
    assert not np.allclose(summed, [0.3, 3e-3], rtol=1e-6, atol=0)  # float32 would give these


def _whole_reads(optimizer_class) -> tuple:
    """The ops of a mirrored table's sparse Adagrad step whose output is the whole
    table, the table after the step, and its strategy."""
    strategy = one_device_reduction_mirrored()
    with strategy.scope():
        table = tf.Variable(tf.ones((1000, 4)))
        optimizer = optimizer_class(0.1)

    @tf.function
    def step():
        def replica_step():
            optimizer.apply_gradients([(tf.IndexedSlices(tf.ones((2, 4)), tf.constant([3, 7])),
                                        table)])
        strategy.run(replica_step)

    step()
    graph = step.get_concrete_function().graph
    graphs = [graph, *(f.graph for f in graph._functions.values())]
    return [op.name for g in graphs for op in g.get_operations()
            for out in op.outputs if tuple(out.shape) == (1000, 4)], table, strategy


def test_adagrad_updates_only_the_looked_up_rows_of_a_mirrored_table():
    ours, table, strategy = _whole_reads(optimizers.Adagrad)
    assert ours == []
    for copy in strategy.experimental_local_results(table):
        moved = np.flatnonzero((copy.numpy() != 1).any(axis=1))
        assert moved.tolist() == [3, 7]
    theirs, _, _ = _whole_reads(keras.optimizers.Adagrad)  # reads the accumulator whole
    assert theirs
