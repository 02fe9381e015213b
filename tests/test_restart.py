"""Restart after failure in a parameter-server cluster, end to end with
`launch.local --max-restarts 1` (the whole job relaunched): a sync-mode chief is
SIGKILLed at a step it reports in the second epoch; the relaunched job resumes
from the sync backup and finishes as a clean run would, step for step. The
async chief, a ps and a worker, each relaunched alone (`--restart task`), with
the same checks: tests/test_restart_task.py, which shares SMALL and STEPS."""

import json

import pytest

from tests import launching

pytestmark = pytest.mark.slow

STEPS = 3000 // 32  # per epoch
SMALL = ["--set", "task.train_examples=3000", "--set", "task.validation_examples=0",
         "--set", "task.test_examples=300", "--set", "train.epochs=2",
         "--set", "eval.test_every_epoch=false", "--set", "train.verbose=2",
         "--set", "debug.log_every_steps=1"]


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
