"""Synchronous parameter-server training (ps.mode = sync) on the in-process
cluster of conftest.py: 2 workers, 2 ps, this process the chief."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from app import config as cfg
from app import tf_internal, trainer
from app.distribute.ps import sync as sync_ps
from app.run import runners
from app.tasks.mnist import Mnist
from tests.conftest import tiny_split, tiny_task

pytestmark = pytest.mark.cluster

FEATURES, BATCH = 6, 4


def _examples(n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, FEATURES)).astype(np.float32),
            rng.integers(0, 3, n).astype(np.int64))


def _in_order(context: tf.distribute.InputContext) -> tf.data.Dataset:
    """Worker i's k-th batch is rows [BATCH*k, BATCH*(k+1)) of shard i: no shuffling."""
    images, labels = _examples()
    return (tf.data.Dataset.from_tensor_slices((images, labels))
            .shard(context.num_input_pipelines, context.input_pipeline_id)
            .batch(BATCH).repeat())


def _model() -> keras.Model:
    model = keras.Sequential([keras.layers.Dense(3, input_shape=(FEATURES,))])
    model.compile(optimizer=keras.optimizers.SGD(0.5))
    model.optimizer.build(model.trainable_variables)
    return model


def _training(strategy, backup_workers: int, straggler=None) -> sync_ps.SyncTraining:
    keras.utils.set_random_seed(1)
    with strategy.scope():
        model = _model()
    return sync_ps.SyncTraining(
        tf.distribute.coordinator.ClusterCoordinator(strategy), model,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none"),
        num_workers=2, backup_workers=backup_workers, straggler=straggler)


def _fit(training: sync_ps.SyncTraining, steps: int) -> dict:
    _, figures = sync_ps.fit(training, runners.per_worker(_in_order, num_workers=2), epochs=1,
                             steps_per_epoch=steps, callbacks=[])
    return figures


def _train(strategy, backup_workers: int, steps: int):
    training = _training(strategy, backup_workers)
    return training.model, _fit(training, steps)


def test_sync_without_backups_equals_one_process_taking_the_averaged_steps(ps_strategy):
    model, figures = _train(ps_strategy, backup_workers=0, steps=6)
    assert figures == {"contributions": [6, 6], "pushed": [6, 6], "stale_dropped": 0}

    keras.utils.set_random_seed(1)
    reference = _model()  # same seed: same initial weights
    images, labels = _examples()
    shards = [(images[i::2], labels[i::2]) for i in range(2)]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for k in range(6):
        rows = slice(BATCH * k, BATCH * (k + 1))
        with tf.GradientTape() as tape:
            # The mean of the two workers' mean losses: the mean of their gradients.
            value = tf.add_n([loss(y[rows], reference(x[rows])) for x, y in shards]) / 2
        grads = tape.gradient(value, reference.trainable_variables)
        reference.optimizer.apply_gradients(zip(grads, reference.trainable_variables, strict=True))
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert int(model.optimizer.iterations.numpy()) == 6


def _late(version: tf.Variable, final: int, hang_s: float = 300.0):
    """A `sync_ps.straggle` whose slow worker pushes only once the parameters have
    moved on from those it read, or have had their `final` update: a straggler that is
    late whatever the load on the machine, where `Straggler.factor` is relative to its
    own step time and can lose a race with a fast worker held up by the load. It waits
    on the run's own progress, never on the clock (`hang_s` is a deadline only a hang
    reaches)."""
    def wait(ready: list[tf.Tensor]) -> tf.Tensor:
        with tf.control_dependencies(ready):
            seen, deadline = version.read_value(), tf.timestamp() + hang_s
        return tf.while_loop(
            lambda slept: ((version.read_value() <= seen) & (seen < final)
                           & (tf.timestamp() < deadline)),
            lambda slept: slept + tf_internal.sleep(tf.constant(1000, tf.int64)),
            [tf.constant(0, tf.int64)])[0]

    return lambda values, is_slow, factor, started: sync_ps.hold(values, is_slow, wait)


def test_with_a_backup_worker_updates_never_wait_for_the_straggler(ps_strategy, monkeypatch):
    steps = 12
    training = _training(ps_strategy, backup_workers=1,
                         straggler=sync_ps.Straggler(worker=1, factor=2.0))
    monkeypatch.setattr(sync_ps, "straggle", _late(training.version, final=steps))
    figures = _fit(training, steps)
    # Every update went ahead on the fast worker's gradients alone; the straggler's,
    # computed on parameters that had moved on, were all dropped. An update takes
    # every gradient of its version in by then: two of the fast worker's when the
    # coordinator handed it both closures of a step, so the fast worker may count
    # more than one per update.
    fast, slow = figures["contributions"]
    assert slow == 0 and fast >= steps
    assert figures["stale_dropped"] >= figures["pushed"][1] >= 1


