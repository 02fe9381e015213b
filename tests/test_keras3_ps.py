"""Keras 3 models under ParameterServerStrategy: the project's loop on the coordinator
(app/dialects/keras3_ps.py), on the in-process cluster of 2 workers and 2 ps tasks."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from app import config as cfg
from app import trainer
from app.dialects import keras3, keras3_ps
from app.dialects.keras3_build import prebuild
from app.planning import model as plan
from tests.conftest import tiny_task

pytestmark = pytest.mark.cluster


def config(*overrides: str) -> cfg.Config:
    return cfg.load(None, ["task.keras=keras", "train.epochs=2", "train.global_batch_size=16",
                           "train.verbose=0", "eval.batch_size=32", *overrides])


@pytest.fixture(scope="module")
def trained(ps_strategy, ps_cluster, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ps_keras3")
    metrics = trainer.run(config(), workdir, strategy=ps_strategy, cluster=ps_cluster,
                          task=tiny_task(config()))
    return metrics, workdir


def test_a_keras3_model_trains_on_the_cluster_and_counts_every_step(trained):
    metrics, workdir = trained
    assert (metrics["strategy"], metrics["keras"]) == ("ParameterServerStrategy", "keras")
    assert (metrics["num_workers"], metrics["num_ps"]) == (2, 2)
    # Two workers stepped at once: Keras 3's own assign_add lost increments (145 of 200).
    assert metrics["steps"] == 2 * 512 // 16
    assert metrics["test_accuracy"] > 0.3  # learnable bars: far above chance
    assert [row["epoch"] for row in metrics["history"]] == [1, 2]
    assert json.loads((workdir / "metrics.json").read_text())["steps"] == metrics["steps"]


def test_the_placement_is_balanced_and_predicted_by_the_plan(trained):
    # The 12 MiB kernel is split over both ps tasks, each shard with its Adam slots.
    metrics, _ = trained
    assert metrics["ps_balance"] <= 1.05
    placement, _ = plan.predict(config(), num_ps=2)
    predicted = placement.ps_bytes
    # As in test_parameter_server: the run may start its round robin on either ps.
    assert metrics["ps_bytes"] in [predicted[i:] + predicted[:i] for i in range(len(predicted))]


def test_evaluation_on_the_workers_is_exact_and_the_exports_serve_it(trained, tiny_datasets):
    metrics, workdir = trained
    images, labels = tiny_datasets[2]
    exported = tf.saved_model.load(str(workdir / "export"))
    served = exported.serve(tf.constant(images)).numpy()
    expected = float(np.mean(np.argmax(served, axis=-1) == labels))
    assert metrics["test_accuracy"] == pytest.approx(expected, abs=1e-6)
    native = keras.models.load_model(workdir / "model.keras")
    np.testing.assert_allclose(native.predict(images, verbose=0), served, atol=1e-5)


def test_the_steps_run_on_the_workers_and_the_table_is_looked_up_by_shard(ps_strategy):
    keras3_ps.atomic_updates()
    with ps_strategy.scope():
        table = keras.layers.Embedding(4096, 64)  # 1 MiB: two shards
        table.build((None,))
    assert len(table.embeddings.value.variables) == 2
    rows = keras.ops.take(table.embeddings, tf.constant([0, 4095]), axis=0)
    parts = [part.numpy() for part in table.embeddings.value.variables]
    np.testing.assert_array_equal(rows.numpy(), [parts[0][0], parts[1][-1]])


def test_an_auc_evaluated_on_the_workers_is_the_one_keras_computes(ps_strategy):
    # AUC updates its counts as v.assign(v + x): evaluated by two workers at once, a
    # batch could be lost (app/dialects/keras3.py, ps_evaluator).
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6400, 4)).astype("float32")
    y = (x[:, :1] + rng.normal(size=(6400, 1)) > 0).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)

    def classifier():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(loss=keras.losses.BinaryCrossentropy(from_logits=True),
                      metrics=[keras.metrics.AUC(from_logits=True, name="auc")])
        return model

    with ps_strategy.scope():
        model = classifier()
        prebuild(model, lambda context: dataset)
    coordinator = tf.distribute.coordinator.ClusterCoordinator(ps_strategy)
    evaluate = keras3.ps_evaluator(model, coordinator, 2)
    local = classifier()
    local.set_weights(model.get_weights())
    expected = local.evaluate(dataset, verbose=0, return_dict=True)
    got = evaluate(dataset)
    assert got["auc"] == pytest.approx(expected["auc"], abs=1e-6)
    assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)
