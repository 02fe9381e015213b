"""The recommender under ParameterServerStrategy, on the in-process cluster of
conftest.py (2 workers, 2 ps): tables sharded over the ps tasks, read and
updated row by row, and the traffic figures of a real run."""

import pathlib

import numpy as np
import pytest
import tensorflow as tf

from app import config as cfg
from app import task as tasks
from app import trainer
from app.planning import model as plan

pytestmark = pytest.mark.cluster

# Table 2 has 101,312 rows of 16 floats (6.2 MiB): split over both ps tasks by
# the default min_size partitioner (shards of at least 256 KiB, one per ps task).
SETTINGS = ["task.name=recommender", "task.table_scale=0.01", "task.bottom_mlp=16",
            "task.top_mlp=32", "task.traffic_batches=5", "train.global_batch_size=256"]


def config(*overrides: str) -> cfg.Config:
    return cfg.load(None, [*SETTINGS, *overrides])


@pytest.fixture(scope="module")
def built(ps_strategy):
    task = tasks.create(config())[0]
    with ps_strategy.scope():
        model = task.build_model()
        model.compile(task.optimizer(1e-3), loss=task.loss())
        model.optimizer.build(model.trainable_variables)
    return task, model


def _device(op_or_var) -> tf.DeviceSpec:
    return tf.DeviceSpec.from_string(op_or_var.device)


def test_large_tables_are_sharded_over_the_ps_tasks_with_their_slots(built):
    _, model = built
    table = model.get_layer("table_2").embeddings
    assert [v.shape[0] for v in table.variables] == [50656, 50656]
    # One shard on each ps task; which comes first depends on the variables this
    # session's strategy placed before (its round robin goes on from there).
    assert sorted((_device(v).job, _device(v).task) for v in table.variables) == [
        ("ps", 0), ("ps", 1)]
    small = model.get_layer("table_8").embeddings  # 3 rows: kept whole
    assert not hasattr(small, "variables") or len(small.variables) == 1
    accumulator = [part for v in model.optimizer.tables.variables for part in _parts(v)
                   if part.name.startswith("accumulator/table_2/")]
    assert [v.device for v in accumulator] == [v.device for v in table.variables]


def test_a_step_gathers_rows_on_the_ps_and_updates_only_those(built, ps_strategy):
    task, model = built
    features, clicks = next(iter(task.eval_dataset("test", 256)))
    coordinator = tf.distribute.coordinator.ClusterCoordinator(ps_strategy)

    @tf.function
    def step(features, clicks):
        ps_strategy.run(model.train_step, args=((features, clicks),))

    table = model.get_layer("table_2").embeddings
    before = np.concatenate([v.numpy() for v in table.variables])
    coordinator.schedule(step, args=(features, clicks))
    coordinator.join()
    moved = np.flatnonzero(np.any(np.concatenate([v.numpy() for v in table.variables])
                                  != before, axis=1))
    assert set(moved) == set(np.unique(features["cat"][:, 2]))

    graph = step.get_concrete_function(features, clicks).graph
    handles = _captured_handles(graph, model)
    touching: dict[str, set] = {}
    for op in graph.get_operations():
        for tensor in op.inputs:
            if tensor.ref() in handles:
                touching.setdefault(handles[tensor.ref()].name, set()).add(op.type)
                if op.type == "ResourceScatterAdd":  # the update: IndexedSlices of the rows
                    assert op.inputs[2].shape[0] is None  # as many as the batch looked up
    parts = [v for f in range(26) for v in _parts(model.get_layer(f"table_{f}").embeddings)]
    for part in parts:
        # Rows read by gather, written by scatter: never a whole shard read or assigned.
        # A resource op runs where its resource lives, so each of these runs on the
        # shard's ps task; only the rows cross to the worker.
        assert touching[part.name] == {"ResourceGather", "ResourceScatterAdd"}, part.name
        assert _device(part).job == "ps"
    # No tensor of the step is the size of a whole table: nothing concatenates one.
    table_shapes = {(model.get_layer(f"table_{f}").input_dim, 16) for f in range(26)}
    whole = [op.name for op in graph.get_operations() for out in op.outputs
             if out.shape.rank == 2 and tuple(out.shape) in table_shapes]
    assert whole == []