def _config(*overrides: str) -> cfg.Config:
    return cfg.load(None, ["train.epochs=2", "train.global_batch_size=16", "train.verbose=0",
                           "eval.batch_size=32", "ps.mode=sync", *overrides])


def test_sync_run_reports_its_mode_and_contributions(ps_strategy, ps_cluster, tmp_path):
    metrics = trainer.run(_config(), tmp_path, strategy=ps_strategy,
                          cluster=ps_cluster, task=tiny_task(_config()))
    steps = 2 * 512 // 16
    assert (metrics["mode"], metrics["backup_workers"], metrics["steps"]) == ("sync", 0, steps)
    assert metrics["contributions"] == [steps, steps] and metrics["stale_dropped"] == 0
    assert metrics["test_accuracy"] > 0.3  # learnable bars, far above chance
    assert [h["epoch"] for h in metrics["history"]] == [1, 2]
    assert (tmp_path / "checkpoints" / "ckpt-2.index").exists()
    assert (tmp_path / "export" / "saved_model.pb").exists()


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_run_with_a_straggler(mode, ps_strategy, ps_cluster, tmp_path):
    config = _config(f"ps.mode={mode}", "debug.slow_worker=1", "debug.slow_factor=2")
    metrics = trainer.run(config, tmp_path, strategy=ps_strategy,
                          cluster=ps_cluster, task=tiny_task(config))
    assert (metrics["mode"], metrics["slow_worker"], metrics["slow_factor"]) == (mode, 1, 2.0)
    assert metrics["steps"] == 2 * 512 // 16
    assert ("contributions" in metrics) == (mode == "sync")


@pytest.mark.parametrize("overrides, message", [
    (["ps.backup_workers=2"], "ps.backup_workers = 2 must be less than the number of "
                              "workers (2): each update needs at least one gradient"),
    (["ps.backup_workers=1", "train.global_batch_size=15"], None),
    (["train.global_batch_size=15"], "train.global_batch_size (15) must be divisible by the "
                                     "workers each update waits for (workers - "
                                     "ps.backup_workers) (2); use 14 or 16"),
    (["debug.slow_worker=2"], "debug.slow_worker = 2 is not a worker of this cluster (0 to 1)"),
])
def test_sync_settings_are_checked_against_the_cluster(ps_strategy, ps_cluster, tmp_path,
                                                       overrides, message):
    config = _config("train.epochs=1", *overrides)
    task = Mnist.from_arrays(tiny_split(60), None, tiny_split(10))
    if message is None:  # one worker's gradient per update: any batch divides
        assert trainer.run(config, tmp_path, strategy=ps_strategy, cluster=ps_cluster,
                           task=task)["backup_workers"] == 1
        return
    with pytest.raises(cfg.ConfigError) as e:
        trainer.run(config, tmp_path, strategy=ps_strategy,
                          cluster=ps_cluster, task=task)
    assert str(e.value) == message


class _FunctionLoss(Mnist):
    """The MNIST task with its loss as a plain function, as `compile` also takes."""

    def loss(self):
        return keras.losses.sparse_categorical_crossentropy


def test_sync_refuses_a_loss_that_is_not_a_loss_object(ps_strategy, ps_cluster):
    runner = runners.create(_config("train.epochs=1"), ps_cluster, ps_strategy)
    task = _FunctionLoss.from_arrays(tiny_split(60), None, tiny_split(10))
    with pytest.raises(cfg.ConfigError) as e:
        runner.build(task, lambda dialect: keras.optimizers.SGD())
    assert str(e.value) == (
        "ps.mode = sync needs the task's loss as a keras.losses.Loss, and task _FunctionLoss "
        "gives a function; wrap it in keras.losses.LossFunctionWrapper or use ps.mode = async")



class _Weighted(Mnist):
    """The MNIST task whose training batches carry sample weights."""

    def train_dataset(self, context, global_batch_size):
        batches = super().train_dataset(context, global_batch_size)
        return batches.map(lambda x, y: (x, y, tf.ones_like(y, tf.float32)))


def test_sync_refuses_training_data_with_sample_weights_before_training(
        ps_strategy, ps_cluster, tmp_path):
    task = _Weighted.from_arrays(tiny_split(60), None, tiny_split(10))
    with pytest.raises(cfg.ConfigError) as e:
        trainer.run(_config("train.epochs=1"), tmp_path, strategy=ps_strategy,
                    cluster=ps_cluster, task=task)
    assert str(e.value) == (
        "ps.mode = sync and debug.slow_worker train on (features, labels) batches, and this "
        "task's training data yields (features, labels, sample weights); use ps.mode = async "
        "without debug.slow_worker, or MultiWorkerMirrored")
