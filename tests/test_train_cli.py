"""The command line end to end, as a user runs it (subprocesses)."""

import json
import os
import subprocess
import sys

import pytest

SMALL = ["--set", "task.train_examples=2000", "--set", "task.validation_examples=200",
         "--set", "task.test_examples=500", "--set", "train.epochs=2",
         "--set", "train.verbose=0"]


def run_cli(*args, tf_config=None, cwd=None):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    if tf_config is not None:
        env["TF_CONFIG"] = tf_config
    return subprocess.run([sys.executable, "-m", "app.train", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_train_on_real_mnist_subset_writes_metrics(tmp_path):
    workdir = tmp_path / "run"
    # oneDNN off: its own allocator would count bytes whatever runtime.cpu_allocator says.
    result = run_cli("--config", "configs/mnist.toml", *SMALL, "--set", "runtime.onednn=false",
                     "--workdir", str(workdir))
    assert result.returncode == 0, result.stderr
    metrics = json.loads((workdir / "metrics.json").read_text())
    assert metrics["strategy"] == "DefaultStrategy"
    assert (metrics["num_replicas"], metrics["num_workers"], metrics["num_ps"]) == (1, 1, 0)
    assert metrics["epochs_completed"] == 2 and metrics["steps"] == 2 * (1800 // 32)
    assert metrics["num_test_examples"] == 500
    assert metrics["test_accuracy"] > 0.8  # real digits, learnt in 112 steps
    assert metrics["train_examples_per_sec"] > 0 and metrics["wall_seconds"] > 0
    # The default allocator, bfc, counts its bytes; TensorFlow's own does not (below).
    assert metrics["cpu_allocator"] == "bfc" and metrics["peak_cpu_tensor_mib"] > 1
    last_line = result.stdout.strip().splitlines()[-1]
    assert last_line.startswith(f"test_accuracy={metrics['test_accuracy']:.4f} ")
    assert "(500 test examples)" in last_line
    assert (workdir / "config.toml").exists()

    again = run_cli("--config", "configs/mnist.toml", *SMALL, "--set", "runtime.onednn=false",
                    "--workdir", str(workdir))
    assert again.returncode == 2
    assert "already holds a finished run" in again.stderr
    assert json.loads((workdir / "metrics.json").read_text()) == metrics


@pytest.mark.slow
def test_mirrored_on_two_logical_cpus(tmp_path):
    result = run_cli("--strategy", "mirrored", "--set", "runtime.cpu_devices=2", *SMALL,
                     "--set", "train.epochs=1", "--set", "runtime.cpu_allocator=malloc",
                     "--set", "runtime.onednn=false", "--workdir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert (metrics["strategy"], metrics["num_replicas"]) == ("MirroredStrategy", 2)
    # TensorFlow's default allocator (oneDNN off) keeps no count: the setting reached it.
    assert metrics["cpu_allocator"] == "malloc" and "peak_cpu_tensor_mib" not in metrics


@pytest.mark.parametrize("args, tf_config, message", [
    (["--set", "train.epochs=-1"], None, "error: train.epochs = -1 must be > 0"),
    (["--set", "train.global_batch_size=33", "--strategy", "mirrored",
      "--set", "runtime.cpu_devices=2"], None,
     "error: train.global_batch_size (33) must be divisible by the number of replicas (2); "
     "use 32 or 34"),
    ([], "{oops", "error: TF_CONFIG is not valid JSON"),
    ([], json.dumps({"cluster": {"ps": ["a:1"], "worker": ["b:1"]},
                     "task": {"type": "ps", "index": 0}}),
     "error: TF_CONFIG cluster has a 'ps' job but no 'chief'"),
    (["--strategy", "mirrored"], json.dumps({"cluster": {"worker": ["a:1", "b:1"]},
                                             "task": {"type": "worker", "index": 0}}),
     "error: --strategy mirrored trains on one host, but TF_CONFIG describes a cluster"),
    (["--strategy", "mirrorred"], None,
     "error: --strategy 'mirrorred' is not one of auto, default, mirrored, "
     "multi_worker_mirrored, parameter_server; did you mean --strategy mirrored?"),
    (["--set", "task.name=mnsit"], None,
     "error: task.name = 'mnsit' is neither a built-in task (mnist, recommender) nor an "
     "import path like 'my_package.my_module:MyTask'; did you mean mnist?"),
    (["--set", "task.name=tests.numbered:PythonNumbered", "--set", "data.service=localhost:1"],
     None, "error: data.service: the training dataset of task tests.numbered:PythonNumbered "
           "calls Python through EagerPyFunc (tf.py_function)"),
    (["--set", "data.service=localhost:1", "--set", "cluster.connect_timeout_s=2"], None,
     "error: no tf.data service dispatcher answers at data.service = localhost:1 "
     "within cluster.connect_timeout_s = 2 s"),
])
def test_bad_input_exits_2_with_one_line(tmp_path, args, tf_config, message):
    result = run_cli(*args, "--workdir", str(tmp_path / "w"), tf_config=tf_config)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(message)
    assert "Traceback" not in result.stderr
    # A mistake in the config or the cluster is found before anything is written; the
    # tf.data service's are found when the input is first read.
    assert (tmp_path / "w").exists() == ("data.service" in message), message


def test_an_unknown_task_or_strategy_is_named_before_tensorflow_starts():
    # TensorFlow takes seconds to import (16 on a loaded machine): a typo, or a
    # strategy the cluster cannot run, is named first.
    two_workers = json.dumps({"cluster": {"worker": ["a:1", "b:1"]},
                              "task": {"type": "worker", "index": 0}})
    for args, tf_config in ((["--set", "task.name=mnsit"], None),
                            (["--strategy", "mirrorred"], None),
                            (["--strategy", "mirrored"], two_workers)):
        env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        result = subprocess.run(
            [sys.executable, "-c", "import sys\nfrom app import train\n"
             f"code = train.main({args!r})\n"
             "print(code, 'tensorflow' in sys.modules)"],
            capture_output=True, text=True, timeout=120,
            env=env | ({"TF_CONFIG": tf_config} if tf_config else {}))
        assert result.stdout.split() == ["2", "False"], result.stdout + result.stderr


@pytest.mark.slow
def test_tensorflows_warnings_print_once_with_the_tasks_label_when_it_started_first():
    # As in make local-cluster: TensorFlow imported (its servers started) before the
    # chief sets up logging. Its warning about its own checkpoint writer's retracing,
    # which blames the user's code, is left out.
    saver = ("5 out of the last 5 calls to <function MultiDeviceSaver.save.<locals>."
             "tf_function_save at 0x7f> triggered tf.function retracing.")
    result = subprocess.run(
        [sys.executable, "-c", "import tensorflow as tf\nfrom app import train\n"
         "train.setup_logging('chief:0')\ntf.get_logger().warning('retracing, say')\n"
         f"tf.get_logger().warning({saver!r})"],
        capture_output=True, text=True, timeout=120)
    said = [line for line in result.stderr.splitlines() if "retracing" in line]
    assert said == ["[chief:0] WARNING retracing, say"], result.stderr


def test_a_failed_export_ends_a_trained_run_with_one_line_and_exit_6(tmp_path):
    workdir = tmp_path / "w"
    result = run_cli("--set", "task.name=zoo_keras3:UnexportableModel", "--set", "train.epochs=1",
                     "--set", "train.global_batch_size=16", "--set", "train.verbose=0",
                     "--workdir", str(workdir), cwd=os.path.dirname(__file__))
    assert result.returncode == 6, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the export failed ("), last
    assert "docs/troubleshooting.md" in last and "Traceback" not in result.stderr
    metrics = json.loads((workdir / "metrics.json").read_text())
    assert metrics["export_error"] in last and metrics["steps"] == 4
    assert (workdir / "model.keras").exists() and list((workdir / "checkpoints").iterdir())
    assert not (workdir / "export").exists()  # whole or absent


@pytest.mark.parametrize("jobs, task, code, at_once", [
    # A MultiWorkerMirrored worker's peers may have left: at the interpreter's exit
    # TensorFlow's coordination service would wait for them.
    ({"worker": ["a:1", "b:1"]}, ("worker", 0), 204, True),
    ({"chief": ["a:1"], "worker": ["b:1"]}, ("chief", 0), 203, True),
    # A parameter-server chief that lost a task; one preempted leaves as usual.
    ({"chief": ["a:1"], "worker": ["b:1"], "ps": ["c:1"]}, ("chief", 0), 203, True),
    ({"chief": ["a:1"], "worker": ["b:1"], "ps": ["c:1"]}, ("chief", 0), 204, False),
    ({"worker": ["a:1"]}, ("worker", 0), 204, False),
])
def test_a_lost_or_preempted_task_of_a_cluster_exits_at_once(monkeypatch, jobs, task, code,
                                                              at_once):
    from app import train
    from app.cluster import tf_config

    cluster = tf_config.Cluster({job: tuple(addrs) for job, addrs in jobs.items()}, *task)
    exits = []
    monkeypatch.setattr(train, "exit_now", exits.append)
    assert train.lost(cluster, code) == (None if at_once else code)
    assert exits == ([code] if at_once else [])
