import re

import pytest
import tensorflow as tf

from app import config as cfg
from app.distribute.ps import variables as ps_variables
from app.planning import model as plan
from tools import plan as plan_command

DENSE_KERNEL = tf.TensorShape([3136, 1024])  # the CNN's 12.25 MiB kernel


@pytest.mark.parametrize("setting, shards_of_kernel, shards_of_bias", [
    (["ps.partitioner=min_size"], 2, 1),  # at most one shard per ps task; small stays whole
    (["ps.partitioner=max_size", "ps.shard_bytes=4194304"], 4, 1),  # <= 4 MiB each
    (["ps.partitioner=fixed", "ps.num_shards=3"], 3, 3),
    (["ps.partitioner=fixed"], 2, 2),  # num_shards 0: one per ps task
])
def test_partitioners_split_by_config(setting, shards_of_kernel, shards_of_bias):
    split = ps_variables.partitioner(cfg.load(None, setting).ps, num_ps=2)
    assert split(DENSE_KERNEL, tf.float32)[0] == shards_of_kernel
    assert split(tf.TensorShape([1024]), tf.float32)[0] == shards_of_bias


def test_no_partitioner_places_whole_variables():
    assert ps_variables.partitioner(cfg.load(None, ["ps.partitioner=none"]).ps, 2) is None


def test_plan_balances_the_cnn_over_two_ps_where_round_robin_does_not():
    balanced, traffic = plan.predict(cfg.load("configs/mnist_ps.toml"), num_ps=2)
    whole, _ = plan.predict(cfg.load("configs/mnist_ps.toml", ["ps.partitioner=none"]), num_ps=2)
    assert balanced.balance <= 1.05 and whole.balance > 1.9
    assert sum(balanced.ps_bytes) == sum(whole.ps_bytes)  # the same variables, placed apart
    # Per step each ps sends its trainable variables and receives their gradients:
    # together the CNN's 3,274,634 float parameters.
    assert sum(traffic.read_bytes) == sum(traffic.written_bytes) == 3_274_634 * 4


def test_plan_halves_the_gradient_bytes_of_a_float16_push():
    _, traffic = plan.predict(cfg.load("configs/mnist_ps.toml", ["ps.compression=fp16"]), num_ps=2)
    assert sum(traffic.read_bytes) == 3_274_634 * 4  # the variables are still read as float32
    assert sum(traffic.written_bytes) == 3_274_634 * 2


def test_plan_halves_the_variable_bytes_of_a_float16_read():
    _, traffic = plan.predict(cfg.load("configs/mnist_ps.toml", ["ps.read_compression=fp16"]),
                              num_ps=2)
    assert sum(traffic.sent_bytes) == 3_274_634 * 2
    assert sum(traffic.read_bytes) == sum(traffic.written_bytes) == 3_274_634 * 4
    loads = {(load.task, load.direction): load.nbytes for load in plan.link_loads(traffic, 2)}
    assert loads["each worker", "receives"] == 3_274_634 * 2 / 2


def test_the_memory_of_multi_worker_mirrored_workers_is_planned_for_keras3_models(capsys):
    # launch.local --ps 0 under a memory limit checks this plan before it starts anything.
    assert plan_command.main(["--config", "configs/mnist_sync.toml", "--ps", "0",
                              "--memory-limit-gib", "4", "--set", "task.keras=keras"]) == 0
    assert "worker" in capsys.readouterr().out


def test_plan_command_prints_the_report(capsys):
    assert plan_command.main(["--config", "configs/mnist_ps.toml", "--ps", "2"]) == 0
    out = capsys.readouterr().out
    # Layer names carry a suffix when other tests built models in this process.
    assert re.search(r"\n  dense\S*/kernel +2 shard\(s\) on ps:\d ps:\d ", out)
    assert "max/mean = 1.013" in out
    assert plan_command.main(["--ps", "-1"]) == 2
    assert plan_command.main([]) == 2  # how many ps tasks? Only a memory limit can say
    assert "error: --ps N: the number of ps tasks to plan for" in capsys.readouterr().err


def test_a_link_turns_the_busiest_directions_bytes_into_a_step_time_bound():
    traffic = plan.Traffic(read_bytes=[100, 300], gradient_scale=0.5)
    loads = {(load.task, load.direction): load.nbytes for load in plan.link_loads(traffic, 2)}
    assert loads == {("ps:0", "sends"): 100, ("ps:0", "receives"): 50,
                     ("ps:1", "sends"): 300, ("ps:1", "receives"): 150,
                     # two workers share the steps, so each takes half of all the bytes
                     ("each worker", "receives"): 200, ("each worker", "sends"): 100}
    # 300 bytes out of ps:1 a step; a worker's read (300) and push (200), 2 in parallel: 250.
    assert plan.step_time_bound(traffic, num_workers=2, rate_bits=8000) == (
        pytest.approx(300 * 8 / 8000), "what ps:1 sends")


