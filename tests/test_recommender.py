"""The built-in recommender: its generator, Zipf laws, teacher ceiling, model,
optimizer pair, plan and parameter checks (the cluster side is in
test_recommender_cluster.py)."""

import json

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from app import config as cfg
from app import task as tasks
from app import trainer
from app.planning import model as plan
from app.tasks import ctr_data, dlrm
from app.tasks.recommender import Recommender
from tests.conftest import one_device_reduction_mirrored

# Small tables (the largest 2026 rows) and a small model: seconds per run.
SMALL = ["task.name=recommender", "task.table_scale=0.0002", "task.embedding_dim=8",
         "task.bottom_mlp=16", "task.top_mlp=32", "task.traffic_batches=4"]


def config(*overrides: str) -> cfg.Config:
    return cfg.load(None, [*SMALL, *overrides])


def task_of(*overrides: str) -> Recommender:
    return tasks.create(config(*overrides))[0]


def context(pipelines=1, pipeline_id=0):
    return tf.distribute.InputContext(num_input_pipelines=pipelines,
                                      input_pipeline_id=pipeline_id,
                                      num_replicas_in_sync=pipelines)


def test_examples_are_a_function_of_their_index_and_pipelines_take_disjoint_ones():
    task = task_of("task.train_examples=64")
    generate = tf.function(task.generator.examples)
    again = tf.function(ctr_data.Generator(task.generator.rows).examples)  # a new object
    first, _, p = generate(tf.range(8, dtype=tf.int64))
    second, _, q = again(tf.range(8, dtype=tf.int64))
    np.testing.assert_array_equal(first["cat"], second["cat"])
    np.testing.assert_array_equal(p, q)
    assert len({tuple(row) for row in first["cat"].numpy()}) == 8  # not one example repeated
    for pipeline in range(2):  # pipeline i of 2 generates examples i, i+2, ...
        features, clicks = next(iter(task.train_dataset(context(2, pipeline), 16)))
        expected, expected_clicks, _ = generate(tf.range(pipeline, 16, 2, dtype=tf.int64))
        np.testing.assert_array_equal(features["cat"], expected["cat"])
        np.testing.assert_array_equal(features["dense"], expected["dense"])
        np.testing.assert_array_equal(clicks, expected_clicks)
    other_seed = task_of("task.train_examples=64", "task.data_seed=1").generator.examples
    assert not np.array_equal(other_seed(tf.range(8, dtype=tf.int64))[0]["cat"], first["cat"])
    # Eager and traced generation agree (a traced list of 64-bit keys once lost bits).
    np.testing.assert_array_equal(task.generator.examples(tf.range(8, dtype=tf.int64))[0]["cat"],
                                  first["cat"])


def test_train_offset_moves_the_training_window_and_not_the_test_set():
    task = task_of("task.train_examples=64", "task.test_examples=32", "task.train_offset=5000")
    generate = tf.function(task.generator.examples)
    features, _ = next(iter(task.train_dataset(context(), 16)))
    np.testing.assert_array_equal(features["cat"],
                                  generate(tf.range(5000, 5016, dtype=tf.int64))[0]["cat"])
    # The test examples stay those after [0, train_examples), as with no offset.
    test, _ = next(iter(task.eval_dataset("test", 32)))
    np.testing.assert_array_equal(test["cat"], generate(tf.range(64, 96, dtype=tf.int64))[0]["cat"])
    assert task._split("test") == task_of("task.train_examples=64",
                                          "task.test_examples=32")._split("test")


def test_zipf_draws_follow_the_law_they_state():
    law = ctr_data.ZipfLaw(1000, 1.05)
    p = law.probabilities(0, 1000)
    assert p.sum() == pytest.approx(1.0, abs=1e-12)
    assert np.all(np.diff(p) < 0)  # popularity falls with rank
    n = 400_000
    u = tf.constant(np.random.default_rng(0).random((n, 1)))
    counts = np.bincount(ctr_data.sample_ranks([law], u).numpy()[:, 0], minlength=1000)
    # Buckets of ranks 0, 1, 2-9, 10-99, 100-999: each within 4 standard deviations.
    for lo, hi in ((0, 1), (1, 2), (2, 10), (10, 100), (100, 1000)):
        expected = n * p[lo:hi].sum()
        assert abs(counts[lo:hi].sum() - expected) < 4 * np.sqrt(expected), (lo, hi)


def test_spread_ids_scatter_the_hot_ranks_and_ranked_ids_keep_them_in_front():
    rows = (10_000,)
    spread = ctr_data.IdMap(rows, spread=True, seed=0).ids_of(0, np.arange(10_000))
    assert sorted(spread.tolist()) == list(range(10_000))  # a permutation of the rows
    hot = spread[:100]
    assert 40 <= np.sum(hot < 5_000) <= 60  # the 100 hottest rows, split over two shards
    ranked = ctr_data.IdMap(rows, spread=False, seed=0).ids_of(0, np.arange(100))
    assert np.all(ranked < 5_000)


