"""Restart after failure in a parameter-server cluster, end to end with
`launch.local --max-restarts 1`: the chief is SIGKILLed at a step it reports in
the second epoch; the relaunched job resumes from the last backup and finishes
as a clean run would, step for step. A killed ps, and each task relaunched
alone (`--restart task`): tests/test_restart_task.py."""

import json

import pytest

from tests import launching

pytestmark = pytest.mark.slow

STEPS = 3000 // 32  # per epoch
SMALL = ["--set", "task.train_examples=3000", "--set", "task.validation_examples=0",
         "--set", "task.test_examples=300", "--set", "train.epochs=2",
         "--set", "eval.test_every_epoch=false", "--set", "train.verbose=2",
         "--set", "debug.log_every_steps=1"]


def run_and_kill(tmp_path, victim: str, at_step: int, *args: str) -> tuple[str, dict]:
    """Run a chief + 1 worker + 2 ps job; SIGKILL `victim` once the chief reports `at_step`."""
    launcher = launching.launch("--workers", "1", "--ps", "2", "--max-restarts", "1", *SMALL,
                                *args, "--workdir", str(tmp_path / "run"))
    output, killed = launching.signal_at_step(launcher, "chief:0", at_step, victim)
    launcher.wait(timeout=60)
    assert killed and launcher.returncode == 0, output[-4000:]
    return output, json.loads((tmp_path / "run" / "metrics.json").read_text())


def check_resumed_in_epoch_2(output: str, metrics: dict) -> str:
    """The relaunch's output, once checked: epoch 1 not redone, every step run once."""
    after = output[output.index("[launch] restart 1 of 1"):]
    assert "[chief:0] Epoch 1/2" not in after  # the completed epoch is not redone
    assert "[chief:0] Epoch 2/2" in after
    assert metrics["epochs_completed"] == 2
    assert metrics["steps"] == 2 * STEPS  # as in a clean run: every step once
    assert [row["epoch"] for row in metrics["history"]] == [1, 2]  # the first run's too
    return after


def test_a_killed_chief_resumes_within_every_steps_of_where_it_died(tmp_path):
    killed_at = STEPS + 45
    # The MLP: a backup every 10 steps of the CNN and its Adam slots (40 MB) is slow here.
    output, metrics = run_and_kill(tmp_path, "chief:0", killed_at,
                                   "--set", "checkpoint.every_steps=10", "--set", "task.model=mlp")
    assert "[launch] chief:0 exited with -9" in output
    after = check_resumed_in_epoch_2(output, metrics)
    # Backups every 10 steps of the epoch: the relaunch goes on from the last one.
    resumed_from = launching.steps_reported(after, "chief:0")[0] - 1
    assert killed_at - 10 <= resumed_from and (resumed_from - STEPS) % 10 == 0, resumed_from
    assert metrics["test_accuracy"] > 0.5  # it learned the real MNIST digits


def test_a_killed_sync_chief_resumes_in_its_epoch(tmp_path):
    # ps.mode = sync, 2 workers, one update waiting for the first worker's gradient.
    steps = 2000 // 128
    launcher = launching.launch(
        "--workers", "2", "--ps", "1", "--max-restarts", "1",
        "--config", "configs/mnist_sync_ps.toml", *SMALL, "--set", "task.train_examples=2000",
        "--set", "task.model=mlp",
        "--workdir", str(tmp_path / "run"))
    output, killed = launching.signal_at_step(launcher, "chief:0", steps + 5, "chief:0")
    launcher.wait(timeout=60)
    assert killed and launcher.returncode == 0, output[-4000:]
    after = output[output.index("[launch] restart 1 of 1"):]
    assert "[chief:0] Epoch 1/2" not in after and "[chief:0] Epoch 2/2" in after
    assert launching.steps_reported(after, "chief:0")[0] == steps + 1  # the epoch's backup
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["mode"] == "sync" and metrics["steps"] == 2 * steps
    assert [row["epoch"] for row in metrics["history"]] == [1, 2]
