"""Restart after failure in a parameter-server cluster, end to end with
`launch.local --max-restarts 1`: the chief or a ps is SIGKILLed in the second
epoch; the relaunched job resumes after the first and finishes as a clean run."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.launching import kill_on_line

pytestmark = pytest.mark.slow

SMALL = ["--set", "task.train_examples=3000", "--set", "task.validation_examples=0",
         "--set", "task.test_examples=300", "--set", "train.epochs=2",
         "--set", "eval.test_every_epoch=false", "--set", "train.verbose=2"]


def run_and_kill(tmp_path, victim: str) -> tuple[str, dict]:
    """Run a chief + 1 worker + 2 ps job, SIGKILL `victim` as epoch 2 begins."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    launcher = subprocess.Popen(
        [sys.executable, "-u", "-m", "launch.local", "--workers", "1", "--ps", "2",
         "--max-restarts", "1", *SMALL, "--workdir", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    # Killed as epoch 2 begins: epoch 1 is in the backup.
    output, killed = kill_on_line(launcher, "[chief:0] Epoch 2/2", victim)
    launcher.wait(timeout=60)
    assert killed and launcher.returncode == 0, output[-4000:]
    return output, json.loads((tmp_path / "run" / "metrics.json").read_text())


def check_resumed(output: str, metrics: dict) -> None:
    after = output[output.index("[launch] restart 1 of 1"):]
    assert "[chief:0] Epoch 1/2" not in after  # the completed epoch is not redone
    assert "[chief:0] Epoch 2/2" in after
    assert metrics["epochs_completed"] == 2
    assert metrics["steps"] == 2 * (3000 // 32)  # as in a clean run: every step once
    assert metrics["test_accuracy"] > 0.5  # it learned the real MNIST digits


def test_a_killed_chief_is_relaunched_and_resumes(tmp_path):
    output, metrics = run_and_kill(tmp_path, "chief:0")
    assert "[launch] chief:0 exited with -9" in output
    check_resumed(output, metrics)


def test_a_killed_ps_fails_the_chief_fast_and_the_relaunch_resumes(tmp_path):
    output, metrics = run_and_kill(tmp_path, "ps:1")
    before = output[:output.index("[launch] restart 1 of 1")]
    assert re.search(r"error: parameter server ps:1 \(localhost:\d+\) became unreachable",
                     before), before[-3000:]
    assert "[launch] chief:0 exited with 3" in before
    check_resumed(output, metrics)
    # The same sharding after the restart: the placement report is logged again, unchanged.
    reports = re.findall(r"\[chief:0\] INFO   ps:(\d)\s+(\S+ \S+)", output)
    assert len(reports) == 4 and reports[:2] == reports[2:], reports
