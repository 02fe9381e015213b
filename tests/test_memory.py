"""The memory limit per task (app/cluster/memory.py) and tools.plan's check against it
(app/planning/memory.py): a process over its limit fails with the named error and exit
code 5; a cluster shape that cannot fit is refused before anything starts."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from app import config as cfg
from app.cluster import memory
from app.planning import memory as plan_memory
from app.planning import model as plan
from launch import local, processes

# The recommender at 15% of Criteo's table sizes: 5.1M rows of 16 floats
# (309 MiB) and as much again of Adagrad's accumulators: built here in a second.
SMALL_TABLES = ["task.table_scale=0.15", "task.train_examples=1000",
                "task.test_examples=10000"]
QUIET = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")


def test_an_allocation_past_the_limit_fails_in_the_process_not_the_machine():
    # RLIMIT_DATA counts numpy's mmap'd arrays: the 2nd GiB fails at a 1.5 GiB limit.
    script = ("import numpy as np\n"
              "from app.cluster import memory\n"
              "memory.apply_limit(1.5)\n"
              "held = [np.ones(1 << 27) for _ in range(2)]  # 1 GiB each\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=QUIET, timeout=60)
    assert done.returncode == 1 and "MemoryError" in done.stderr, done.stderr[-2000:]


def test_the_limit_leaves_room_for_the_stacks_of_threads_started_later():
    # 120 threads (a ps task serves with about 100) reserve 960 MiB of stacks at 8 MiB
    # each, which RLIMIT_DATA counts: with a limit fixed before they start, the
    # 0.5 GiB array would fail at 1 GiB; followed, it fits, and 1 GiB more does not.
    script = ("import resource, threading, time\n"
              "import numpy as np\n"
              "from app.cluster import memory\n"
              "memory.follow_threads(1.0)\n"
              "stop = threading.Event()\n"
              "for _ in range(120): threading.Thread(target=stop.wait, daemon=True).start()\n"
              "# Once the follower has looked at these threads, the limit allows for them.\n"
              "need = int(memory.GIB) + memory.thread_stacks()\n"
              "while resource.getrlimit(resource.RLIMIT_DATA)[0] < need: time.sleep(0.05)\n"
              "held = np.ones(1 << 26)  # 0.5 GiB\n"
              "print('held', flush=True)\n"
              "more = np.ones(1 << 27)  # 1 GiB more\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=QUIET, timeout=60)
    assert done.stdout == "held\n", done.stderr[-2000:]
    assert done.returncode == 1 and "MemoryError" in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
def test_a_task_over_its_memory_limit_stops_with_the_named_error(tmp_path):
    # 40% of Criteo's table sizes (0.8 GiB of tables, as much of slots) under a 1 GiB
    # limit, one process. With malloc as TensorFlow's allocator: the BFC pool (the
    # default) waits 10 s for memory to be freed before it fails (app/cluster/memory.py).
    done = subprocess.run(
        [sys.executable, "-m", "app.train", "--config", "configs/recommender.toml",
         "--set", "runtime.memory_limit_gib=1", "--set", "task.table_scale=0.4",
         "--set", "runtime.onednn=false", "--set", "runtime.cpu_allocator=malloc",
         *[arg for s in SMALL_TABLES[1:] for arg in ("--set", s)],
         "--workdir", str(tmp_path / "run")],
        capture_output=True, text=True, env=QUIET, timeout=120)
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == memory.EXIT_CODE, done.stderr[-3000:]
    assert last.startswith("error: local ran out of its memory limit "
                           "(runtime.memory_limit_gib = 1 GiB), allocating a tensor of "
                           "shape ["), last
    assert last.endswith("raise the limit, or add ps tasks to spread the tables (python -m "
                         "tools.plan --config <the run's config> --memory-limit-gib 1 says how "
                         "many); exit code 5"), last


@pytest.mark.parametrize("fault", ["refused", "wild"])
def test_a_refused_allocation_tensorflow_does_not_check_is_the_named_error(tmp_path, fault):
    """A TensorFlow kernel that writes through the NULL pointer of an allocation the limit
    refused (reading a 2 GiB file whole under 0.5 GiB) ends with the named error and exit
    code 5, not a segfault; a fault at a wild address still crashes (SIGSEGV)."""
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(2 << 30)  # sparse: no disk, zeros when read
    script = ("import ctypes, sys\n"
              "import tensorflow as tf\n"
              "from app.cluster import memory\n"
              "memory.follow_threads(0.5)\n"
              "assert memory.catch_failed_allocations('worker:1', 0.5)\n"
              f"if {fault!r} == 'refused': tf.io.read_file({str(big)!r})\n"
              "else: ctypes.string_at(0xdeadbeef000, 8)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=QUIET, timeout=120)
    if fault == "wild":
        assert done.returncode == -11, done.stderr[-2000:]
        return
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == memory.EXIT_CODE, done.stderr[-2000:]
    assert last.startswith("error: worker:1 ran out of its memory limit "
                           "(runtime.memory_limit_gib = 0.5 GiB), allocating memory in "
                           "TensorFlow's C++ code, which wrote through the NULL pointer of the "
                           "refused allocation (SIGSEGV at 0x"), last
    assert last.endswith("; exit code 5"), last


def test_the_error_names_the_task_tensorflow_could_not_allocate_on():
    class ResourceExhaustedError(Exception):  # TensorFlow's, matched by name
        pass

    error = ResourceExhaustedError(
        "OOM when allocating tensor with shape[1000,16] and type float on "
        "/job:ps/replica:0/task:1/device:CPU:0 by allocator mklcpu")
    assert memory.is_out_of_memory(error) and memory.is_out_of_memory(MemoryError())
    assert not memory.is_out_of_memory(ValueError("OOM"))
    assert not memory.is_out_of_memory(ResourceExhaustedError("grpc: message larger than max"))
    gpu = ResourceExhaustedError(error.args[0].replace("CPU", "GPU"))
    assert memory.message(gpu, "chief:0", 4).startswith("ps:1 ran out of GPU memory, ")
    assert memory.message(error, "chief:0", 4).startswith(
        "ps:1 ran out of its memory limit (runtime.memory_limit_gib = 4 GiB), allocating a "
        "tensor of shape [1000,16]; raise the limit")
    assert processes.exit_text(memory.EXIT_CODE) == (
        "5 (out of its memory limit, runtime.memory_limit_gib)")
    assert memory.EXIT_CODE in processes.NOT_RETRIED  # the same limit would fail again


@pytest.fixture(scope="module")
def small_tables():
    return plan.build(cfg.load("configs/recommender.toml", SMALL_TABLES))


def test_plan_refuses_a_worker_that_no_number_of_ps_tasks_helps(small_tables):
    # Its step alone, on 700 MiB of TensorFlow's own, is over 0.6 GiB.
    with pytest.raises(cfg.ConfigError) as e:
        plan_memory.check(small_tables, num_ps=4, num_workers=2, limit_gib=0.6, place=plan.place)
    assert str(e.value).startswith(
        "worker would peak at 815.5 MiB, over runtime.memory_limit_gib = 0.6 GiB (614.4 MiB), "
        "4 ps and 2 worker(s): no number of ps tasks fits, since the worker holds its step; "
        "raise the limit to at least 0.8 GiB"), e.value


def test_plan_names_how_many_ps_tasks_would_fit(small_tables):
    with pytest.raises(cfg.ConfigError) as e:
        plan_memory.check(small_tables, num_ps=1, num_workers=2, limit_gib=1,
                          place=plan.place)
    assert str(e.value).startswith("ps:0 would peak at 1.4 GiB, over runtime.memory_limit_gib "
                                   "= 1 GiB"), e.value
    assert str(e.value).endswith(": 3 ps tasks would fit (--ps 3), or raise the limit")
    fits = plan_memory.check(small_tables, num_ps=3, num_workers=2, limit_gib=1,
                          place=plan.place)
    assert set(fits) == {"ps:0", "ps:1", "ps:2", "worker", "chief"}
    assert all(nbytes <= memory.GIB for nbytes in fits.values()), fits
    # The chief holds no table: its peak is the same whatever the tables' size.
    assert fits["chief"] < memory.BASELINE_BYTES + plan_memory.COORDINATOR_BYTES + (8 << 20)


def test_plan_counts_each_workers_dense_sync_slots_on_the_ps_tasks(small_tables):
    # ps.mode = sync: each ps task also holds one dense slot per worker beside each
    # trainable shard it holds, the tables' included.
    sync = dataclasses.replace(small_tables, config=cfg.load(
        "configs/recommender.toml", [*SMALL_TABLES, "ps.mode=sync"]))
    placement, traffic = plan.place(small_tables, 4)
    trainable = sum(traffic.trainable_bytes)
    assert trainable == sum(v.shape.num_elements() * v.dtype.size
                            for v in small_tables.model.trainable_variables)
    before = plan_memory.check(small_tables, 4, 2, limit_gib=0, place=plan.place)
    after = plan_memory.check(sync, 4, 2, limit_gib=0, place=plan.place)
    added = {task: after[task] - before[task] for task in before}
    assert sum(added.values()) == 2 * trainable and added["worker"] == added["chief"] == 0
    # Async fits 1 GiB on 3 ps tasks (above); sync's 2 x 309 MiB of slots need more.
    assert plan_memory.fewest_ps(sync, 2, limit_gib=1, place=plan.place) > 3


def test_plan_without_ps_tasks_plans_the_fewest_that_fit(small_tables, capsys):
    assert plan_memory.fewest_ps(small_tables, 2, limit_gib=1, place=plan.place) == 3
    with pytest.raises(cfg.ConfigError, match="no number of ps tasks fits"):
        plan_memory.fewest_ps(small_tables, 2, limit_gib=0.6, place=plan.place)
    # What the out-of-memory error suggests: the run's config, its limit, no --ps.
    from tools import plan as plan_command

    assert plan_command.main(["--config", "configs/recommender.toml", "--memory-limit-gib", "1",
                              *[arg for s in SMALL_TABLES for arg in ("--set", s)]]) == 0
    out = capsys.readouterr().out
    assert out.startswith("3 ps task(s) fit runtime.memory_limit_gib = 1 GiB with 2 worker(s) "
                          "(--ps 3):\n"), out
    assert "  ps:2 " in out and "  ps:3 " not in out


@pytest.mark.slow
def test_the_launcher_starts_nothing_when_a_task_cannot_fit(capfd):
    code = local.main(["--workers", "2", "--ps", "1", "--memory-limit-gib", "1",
                       "--config", "configs/recommender.toml",
                       *[arg for s in SMALL_TABLES for arg in ("--set", s)]])
    out, err = capfd.readouterr()
    assert code == 2, out + err
    assert "error: ps:0 would peak at 1.4 GiB, over runtime.memory_limit_gib = 1 GiB" in err
    assert "3 ps tasks would fit (--ps 3)" in err
    assert "started" not in out, out


def test_a_ps_under_a_limit_allocates_with_malloc_what_it_holds():
    from app import train
    from app.cluster import tf_config as clusters

    spec = {"chief": ["h:1"], "worker": ["h:2"], "ps": ["h:3"]}

    def task(kind: str) -> clusters.Cluster:
        return clusters.parse(json.dumps({"cluster": spec, "task": {"type": kind, "index": 0}}))

    limited, free = cfg.RuntimeConfig(memory_limit_gib=2), cfg.RuntimeConfig()
    assert not train.pooled_allocator(limited, task("ps"))
    assert train.pooled_allocator(limited, task("worker"))
    assert train.pooled_allocator(limited, task("chief"))
    assert train.pooled_allocator(free, task("ps"))
    assert train.pooled_allocator(limited, None)
