"""`launch.local --restart task`, end to end: one task of a chief + 1 worker + 2 ps
job is SIGKILLed in the second epoch and relaunched alone, with its TF_CONFIG
and port, as Kubernetes restarts one pod; the others keep running. Each job
finishes with every step of a clean run done once and no epoch redone."""

import json
import re

import pytest

from app.cluster.tf_config import TaskLost
from tests import launching
from tests.test_restart import SMALL, STEPS

pytestmark = pytest.mark.slow


def run_and_kill(tmp_path, victim: str, at_step: int, *args: str) -> tuple[str, dict]:
    """SIGKILL `victim` once the chief reports `at_step`; --restart task lets each task
    be relaunched 3 times unless `args` say otherwise.

    The chief holds there until the victim is dead (`launching.hold`): in CI a loaded
    test once read "step 113" after the worker had run every step, and the ps it
    killed was needed no more."""
    release = tmp_path / "release"
    launcher = launching.launch("--workers", "1", "--ps", "2", "--restart", "task", *SMALL,
                                "--set", "task.model=mlp", *launching.hold(at_step, release),
                                *args,
                                "--workdir", str(tmp_path / "run"))
    output, killed = launching.signal_at_step(launcher, "chief:0", at_step, victim,
                                              release=release)
    launcher.wait(timeout=60)
    assert killed and launcher.returncode == 0, output[-4000:]
    # The signal ended the task it was sent to, while it ran.
    assert f"[launch] {victim} exited with -9" in output, output[-4000:]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["epochs_completed"] == 2
    assert [row["epoch"] for row in metrics["history"]] == [1, 2]  # no epoch trained twice
    assert metrics["test_accuracy"] > 0.5  # it learned the real MNIST digits
    # Every task that was not relaunched ran once, to the end, and was told the chief
    # had finished (exit 0, not the 203 of a chief that never came back).
    for task in ("chief:0", "worker:0", "ps:0", "ps:1"):
        assert f"[launch] {task} exited with 0" in output, task
    return output, metrics


def said(output: str) -> str:
    """What the launcher and the tasks said of how each task ended: an assertion's message
    (the tail of the output shows only the restarted chief's last epoch)."""
    return "".join(line for line in output.splitlines(keepends=True)
                   if line.startswith("[launch]") or "error:" in line or " ERROR " in line)[-6000:]


def started(output: str, task: str) -> int:
    return len(re.findall(rf"\[launch\] {task} started, pid", output))


def test_a_killed_chief_is_restarted_alone_and_resumes_on_the_live_servers(tmp_path):
    killed_at = STEPS + 45
    output, metrics = run_and_kill(tmp_path, "chief:0", killed_at,
                                   "--set", "checkpoint.every_steps=10")
    assert "[launch] restart 1 of 3: chief:0 alone" in output
    assert [started(output, t) for t in ("chief:0", "worker:0", "ps:0", "ps:1")] == [2, 1, 1, 1]
    # The servers waited for the chief instead of exiting, and served it again.
    for task in ("worker:0", "ps:0", "ps:1"):
        after = output[output.index(f"[{task}] INFO the chief left without finishing"):]
        assert f"[{task}] INFO the chief is up" in after, task
    after = output[output.index("[launch] restart 1 of 3"):]
    assert "[chief:0] Epoch 1/2" not in after
    resumed_from = launching.steps_reported(after, "chief:0")[0] - 1
    assert killed_at - 10 <= resumed_from and (resumed_from - STEPS) % 10 == 0, resumed_from
    assert metrics["steps"] == 2 * STEPS  # as in a clean run: every step once


def test_a_killed_ps_is_restarted_alone_and_the_chief_restarts_from_the_backup(tmp_path):
    # The ps's variables die with it: the chief fails fast (TaskLost, naming the ps) and
    # is restarted too.
    # One restart per task is enough: the ps and the chief each need one.
    output, metrics = run_and_kill(tmp_path, "ps:1", STEPS + 20, "--max-restarts", "1")
    # Unreachable, or, if its relaunch came up before a step reached it, restarted.
    lost = (r"error: parameter server ps:1 \(localhost:\d+\) (became unreachable|failed or "
            r"was restarted: its variables are gone); training stopped")
    assert re.search(lost, output), said(output)
    assert f"[launch] chief:0 exited with {TaskLost.exit_code}" in output
    restarted = re.findall(r"\[launch\] restart 1 of 1: (\S+) alone", output)
    assert sorted(restarted) == ["chief:0", "ps:1"], restarted
    assert [started(output, t) for t in ("worker:0", "ps:0")] == [1, 1]
    after = output[output.index("[launch] restart 1 of 1: chief:0"):]
    assert "[chief:0] Epoch 1/2" not in after
    # checkpoint.every_steps = 0: the epoch is redone from its start, from the backup.
    assert launching.steps_reported(after, "chief:0")[0] == STEPS + 1
    assert metrics["steps"] == 2 * STEPS
    # The same sharding after the restart: the placement report is logged again, unchanged.
    reports = re.findall(r"\[chief:0\] INFO   ps:(\d)\s+(\S+ \S+)", output)
    assert len(reports) == 4 and reports[:2] == reports[2:], reports


def test_a_killed_worker_is_restarted_alone_and_the_coordinator_takes_it_back(tmp_path):
    # The only worker: the run can finish only if the restarted one is used again.
    output, metrics = run_and_kill(tmp_path, "worker:0", STEPS + 20)
    assert "[launch] restart 1 of 3: worker:0 alone" in output
    assert [started(output, t) for t in ("chief:0", "ps:0", "ps:1")] == [1, 1, 1]
    assert "[chief:0] Epoch 2/2" in output and output.count("[chief:0] Epoch 1/2") == 1
    # A step the worker had applied when it died may be run again by the coordinator.
    assert metrics["steps"] >= 2 * STEPS, metrics["steps"]
