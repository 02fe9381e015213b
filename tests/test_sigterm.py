"""Preemption end to end: SIGTERM to a training task saves a backup at the next
step boundary and exits with 204 (app.cluster.preemption.EXIT_CODE); the job launched
again goes on from there.
SIGTERM to the launcher reaches every task."""

import json
import re
import signal

import pytest

from app.cluster.preemption import EXIT_CODE
from app.state import workdir
from tests import launching

pytestmark = pytest.mark.slow

PREEMPTED = f"exited with {EXIT_CODE} (preempted, backup saved)"


def test_sigterm_to_the_chief_saves_exits_204_and_the_rerun_resumes(tmp_path):
    steps = 2000 // 32
    args = ["--workers", "1", "--ps", "1", "--set", "task.train_examples=2000",
            "--set", "task.validation_examples=0", "--set", "task.test_examples=200",
            "--set", "train.epochs=2", "--set", "eval.test_every_epoch=false",
            "--set", "train.verbose=2", "--set", "debug.log_every_steps=1",
            "--set", "task.model=mlp", "--workdir", str(tmp_path / "run")]
    launcher = launching.launch(*args)  # no --max-restarts: the launcher exits with 204
    signalled_at = steps // 2
    output, sent = launching.signal_at_step(launcher, "chief:0", signalled_at, "chief:0",
                                            signal.SIGTERM)
    assert sent and launcher.wait(timeout=60) == EXIT_CODE, output[-4000:]
    assert f"[launch] chief:0 {PREEMPTED}" in output
    assert f"backup saved in {tmp_path / 'run' / 'backup'}" in output
    assert workdir.has_backup(tmp_path / "run")
    # The ps and the worker outlived SIGTERM until the chief had saved, then left with
    # the chief's code: a scheduler restarts them with it (exit 0 would end their pods).
    assert f"[launch] ps:0 {PREEMPTED}" in output
    assert f"[launch] worker:0 {PREEMPTED}" in output

    again = launching.launch(*args)
    rerun, _ = again.communicate(timeout=600)
    assert again.returncode == 0, rerun[-4000:]
    resumed_from = launching.steps_reported(rerun, "chief:0")[0] - 1
    assert signalled_at <= resumed_from < steps, resumed_from  # mid-epoch, nothing lost
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 2 * steps
    assert [row["epoch"] for row in metrics["history"]] == [1, 2]


def two_workers(tmp_path, keras="tf_keras", hold_at=0):
    """Two MultiWorkerMirrored workers on the MLP in `keras` (task.keras), 3 epochs of
    31 steps, --max-restarts 1; held at step `hold_at` until tmp_path/"release" exists
    (none on a relaunch: the file is there by then)."""
    return launching.launch(
        "--workers", "2", "--ps", "0", "--max-restarts", "1", "--set", f"task.keras={keras}",
        "--set", "task.train_examples=1500", "--set", "task.validation_examples=500",
        "--set", "task.test_examples=101", "--set", "train.epochs=3",
        "--set", "train.verbose=2", "--set", "debug.log_every_steps=1",
        "--set", "task.model=mlp", "--workdir", str(tmp_path / "run"),
        *(launching.hold(hold_at, tmp_path / "release") if hold_at else ()))


@pytest.mark.parametrize("keras", ["tf_keras", "keras"])
def test_sigterm_to_one_multi_worker_mirrored_worker_stops_both_at_one_step(keras, tmp_path):
    steps = 1000 // 32  # 1500 examples less 500 for validation
    signalled_at = steps + 5
    # Held 5 steps on until worker 1 has seen the signal: the run cannot end first.
    launcher = two_workers(tmp_path, keras, hold_at=signalled_at + 5)
    output, sent = launching.signal_at_step(launcher, "worker:0", signalled_at, "worker:1",
                                            signal.SIGTERM, release=tmp_path / "release",
                                            released_by=launching.sigterm_seen("worker:1"))
    assert sent and launcher.wait(timeout=60) == 0, output[-4000:]
    before, after = output.split("[launch] restart 1 of 1")
    # Told through the coordination service, worker 0 saved at the same step and left too.
    assert f"[launch] worker:0 {PREEMPTED}" in before, before[-4000:]
    assert f"[launch] worker:1 {PREEMPTED}" in before
    resumed_from = launching.steps_reported(after, "worker:0")[0] - 1
    assert launching.steps_reported(after, "worker:1")[0] - 1 == resumed_from
    # The workers agree on the step through the coordination service, whose watcher
    # polls the signal once a second (TF 2.21 failure_handling): the MLP runs tens of
    # steps in that time, so the step agreed on may be a later epoch's (seen: 63, 64).
    assert signalled_at <= resumed_from < 3 * steps, resumed_from
    assert "[worker:0] Epoch 1/3" not in after
    digests = dict(re.findall(r"\[(worker:\d)\] INFO weights sha256 (\w+)", after))
    assert "[launch] worker:1 exited with 0" in after, after[-4000:]
    assert len(digests) == 2 and len(set(digests.values())) == 1, digests  # identical weights
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["steps"] == 3 * steps
    assert [row["epoch"] for row in metrics["history"]] == [1, 2, 3]


def test_sigterm_to_the_launcher_preempts_every_task_and_relaunches_nothing(tmp_path):
    launcher = two_workers(tmp_path, hold_at=10)  # until a worker has seen the signal
    output, sent = launching.signal_at_step(launcher, "worker:0", 5, "launch", signal.SIGTERM,
                                            release=tmp_path / "release",
                                            released_by=launching.sigterm_seen())
    assert sent and launcher.wait(timeout=60) == EXIT_CODE, output[-4000:]
    assert "[launch] SIGTERM: passing it to every task" in output
    assert f"[launch] worker:0 {PREEMPTED}" in output, output[-4000:]
    assert f"[launch] worker:1 {PREEMPTED}" in output
    assert "restart 1 of 1" not in output  # the job was stopped, not failed
    assert workdir.has_backup(tmp_path / "run")