def _parts(variable) -> list:
    return list(getattr(variable, "variables", None) or [variable])


def _captured_handles(graph, model) -> dict:
    """The step graph's placeholders for the captured handles of the table shards
    and their accumulators -> the variable."""
    variables = [v for f in range(26) for v in _parts(model.get_layer(f"table_{f}").embeddings)]
    variables += [v for slot in model.optimizer.tables.variables for v in _parts(slot)
                  if v.name.startswith("accumulator/")]
    by_handle = {v.handle.ref(): v for v in variables}
    return {internal.ref(): by_handle[external.ref()] for external, internal in graph.captures
            if external.ref() in by_handle}


def test_plan_predicts_the_placement(built):
    _, model = built
    from app.distribute.ps import variables as ps_variables

    placement = ps_variables.placement(model.variables + model.optimizer.variables(), 2)
    predicted, _ = plan.predict(config(), num_ps=2)
    # Up to which ps task is first (see above).
    assert sorted(predicted.ps_bytes) == sorted(placement.ps_bytes)


@pytest.fixture(scope="module")
def ran(ps_strategy, ps_cluster, tmp_path_factory):
    """One short run on the cluster: its settings, metrics and workdir."""
    settings = config("task.train_examples=20480", "task.test_examples=4000", "train.epochs=1",
                      "train.learning_rate=0.005", "task.table_learning_rate=0.3",
                      "train.verbose=0", "eval.batch_size=2000", "eval.test_every_epoch=false")
    workdir = tmp_path_factory.mktemp("run")
    metrics = trainer.run(settings, workdir, strategy=ps_strategy, cluster=ps_cluster)
    return settings, metrics, workdir


def test_a_run_records_predicted_and_counted_traffic_per_ps(ran):
    settings, metrics, _ = ran
    assert metrics["test_auc"] > 0.55  # 80 steps: learning, far from done
    traffic = metrics["ps_traffic"]
    for predicted, counted in zip(traffic["predicted_read_bytes"], traffic["counted_read_bytes"],
                                  strict=True):
        assert counted == pytest.approx(predicted, rel=0.2)
    assert traffic["most_uneven_table"]["shard_rows_max_over_mean"] < 1.25  # spread ids
    # The plan's figures, up to which ps task is first: this session's strategy has
    # placed other tests' variables before, and its round robin goes on from there.
    _, planned = plan.predict(settings, num_ps=2)
    assert sorted(planned.read_bytes) == sorted(traffic["predicted_read_bytes"])
    assert sorted(planned.written_bytes) == pytest.approx(  # rounded per shard there
        sorted(traffic["predicted_written_bytes"]), abs=10)


def _table_shapes(model) -> set[tuple[int, int]]:
    return {(model.get_layer(f"table_{f}").input_dim, 16) for f in range(26)
            if model.get_layer(f"table_{f}").input_dim > 1000}


def _whole_tables(graph_def, shapes: set, skip: tuple[str, ...] = (), top: bool = True
                  ) -> list[str]:
    """"function/op" of every tensor shaped as one of `shapes` in `graph_def` (with
    `top`) and in the functions of its library (nested loops' bodies included), but
    those named `skip`."""
    from tensorflow.python.framework import function_def_to_graph

    outer = tf.Graph()
    with outer.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    found = [f"graph/{op.name}" for op in outer.get_operations() for out in op.outputs
             if top and out.shape.rank == 2 and tuple(out.shape) in shapes]
    for function in graph_def.library.function:
        name = function.signature.name
        if any(part in name for part in skip):
            continue
        with outer.as_default():
            graph = function_def_to_graph.function_def_to_graph(function)
        found += [f"{name}/{op.name}" for op in graph.get_operations() for out in op.outputs
                  if out.shape.rank == 2 and tuple(out.shape) in shapes]
    return found


