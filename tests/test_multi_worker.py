"""MultiWorkerMirroredStrategy with 2 worker processes (launch.local --ps 0)."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.launching import kill_on_line, run_workers

pytestmark = pytest.mark.slow

# 1000 training examples (31 steps of 32 a worker pair shares) and 101 test
# images: neither divides over 2 workers (the uneven-data pitfall, TF #36153).
SMALL = ["--set", "task.train_examples=1500", "--set", "task.validation_examples=500",
         "--set", "task.test_examples=101", "--set", "train.verbose=2"]


def launch(tmp_path, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    return subprocess.Popen(
        [sys.executable, "-u", "-m", "launch.local", "--workers", "2", "--ps", "0", *SMALL,
         "--workdir", str(tmp_path / "run"), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def test_two_workers_train_in_sync_and_a_killed_one_resumes_both_from_the_backup(tmp_path):
    # One run for both paths: killed as epoch 2 begins (epoch 1 is in the backup), the
    # job is relaunched, resumes, and ends as a clean run does.
    launcher = launch(tmp_path, "--set", "train.epochs=3", "--set", "task.model=mlp",
                      "--max-restarts", "1")
    output, killed = kill_on_line(launcher, "[worker:1] Epoch 2/3", "worker:1")
    launcher.wait(timeout=600)
    assert killed and launcher.returncode == 0, output[-3000:]
    after = output[output.index("[launch] restart 1 of 1"):]
    assert "[worker:0] Epoch 1/3" not in after  # the completed epoch is not redone
    assert "[worker:0] Epoch 2/3" in after
    assert "[launch] worker:1 exited with 0" in after
    digests = dict(re.findall(r"\[(worker:\d)\] INFO weights sha256 (\w+)", after))
    assert len(digests) == 2 and len(set(digests.values())) == 1, digests  # identical weights
    run = tmp_path / "run"
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["epochs_completed"] == 3
    assert metrics["strategy"] == "MultiWorkerMirroredStrategy"
    assert (metrics["num_workers"], metrics["num_replicas"]) == (2, 2)
    assert metrics["num_test_examples"] == 101
    losses = [epoch["loss"] for epoch in metrics["history"]]
    assert losses[2] < losses[0]
    assert sorted(p.name for p in run.iterdir()) == [
        "backup", "checkpoints", "config.toml", "export", "metrics.json", "shape.json",
        "tensorboard"]


# Each worker builds the project's strategy from TF_CONFIG and reads two global
# batches of examples numbered 0..99 through the input path fit() uses.
READ_SHARD = """
import json, numpy as np, tensorflow as tf
from app.cluster import tf_config as cluster
from app import strategy
from app.tasks.mnist import Mnist
s = strategy.create("auto", cluster.read())
images = np.zeros((100, 28, 28, 1), np.uint8)
split = images, np.arange(100, dtype=np.int64)
task = Mnist.from_arrays(split, None, split, Mnist.Params(shuffle_buffer=0))
fn = lambda context: task.train_dataset(context, global_batch_size=10)
options = strategy.input_options(s)
it = iter(s.distribute_datasets_from_function(fn, options))
ids = [int(v) for _ in range(2) for y in s.experimental_local_results(next(it)[1]) for v in y]
print("IDS", json.dumps({"ids": ids, "plain": options is not None}))
"""


def test_each_worker_reads_its_own_shard_through_a_plain_iterator():
    read = [json.loads(output.split("IDS ", 1)[1]) for output in run_workers("-c", READ_SHARD)]
    assert all(r["plain"] for r in read)  # one CPU replica per worker: PER_REPLICA input
    # Batches of 5 (10 over 2 replicas); worker i reads examples i, i + 2, ...
    assert read[0]["ids"] == list(range(0, 20, 2))
    assert read[1]["ids"] == list(range(1, 20, 2))


# Keras's gradient aggregation under the project's MultiWorkerMirroredStrategy,
# traced on each worker: one collective all-reduce op per pack.
COUNT_PACKS = """
import sys, tensorflow as tf, tf_keras
from app.cluster import tf_config as cluster
from app import config, strategy
from app.tasks import mnist
conf = config.load(None, [f"sync.bytes_per_pack={sys.argv[1]}"])
s = strategy.create("auto", cluster.read(), conf)
with s.scope():
    model = mnist.cnn(tf_keras, (28, 28, 1), 10, dropout=0.5)
    optimizer = tf_keras.optimizers.Adam()