def test_auc_is_the_probability_a_positive_outscores_a_negative():
    labels = np.array([0, 1, 0, 1, 1])
    scores = np.array([0.2, 0.2, 0.1, 0.9, 0.5])
    # Pairs (positive, negative): 6, of which 5 won and 1 tied.
    assert ctr_data.auc(labels, scores) == pytest.approx(5.5 / 6)


def test_bayes_figures_are_those_of_the_teachers_probabilities():
    task = task_of("task.train_examples=100", "task.test_examples=2000")
    ceiling = task.ceiling("test")
    _, clicks, p = tf.function(task.generator.examples)(tf.range(100, 2100, dtype=tf.int64))
    y, p = clicks.numpy()[:, 0], p.numpy().astype(np.float64)
    # Every (positive, negative) pair, counted directly.
    pairs = p[y == 1][:, None] - p[y == 0][None, :]
    expected_auc = np.mean((pairs > 0) + 0.5 * (pairs == 0))
    assert ceiling["auc"] == pytest.approx(expected_auc, abs=1e-9)
    assert 0.7 < ceiling["auc"] < 0.9  # the teacher is informative, not a lookup table
    expected_loss = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    assert ceiling["loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert ceiling["click_rate"] == pytest.approx(y.mean())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One pass over 30,000 examples under the default strategy."""
    workdir = tmp_path_factory.mktemp("rec")
    settings = config("task.train_examples=30000", "task.test_examples=10000",
                      "train.epochs=1", "train.global_batch_size=256", "train.verbose=0",
                      "train.learning_rate=0.003", "eval.batch_size=5000",
                      "eval.test_every_epoch=false")
    return trainer.run(settings, workdir), workdir


def test_a_short_run_learns_towards_the_bayes_ceiling(trained):
    metrics, workdir = trained
    assert json.loads((workdir / "metrics.json").read_text()) == metrics
    assert metrics["test_auc"] > 0.65  # chance is 0.5
    assert metrics["test_auc_gap"] == pytest.approx(metrics["bayes_test_auc"]
                                                    - metrics["test_auc"], abs=1e-5)
    assert 0 < metrics["test_auc_gap"] < 0.12
    assert "ps_traffic" not in metrics  # no parameter servers: nothing to count


def test_the_export_serves_raw_features_and_scores_as_evaluated(trained):
    metrics, workdir = trained
    serve = tf.saved_model.load(str(workdir / "export")).signatures["serving_default"]
    task = task_of("task.train_examples=30000", "task.test_examples=10000")
    features, clicks = next(iter(task.eval_dataset("test", 10000)))
    logits = next(iter(serve(**features).values()))  # raw counts and ids in, logits out
    assert ctr_data.auc(clicks.numpy(), logits) == pytest.approx(metrics["test_auc"], abs=2e-3)


def test_tables_update_only_looked_up_rows_and_the_optimizer_pair_checkpoints(tmp_path):
    task = task_of("task.train_examples=512")
    model = task.build_model()
    model.compile(task.optimizer(1e-2), loss=task.loss())
    model.optimizer.build(model.trainable_variables)
    table = model.get_layer("table_2").embeddings
    before = table.numpy()
    features, clicks = next(iter(task.train_dataset(context(), 64)))
    model.fit(features, clicks, batch_size=64, epochs=1, verbose=0)
    moved = np.any(table.numpy() != before, axis=1)
    assert set(np.flatnonzero(moved)) == set(np.unique(features["cat"][:, 2]))
    optimizer = model.optimizer
    assert int(optimizer.iterations) == 1
    accumulator = [v for v in optimizer.tables.variables if "table_2" in v.name][0]
    tf.train.Checkpoint(model=model).write(str(tmp_path / "ckpt"))

    fresh = task.build_model()
    fresh.compile(task.optimizer(1e-2), loss=task.loss())
    fresh.optimizer.build(fresh.trainable_variables)
    tf.train.Checkpoint(model=fresh).read(str(tmp_path / "ckpt")).assert_consumed()
    restored = [v for v in fresh.optimizer.tables.variables if "table_2" in v.name][0]
    np.testing.assert_array_equal(restored.numpy(), accumulator.numpy())
    np.testing.assert_array_equal(fresh.get_layer("table_2").embeddings.numpy(), table.numpy())
    adam_slots = [v.numpy() for v in optimizer.dense.variables]
    assert all(np.array_equal(a, v.numpy())
               for a, v in zip(adam_slots, fresh.optimizer.dense.variables, strict=True))
    assert int(fresh.optimizer.iterations) == 1


def test_backup_and_restore_resumes_the_optimizer_pair(tmp_path):
    task = task_of("task.train_examples=512")

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                raise RuntimeError("interrupted")

    def fit(callbacks):
        model = task.build_model()
        model.compile(task.optimizer(1e-2), loss=task.loss())
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
        history = model.fit(task.train_dataset(context(), 64), steps_per_epoch=4, epochs=2,
                            verbose=0, callbacks=[backup, *callbacks])
        return model, history

    with pytest.raises(RuntimeError, match="interrupted"):
        fit([Interrupt()])
    model, history = fit([])
    assert history.epoch == [1]  # the second epoch only: the first was restored
    assert int(model.optimizer.iterations) == 8
    assert int(model.optimizer.tables.iterations) == 8


def test_mirrored_replicas_train_their_table_copies_row_by_row():
    strategy = one_device_reduction_mirrored()  # 2 replicas on the 2 logical CPUs
    task = task_of("task.train_examples=512")
    with strategy.scope():
        model = task.build_model()
        model.compile(task.optimizer(1e-2), loss=task.loss())
        model.optimizer.build(model.trainable_variables)
    table = model.get_layer("table_2").embeddings
    copies = strategy.experimental_local_results(table)
    before = copies[0].numpy()
    features, clicks = next(iter(task.train_dataset(context(), 64)))

    @tf.function
    def step(features, clicks):
        strategy.run(model.train_step, args=((features, clicks),))

    step(features, clicks)  # the same batch on both replicas: the sum of their gradients
    moved = np.flatnonzero(np.any(copies[0].numpy() != before, axis=1))
    assert set(moved) == set(np.unique(features["cat"][:, 2]))
    np.testing.assert_array_equal(copies[0].numpy(), copies[1].numpy())  # still mirrored
    graph = step.get_concrete_function(features, clicks).graph
    handles = {copy.handle.ref() for copy in copies}
    inside = {internal.ref() for external, internal in graph.captures
              if external.ref() in handles}
    # Each replica gathers its rows and scatters its update: no read of a whole copy.
    assert {op.type for op in graph.get_operations() for x in op.inputs
            if x.ref() in inside} == {"ResourceGather", "ResourceScatterAdd"}


def test_plan_predicts_the_distinct_rows_a_batch_reads():
    settings = config("task.table_scale=0.01", "train.global_batch_size=512")
    placement, traffic = plan.predict(settings, num_ps=2)
    task = tasks.create(settings)[0]
    trainable = {v.name.removesuffix(":0") for v in task.build_model().trainable_variables}
    tables: dict[str, list] = {}
    dense, counted = [0, 0], [0.0, 0.0]  # bytes each ps sends: variables read whole, table rows
    for shard in placement.shards:
        if shard.variable.endswith("/embeddings") and shard.variable in trainable:
            tables.setdefault(shard.variable, []).append(shard)  # in row order
        elif shard.variable in trainable:
            dense[shard.ps_task] += shard.bytes
    assert len(tables["table_2/embeddings"]) == 2  # 101,312 rows: split over both ps tasks
    batches = [f["cat"].numpy() for f, _ in task.train_dataset(context(), 512).take(8)]
    for name, shards in tables.items():
        feature = int(name.split("/")[0].removeprefix("table_"))
        edges = np.cumsum([s.shape[0] for s in shards])[:-1]
        for batch in batches:
            shard_of = np.searchsorted(edges, np.unique(batch[:, feature]), side="right")
            for s, shard in enumerate(shards):
                counted[shard.ps_task] += np.sum(shard_of == s) * 8 * 4 / len(batches)
    for predicted, whole, count in zip(traffic.read_bytes, dense, counted, strict=True):
        assert predicted - whole == pytest.approx(count, rel=0.2)
    assert sum(traffic.read_bytes) < sum(s.bytes for g in tables.values() for s in g) / 10
    # worker -> ps: the gradient rows and 16 bytes of ids per row, on top of the dense gradients.
    assert sum(traffic.written_bytes) > sum(traffic.read_bytes)


@pytest.mark.parametrize("override, message", [
    ("task.bottom_mlp=64,x", "task.bottom_mlp = '64,x' must be positive layer widths separated "
                             "by commas, e.g. '256,64' (or '' for none)"),
    ("task.table_scale=1000", "task.table_scale = 1000.0 makes the largest table 10131227000 "
                              "rows; the generator allows at most 2147483647: lower "
                              "task.table_scale to 212 or less"),
    ("task.ids=hashed", "task.ids = 'hashed' is not one of spread, ranked"),
    ("task.embedding_dim=0", "task.embedding_dim = 0 must be > 0"),
    ("task.train_offset=10", "task.train_offset = 10 trains on examples [10, 1000010), which "
                             "overlap the validation and test examples [1000000, 1100000); use "
                             "0 or at least 1100000"),
    ("task.train_offset=-1", "task.train_offset = -1 must be >= 0"),
])
def test_bad_parameters_name_the_field_and_the_fix(override, message):
    with pytest.raises(cfg.ConfigError) as e:
        tasks.create(config(override))
    assert str(e.value) == message


def test_tables_are_told_apart_from_other_variables():
    assert dlrm.is_table(tf.Variable(tf.zeros([2, 2]), name="table_3/embeddings"))
    part = tf.Variable(tf.zeros([2, 2]), name="table_3/embeddings/part_1")
    assert dlrm.is_table(part)
    assert not dlrm.is_table(tf.Variable(tf.zeros([2]), name="top_0/kernel"))