def test_a_workers_read_then_push_bounds_the_step_when_it_is_longer():
    # float32 pushes: a worker reads 300 bytes from ps:1, then pushes 400; two workers
    # in parallel finish a step every 350 bytes' time, more than any link's 300.
    seconds, binding = plan.step_time_bound(plan.Traffic([100, 300]), 2, rate_bits=8000)
    assert seconds == pytest.approx(350 * 8 / 8000)
    assert binding == "each worker's read from ps:1 then push, 2 worker(s) in parallel"


def test_plan_command_prints_the_bound_of_a_link(capsys):
    args = ["--config", "configs/mnist_ps.toml", "--ps", "2", "--link", "1gbit"]
    assert plan_command.main(args) == 0
    out = capsys.readouterr().out
    # min_size splits the 12.25 MiB kernel in two: a worker reads the larger half
    # (6.3 MiB) from its ps task, then pushes all 12.5 MiB of gradients.
    bound = re.search(r"lower bound on the step time: ([\d.]+) ms, set by each worker's read "
                      r"from ps:\d then push, 2 worker\(s\) in parallel", out)
    assert bound and float(bound[1]) == pytest.approx((6.3 + 12.5) * 2**20 * 8 / 1e9 / 2 * 1000,
                                                      rel=0.01)
    # Float16 pushes halve that chain; the 6.3 MiB leaving a ps task each step binds.
    assert plan_command.main([*args, "--set", "ps.compression=fp16"]) == 0
    assert re.search(r"set by what ps:\d sends", capsys.readouterr().out)
    assert plan_command.main(["--ps", "2", "--link", "1gb"]) == 2
    assert "error: --link '1gb': cannot read '1gb'" in capsys.readouterr().err


def test_a_ring_all_reduce_sends_2_n_minus_1_over_n_of_the_gradients():
    config = cfg.load("configs/mnist_sync.toml")
    gradients = 3_274_634 * 4
    assert plan.allreduce_bytes(config, 2) == pytest.approx(gradients)
    assert plan.allreduce_bytes(config, 4) == pytest.approx(1.5 * gradients)
    fp16 = cfg.load("configs/mnist_sync.toml", ["sync.compression=fp16"])
    assert plan.allreduce_bytes(fp16, 2) == pytest.approx(gradients / 2)


def test_a_tables_sparse_gradient_is_all_gathered_row_by_row():
    config = cfg.load("configs/recommender.toml", ["task.table_scale=0.05"])
    sent = plan.allreduce_bytes(config, 2)
    # All-reduced densely, each table would send its whole size from each of the two
    # workers; the rows a batch looks up are far fewer.
    from app import task as tasks

    task, config = tasks.create(config)
    model = task.build_model()
    tables = sum(v.shape.num_elements() * 4 for v in model.trainable_variables
                 if task.lookup_rows(v, [v.shape[0]], 1) is not None)
    assert tables and sent < tables / 10


def test_plan_command_prints_the_all_reduces_bound(capsys):
    args = ["--config", "configs/mnist_sync.toml", "--ps", "0", "--workers", "2",
            "--link", "100mbit"]
    assert plan_command.main(args) == 0
    out = capsys.readouterr().out
    assert "each worker sends and receives 12.5 MiB per training step" in out
    bound = re.search(r"lower bound on the step time ([\d.]+) ms", out)
    assert float(bound.group(1)) == pytest.approx(3_274_634 * 4 * 8 / 1e8 * 1000, abs=0.1)


def test_a_lookup_table_is_listed_as_not_a_variable_and_placed_nowhere():
    config = cfg.load(None, ["task.name=zoo:TextVectorizationModel"])
    placement, _ = plan.predict(config, num_ps=2)
    assert len(placement.others) == 1
    report = "\n".join(placement.report())
    assert "not a variable (a lookup table or other resource): not placed" in report
    assert {s.variable.rsplit("/", 1)[-1] for s in placement.shards} >= {"embeddings", "kernel"}


def test_a_variable_of_unknown_shape_is_left_whole():
    # tf_keras' adapted Discretization makes a (2, None) summary in the strategy's scope;
    # TensorFlow's size partitioners multiply its None (and the chief failed).
    for setting in (["ps.partitioner=min_size"], ["ps.partitioner=fixed"]):
        split = ps_variables.partitioner(cfg.load(None, setting).ps, num_ps=2)
        assert split(tf.TensorShape([2, None]), tf.float32) == [1, 1]
