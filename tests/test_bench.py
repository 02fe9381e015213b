import json

import pytest

from app import bench


def test_runs_are_pure_training_of_the_asked_steps():
    args = bench.train_args("configs/mnist.toml", ["train.global_batch_size=64"], steps=10)
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    assert "data.train_examples=640" in sets and "data.validation_examples=0" in sets
    assert "eval.test_every_epoch=false" in sets and "train.epochs=1" in sets


def test_unknown_row_is_an_error(capsys):
    assert bench.main(["--rows", "tpu pod"]) == 2
    assert "error: --rows: unknown row(s) ['tpu pod']" in capsys.readouterr().err


@pytest.mark.slow
def test_smoke_writes_a_report_with_ratios(tmp_path):
    code = bench.main(["--steps", "30", "--repeats", "1", "--rows", "mirrored_1dev",
                       "--set", "train.global_batch_size=32", "--workdir", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    rows = report["rows"]
    assert list(rows) == [bench.BASELINE, "mirrored_1dev"]  # baseline added first
    assert rows[bench.BASELINE]["ratio"] == 1.0
    assert all(r["examples_per_sec"] > 0 and len(r["samples"]) == 1 for r in rows.values())
