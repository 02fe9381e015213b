"""Does a tf.data worker's death cost accuracy? MNIST under parameter servers, through
the tf.data service, clean and with a tf.data worker SIGKILLed mid-run.

Both runs: `launch.local --workers 2 --ps 1 --data-workers 2 --restart task
--config configs/mnist_ps.toml` (3 epochs of the CNN); in the second,
data_worker:0 is SIGKILLed once the chief has logged step KILL_AT, and
relaunched alone. Test accuracy of each, from metrics.json.

    python experiments/data_worker_failure.py --out docs/results/data_service_accuracy.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tests import launching  # noqa: E402

KILL_AT = 2000  # in the second of three epochs of 1,718 steps


def run(workdir: pathlib.Path, victim: str | None) -> dict:
    launcher = launching.launch(
        "--workers", "2", "--ps", "1", "--data-workers", "2", "--restart", "task",
        "--config", "configs/mnist_ps.toml", "--workdir", str(workdir),
        "--set", "train.verbose=0", "--set", "debug.log_every_steps=100")
    if victim:
        output, killed = launching.signal_at_step(launcher, "chief:0", KILL_AT, victim)
    else:
        output, killed = launcher.stdout.read(), False
    launcher.wait(timeout=120)
    (workdir.parent / f"{workdir.name}.log").write_text(output)
    assert launcher.returncode == 0, output[-3000:]
    metrics = json.loads((workdir / "metrics.json").read_text())
    return {"killed": victim, "signal_sent": killed,
            "relaunched": f"[launch] restart 1 of 3: {victim} alone" in output if victim else None,
            **{k: metrics[k] for k in ("test_accuracy", "steps", "wall_seconds")}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/data_service_accuracy.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run(pathlib.Path(tmp) / name, victim)
                for name, victim in (("clean", None), ("killed", "data_worker:0"))]
    for row in rows:
        print(json.dumps(row), flush=True)
    difference = round(100 * (rows[1]["test_accuracy"] - rows[0]["test_accuracy"]), 2)
    print(f"test accuracy, killed minus clean: {difference:+} points")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": "python experiments/data_worker_failure.py " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "date": datetime.date.today().isoformat(), "kill_at_step": KILL_AT, "rows": rows,
        "difference_points": difference}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