@tf.function
def step(images, labels):
    def replica_step(images, labels):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf_keras.losses.sparse_categorical_crossentropy(
                labels, model(images), from_logits=True))
        grads = tape.gradient(loss, model.trainable_variables)
        return [g for g, _ in optimizer.aggregate_gradients(
            list(zip(grads, model.trainable_variables)))]
    return s.run(replica_step, args=(images, labels))

specs = tf.TensorSpec([4, 28, 28, 1], tf.uint8), tf.TensorSpec([4], tf.int64)
graph = step.get_concrete_function(*specs).graph
print("PACKS", sum(op.type.startswith("CollectiveReduce") for op in graph.get_operations()))
"""


@pytest.mark.parametrize("bytes_per_pack, packs", [(0, 1), (4 << 20, 2)])
def test_gradients_are_all_reduced_in_packs_of_sync_bytes_per_pack(bytes_per_pack, packs):
    # Reversed, the CNN's gradients are the dense layers' (12.9 MB, passing
    # 4 MiB at the big kernel), then the convolutions': two packs.
    for output in run_workers("-c", COUNT_PACKS, str(bytes_per_pack)):
        assert f"PACKS {packs}\n" in output, output[-3000:]


# Adagrad's sparse gradients under the project's MultiWorkerMirroredStrategy: three
# tables' rows, different on each worker, cross in one all-gather, and both workers
# update their copies as Keras' Adagrad updates one table from both workers' rows.
GATHER_TABLES = """
import json, numpy as np, tensorflow as tf, tf_keras
from app.cluster import tf_config as cluster
from app import config, strategy
from app.dialects import keras2_optimizers as optimizers
s = strategy.create("auto", cluster.read(), config.load(None, []))
shapes = [(9, 3), (5, 2), (7, 4)]
with s.scope():
    tables = [tf.Variable(tf.ones(shape)) for shape in shapes]
    dense = tf.Variable(tf.ones((2,)))
    optimizer = optimizers.Adagrad(0.5)

def gradients(replica):  # replica r looks up r + 2 rows of each table, from row r
    rows = lambda shape: tf.range(replica, 2 * replica + 2) % shape[0]
    return [tf.IndexedSlices(tf.ones((replica + 2, shape[1])) * tf.cast(replica + 1, tf.float32),
                             rows(shape)) for shape in shapes]

@tf.function
def step():
    def replica_step():
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        optimizer.apply_gradients(zip([*gradients(replica), tf.ones((2,))], [*tables, dense]))
    s.run(replica_step)

graph = step.get_concrete_function().graph
ops = [op.type for f in [graph, *(f.graph for f in graph._functions.values())]
       for op in f.get_operations()]
step()
expected = [tf.Variable(tf.ones(shape)) for shape in shapes]
reference = tf_keras.optimizers.Adagrad(0.5)
both = [tf.IndexedSlices(tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0))
        for a, b in zip(gradients(0), gradients(1))]
reference.apply_gradients(zip(both, expected))
print("GATHERS", sum(t.startswith("CollectiveGather") for t in ops))
print("TABLES", json.dumps([np.round(t.numpy(), 6).tolist() for t in tables]))
print("SAME", all(np.allclose(t.numpy(), e.numpy(), rtol=1e-6) for t, e in zip(tables, expected)))
"""


def test_sparse_gradients_of_all_tables_cross_in_one_all_gather():
    outputs = run_workers("-c", GATHER_TABLES)
    for output in outputs:
        # One all-gather exchanges the packed tensor's lengths, one its data; Keras'
        # own all-reduce, one IndexedSlices at a time, traces 15 here.
        assert "GATHERS 2\n" in output and "SAME True\n" in output, output[-3000:]
    tables = [json.loads(output.split("TABLES ", 1)[1].splitlines()[0]) for output in outputs]
    assert tables[0] == tables[1]