def test_evaluation_on_the_workers_reads_rows_not_tables(built, ps_strategy):
    task, model = built
    from app.distribute.ps import evaluation as ps_evaluation

    coordinator = tf.distribute.coordinator.ClusterCoordinator(ps_strategy)
    evaluate = ps_evaluation.evaluator(model, coordinator, num_workers=2)
    dataset = task.eval_dataset("test", 500).take(2)
    evaluate(dataset)
    per_worker = coordinator.create_per_worker_dataset(dataset).build()
    graph = evaluate._shard.get_concrete_function(per_worker, tf.constant(0, tf.int64)).graph
    assert _whole_tables(graph.as_graph_def(), _table_shapes(model)) == []


def _data_files(prefix: pathlib.Path) -> list[int]:
    """Sizes of the data files of the checkpoint at `prefix`, one per task that wrote."""
    return [f.stat().st_size for f in prefix.parent.glob(prefix.name + ".data-*")]


def test_the_export_and_checkpoints_are_written_by_the_ps_tasks_shard_by_shard(ran, built):
    _, metrics, workdir = ran
    _, model = built
    # Each ps task writes its own shards (TF's MultiDeviceSaver runs each save op on the
    # variable's task): no file, and so no one process, holds most of the bytes.
    # Gathered on the chief, the tables would all be in one file.
    for prefix in (workdir / "export" / "variables" / "variables",
                   workdir / "checkpoints" / "ckpt-1"):
        sizes = _data_files(prefix)
        assert len(sizes) >= 2, (prefix, sizes)
        assert max(sizes) < 0.75 * sum(sizes), (prefix, sizes)
    # The serving functions gather rows. Only what loads the SavedModel holds a table:
    # its graph's variables and the functions that restore and save them all.
    from tensorflow.core.protobuf import saved_model_pb2

    saved = saved_model_pb2.SavedModel.FromString(
        (workdir / "export" / "saved_model.pb").read_bytes())
    graph_def = saved.meta_graphs[0].graph_def
    assert _whole_tables(graph_def, _table_shapes(model), top=False,
                         skip=("_traced_save", "_traced_restore")) == []
    assert _whole_tables(graph_def, _table_shapes(model))  # the check sees the restore

    # And it serves the raw features.
    task = tasks.create(config())[0]
    features, _ = next(iter(task.eval_dataset("test", 64)))
    served = tf.saved_model.load(str(workdir / "export")).signatures["serving_default"]
    assert metrics["num_test_examples"] == 4000
    assert np.isfinite(served(**features)["logit"].numpy()).all()


def _step_counters(workdir: pathlib.Path) -> dict[str, int]:
    """The optimizer's step counters in the run's last checkpoint, by name."""
    checkpoint = tf.train.latest_checkpoint(str(workdir / "checkpoints"))
    return {name: int(tf.train.load_variable(checkpoint, name))
            for name, shape in tf.train.list_variables(checkpoint)
            if name.startswith("model/optimizer/") and not shape
            and ("iter" in name.rsplit("/", 3)[-3])}


# Keras 3's pair kept a counter of its own at 0 (optimizer/_iterations), beside its two
# optimizers' (optimizer/dense/_iterations, optimizer/tables/_iterations): a schedule,
# callback or user code reading it saw a run that never stepped.
def test_the_optimizer_pair_counts_every_step_in_its_own_counter(ps_strategy, ps_cluster,
                                                                 tmp_path):
    settings = config("task.keras=keras", "task.train_examples=1024", "task.test_examples=256",
                      "train.epochs=1", "train.steps_per_epoch=4", "train.verbose=0",
                      "eval.batch_size=256")
    metrics = trainer.run(settings, tmp_path, strategy=ps_strategy, cluster=ps_cluster)
    counters = _step_counters(tmp_path)
    assert metrics["steps"] == 4 and counters and set(counters.values()) == {4}, counters


def test_the_keras2_optimizer_pair_counts_every_step(ran):
    _, metrics, workdir = ran
    counters = _step_counters(workdir)
    assert counters and set(counters.values()) == {metrics["steps"]}, counters
