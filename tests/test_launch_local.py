"""launch.local end to end: a chief, 2 workers and a ps as separate processes,
one worker SIGKILLed mid-epoch; the chief finishes the run on the other."""

import json
import os
import subprocess
import sys
import threading

import pytest

from app.cluster.preemption import EXIT_CODE as PREEMPTED
from app.cluster.tf_config import TaskLost
from launch import local, network, processes
from tests import launching
from tests.test_ports import plain_bind

LOST = TaskLost.exit_code

pytestmark = pytest.mark.slow


def test_training_survives_a_worker_killed_mid_epoch(tmp_path):
    workdir = tmp_path / "run"
    launcher = launching.launch(
        "--workers", "2", "--ps", "1",
        "--set", "task.train_examples=6000", "--set", "task.validation_examples=500",
        "--set", "task.test_examples=500", "--set", "train.epochs=2",
        "--set", "train.verbose=2", "--set", "debug.log_every_steps=10",
        "--set", "task.model=mlp",  # what is tested is the cluster, not the model
        *launching.hold(40, tmp_path / "release"), "--workdir", str(workdir))
    # At step 40 (scheduled) of the first epoch's 171: well inside it.
    output, killed = launching.signal_at_step(launcher, "chief:0", 40, "worker:1",
                                              release=tmp_path / "release")
    code = launcher.wait(timeout=60)
    assert killed, output[-3000:]
    assert code == 0, output[-3000:]
    metrics = json.loads((workdir / "metrics.json").read_text())
    assert metrics["epochs_completed"] == 2
    # Every scheduled step ran (171 an epoch), on worker 0; a step the killed worker had
    # already applied before dying is run again, so one more is possible.
    assert metrics["steps"] >= 2 * (5500 // 32)
    assert "[launch] chief:0 exited with 0" in output
    # The survivors saw the chief go and stopped by themselves, with exit code 0.
    assert "[launch] ps:0 exited with 0" in output
    assert "[launch] worker:0 exited with 0" in output


def test_evaluator_task_evaluates_the_chiefs_checkpoints(tmp_path):
    workdir = tmp_path / "run"
    args = [sys.executable, "-u", "-m", "launch.local", "--workers", "1", "--ps", "1",
            "--evaluator", "--set", "task.train_examples=3000",
            "--set", "task.validation_examples=0", "--set", "task.test_examples=300",
            "--set", "train.epochs=2", "--set", "eval.test_every_epoch=false",
            "--set", "train.verbose=0", "--set", "task.model=mlp", "--workdir", str(workdir)]
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "[launch] evaluator:0 exited with 0" in result.stdout
    metrics = json.loads((workdir / "metrics.json").read_text())
    evaluation = metrics["eval"]
    # The last checkpoint holds the final weights, sharded over the ps during
    # training and restored whole by the evaluator: the same accuracy as the chief's.
    assert evaluation["checkpoint"] == "ckpt-2" and evaluation["num_test_examples"] == 300
    assert evaluation["test_accuracy"] == pytest.approx(metrics["test_accuracy"], abs=1e-6)
    assert any((workdir / "eval" / "tensorboard").rglob("events.out.tfevents.*"))


def test_thread_settings_share_the_cores_unless_chosen(tmp_path):
    cores = os.cpu_count()
    assert local.thread_settings(2, []) == [
        "--set", f"runtime.intra_op_threads={max(1, cores // 2)}",
        "--set", "runtime.inter_op_threads=3", "--set", "runtime.thread_spinning=false"]
    assert local.thread_settings(2, ["--set", "runtime.intra_op_threads=4"]) == [
        "--set", "runtime.inter_op_threads=3", "--set", "runtime.thread_spinning=false"]
    # A key the --config file sets is chosen too, whatever its value: the launcher's
    # own --set, which comes first, would override the file.
    toml = tmp_path / "run.toml"
    toml.write_text("[runtime]\nthread_spinning = true\ninter_op_threads = 2\n")
    assert local.thread_settings(2, ["--config", str(toml)]) == [
        "--set", f"runtime.intra_op_threads={max(1, cores // 2)}"]
    # An unreadable file is the tasks' to report (exit 2), not the launcher's.
    assert local.thread_settings(2, ["--config", str(tmp_path / "missing.toml")]) == \
        local.thread_settings(2, [])


def test_the_in_process_clusters_servers_sleep_when_idle(monkeypatch):
    # make local-cluster's servers share one process's cores, as launch.local's tasks
    # share a host's (thread_settings above).
    from app.cluster import serving
    from launch import inprocess

    started = []
    monkeypatch.setattr(serving, "start_server", lambda spec, job, index, **kwargs:
                        started.append((job, index, kwargs)))
    inprocess.start_servers({"ps": ["localhost:1"], "worker": ["localhost:2", "localhost:3"]})
    assert started == [("ps", 0, {"spinning": False}), ("worker", 0, {"spinning": False}),
                       ("worker", 1, {"spinning": False})]


@pytest.mark.parametrize("codes, calls, result", [
    ([PREEMPTED, 0], 2, 0),        # preempted with the backup saved: relaunched, resumes
    ([LOST, PREEMPTED, LOST], 3, LOST),  # lost tasks: relaunched until --max-restarts runs out
    ([2], 1, 2),         # a configuration or storage error would fail again
    ([5], 1, 5),         # out of the memory limit again
    ([6], 1, 6),         # a trained run whose export failed: its export would fail again
])
def test_max_restarts_relaunches_all_but_the_codes_that_would_fail_again(monkeypatch, codes,
                                                                         calls, result):
    returned = iter(codes)
    seen = []
    monkeypatch.setattr(local, "run_cluster",
                        lambda args, train_args: seen.append(1) or (next(returned), False))
    assert local.main(["--max-restarts", "2", "--workdir", "unused"]) == result
    assert len(seen) == calls
    assert local.exit_text(204) == "204 (preempted, backup saved)"
    assert local.exit_text(203) == "203 (a task was lost)" and local.exit_text(-9) == "-9"


def test_the_help_names_every_exit_code_that_is_not_retried(capsys):
    with pytest.raises(SystemExit):
        local.main(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert ("relaunch up to N times after a failure, whatever its exit code but 2 "
            "(configuration or storage error), 5 (out of its memory limit, "
            "runtime.memory_limit_gib) and 6 (trained, but the export failed), which would "
            "fail again") in shown
    assert processes.NOT_RETRIED == (0, 2, 5, 6)  # the help is made from it


def test_a_partition_cuts_the_first_attempt_only(monkeypatch):
    seen = []
    monkeypatch.setattr(local, "enter_network", lambda argv: None)  # no namespace needed
    monkeypatch.setattr(local, "run_cluster", lambda args, train_args: (
        seen.append(list(args.partitions)) or (LOST, False)))
    argv = ["--link", "1gbit", "--partition", "ps:0@30+20", "--max-restarts", "1",
            "--workdir", "unused"]
    assert local.main(argv) == LOST
    assert seen == [[network.Partition("ps:0", 30.0, 20.0)], []]


def test_restart_task_needs_parameter_servers(capsys):
    with pytest.raises(SystemExit) as e:
        local.main(["--ps", "0", "--restart", "task", "--workdir", "unused"])
    assert e.value.code == 2
    assert ("--restart task needs parameter servers (--ps 1 or more): synchronous workers "
            "all-reduce every step") in capsys.readouterr().err


class FakeTask:
    """A task whose process exits with the next of `codes` each time it is started."""

    def __init__(self, label: str, codes: list[int], started: list[str]):
        self.label, self.job, self.codes, self.started = label, label.split(":")[0], codes, started
        self.serves_data = self.job in ("dispatcher", "data_worker")
        self.returncode = codes.pop(0) if codes else None  # None: runs until stopped
        self.process = self
        self.graces = []  # what each finish() was given
        started.append(label)

    def poll(self):
        return self.returncode

    def again(self):
        return FakeTask(self.label, self.codes, self.started)

    def stop(self, now=False):
        if self.returncode is None:
            self.returncode = PREEMPTED

    def finish(self, grace_s=0):
        self.graces.append(grace_s)
        return self.returncode


@pytest.mark.parametrize("ps_codes, max_restarts, result, started", [
    # The ps is lost; the chief fails with it (203); both are relaunched, alone.
    ([-9, None], 1, 0, ["ps:1", "chief:0", "ps:1", "chief:0"]),
    # The ps fails again: its second failure is one more than it may have.
    ([-9, -9, None], 1, 1, ["ps:1", "chief:0", "ps:1"]),
    ([-9, -9, None], 2, 0, ["ps:1", "chief:0", "ps:1", "ps:1", "chief:0"]),
])
def test_restart_alone_relaunches_each_failed_task_up_to_the_limit(ps_codes, max_restarts,
                                                                  result, started):
    seen = []
    ps = FakeTask("ps:1", ps_codes, seen)
    chief = FakeTask("chief:0", [LOST, 0], seen)
    stopped = threading.Event()
    assert processes.restart_alone([ps, chief], chief, max_restarts, stopped) == result
    assert seen == started


def test_a_tf_data_service_task_is_relaunched_alone_and_stopped_after_the_lead():
    seen = []
    data_worker = FakeTask("data_worker:0", [-9, None], seen)
    chief = FakeTask("chief:0", [None], seen)
    running = [data_worker, chief]
    restarts = {}
    local.relaunch_data(running, restarts)  # under --restart job: not the trainers' business
    assert seen == ["data_worker:0", "chief:0", "data_worker:0"] and restarts == {
        "data_worker:0": 1}
    chief.returncode = 0
    assert processes.restart_alone(running, chief, 3, threading.Event()) == 0
    assert running[0].returncode == PREEMPTED  # SIGTERM, once the chief had finished


@pytest.mark.parametrize("lead_code, grace_s", [(0, processes.FINISH_GRACE_S),
                                                (LOST, processes.STOP_GRACE_S)])
def test_after_a_finished_lead_the_others_have_minutes_to_end_by_themselves(monkeypatch,
                                                                            lead_code, grace_s):
    """A MultiWorkerMirrored worker exports its copy as the lead did: on a loaded machine
    it was still exporting 15 s after the lead had exited, and was stopped before its
    last lines. Only a task told to stop has STOP_GRACE_S to save and go."""
    seen = []
    worker0, worker1 = FakeTask("worker:0", [lead_code], seen), FakeTask("worker:1", [0], seen)
    monkeypatch.setattr(local, "start_tasks", lambda args, train_args: ([worker0, worker1], None))
    args, _ = local.parse_args(["--workers", "2", "--ps", "0", "--workdir", "unused"])
    assert local.run_cluster(args, []) == (lead_code, False)
    assert worker1.graces == [grace_s]
    # Under --restart task too, once the chief has finished.
    chief, ps = FakeTask("chief:0", [0], seen), FakeTask("ps:0", [None], seen)
    assert processes.restart_alone([ps, chief], chief, 3, threading.Event()) == 0
    assert ps.graces == [processes.FINISH_GRACE_S]


def test_restart_alone_does_not_retry_a_configuration_error():
    seen = []
    worker, chief = FakeTask("worker:0", [2], seen), FakeTask("chief:0", [None], seen)
    assert processes.restart_alone([worker, chief], chief, 5, threading.Event()) == 2
    assert seen == ["worker:0", "chief:0"] and chief.returncode == PREEMPTED  # stopped


def test_a_chief_refusing_a_finished_workdir_stops_every_task_with_its_reason(tmp_path):
    """The chief exits 2 before training; the ps and the worker, told by it, stop with
    its code and say why, instead of waiting or claiming a backup."""
    workdir = tmp_path / "done"
    workdir.mkdir()
    (workdir / "metrics.json").write_text("{}")
    # `--workdir=DIR`: the launcher used to miss that spelling and add a fresh workdir
    # of its own after it, which the tasks then took.
    launcher = launching.launch("--workers", "1", "--ps", "1", "--set", "task.model=mlp",
                                f"--workdir={workdir}")
    output, _ = launcher.communicate(timeout=300)
    assert launcher.returncode == 2, output[-3000:]
    assert f"--workdir {workdir} already holds a finished run" in output
    for task in ("ps:0", "worker:0"):
        assert (f"failed with exit code 2: --workdir {workdir} already holds a finished run "
                f"(metrics.json); choose a new --workdir; {task} stops with the same code"
                ) in output, output[-3000:]
        assert f"[launch] {task} exited with 2" in output
    assert "resume from the chief's backup" not in output


def test_every_port_handed_to_a_task_is_held_until_the_launcher_exits(monkeypatch):
    # A task's server binds its port seconds after the pick, and a task relaunched
    # alone binds it again: in between nothing else may take it (launch/ports.py).
    given = set()

    class Started:  # stands for a task's process: records its cluster, starts nothing
        def __init__(self, job, index, spec, args, hear=None):
            given.update(a for addresses in spec.values() for a in addresses)
            given.update(f"localhost:{args[i + 1]}" for i, flag in enumerate(args)
                         if flag == "--port")

    def run_cluster(args, train_args):
        local.start_tasks(args, train_args)
        assert len(given) == 7  # chief, 2 workers, ps, evaluator; dispatcher, tf.data worker
        for address in given:
            with pytest.raises(OSError, match="Address already in use"):
                plain_bind(int(address.rpartition(":")[2]))
        return 0, False

    monkeypatch.setattr(local, "Process", Started)
    monkeypatch.setattr(local, "DataProcess", Started)
    monkeypatch.setattr(local, "run_cluster", run_cluster)
    assert local.main(["--workers", "2", "--ps", "1", "--evaluator", "--data-workers", "1",
                       "--workdir", "unused"]) == 0
    for address in given:  # released with the launcher
        plain_bind(int(address.rpartition(":")[2])).close()
