"""`python -m app.bench`: training throughput of each strategy, side by side.

Each row is a real `python -m app.train` run in its own process (logical CPU
devices and thread pools are fixed when TensorFlow starts), or for the
parameter-server rows a real cluster of processes from `launch.local`, on the same model,
synthetic data and global batch. Rows are interleaved over the repeats, so a
machine that slows down mid-benchmark slows every row alike; each row reports
its median steady-state examples/s and its ratio to the baseline row measured
in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

from app import config as cfg

_TRAIN = ["-m", "app.train"]
_PS = ["-m", "launch.local", "--workers", "2", "--ps", "2"]  # one process per task
# row -> the module to run and its extra arguments (launch.local passes them to app.train)
ROWS: dict[str, list[str]] = {
    "baseline": [*_TRAIN, "--strategy", "default"],  # plain single-process fit
    "mirrored_1dev": [*_TRAIN, "--strategy", "mirrored"],
    "mirrored_2cpu": [*_TRAIN, "--strategy", "mirrored", "--set", "runtime.cpu_devices=2"],
    "ps_2w2p": _PS,
    # Each scheduled function runs several steps: fewer chief -> worker round trips.
    "ps_2w2p_spe8": [*_PS, "--set", "train.steps_per_execution=8"],
    "mwms_2w": ["-m", "launch.local", "--workers", "2", "--ps", "0"],  # synchronous all-reduce
}
BASELINE = next(iter(ROWS))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m app.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/mnist.toml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", default=",".join(ROWS),
                        help="comma-separated subset of: " + ", ".join(ROWS))
    parser.add_argument("--workdir", type=pathlib.Path, default=pathlib.Path("runs/bench"))
    return parser.parse_args(argv)


def train_args(config_path: str, overrides: list[str], steps: int) -> list[str]:
    """app.train arguments for a run of exactly `steps` steps of pure training."""
    batch = cfg.load(config_path, overrides).train.global_batch_size
    fixed = ["data.name=synthetic", f"data.train_examples={steps * batch}",
             "data.validation_examples=0", f"data.test_examples={batch}", "train.epochs=1",
             "eval.test_every_epoch=false", "train.verbose=0"]
    args = ["--config", config_path]
    for item in overrides + fixed:
        args += ["--set", item]
    return args


def measure(args: list[str], workdir: pathlib.Path) -> dict:
    """Run `python <args>` (app.train or a launcher) once and return its metrics.json."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    result = subprocess.run([sys.executable, *args, "--workdir", str(workdir)],
                            env=env, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"benchmark run failed: {' '.join(args)}\n{result.stderr[-3000:]}")
    return json.loads((workdir / "metrics.json").read_text())


def run(rows: list[str], base_args: list[str], repeats: int) -> dict[str, dict]:
    samples: dict[str, list[float]] = {row: [] for row in rows}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(repeats):
            for i, row in enumerate(rows):
                metrics = measure(ROWS[row] + base_args, pathlib.Path(tmp) / f"{r}-{i}")
                samples[row].append(metrics["train_examples_per_sec"])
                print(f"  repeat {r + 1}/{repeats} {row}: "
                      f"{metrics['train_examples_per_sec']:.0f} examples/s", file=sys.stderr)
    medians = {row: statistics.median(s) for row, s in samples.items()}
    base = medians[rows[0]]
    return {row: {"examples_per_sec": medians[row], "samples": s,
                  "ratio": round(medians[row] / base, 3)} for row, s in samples.items()}


def table(results: dict[str, dict]) -> str:
    width = max(len(row) for row in results)
    lines = [f"{'row':<{width}}  examples/s  ratio", f"{'-' * width}  ----------  -----"]
    lines += [f"{row:<{width}}  {r['examples_per_sec']:>10.0f}  {r['ratio']:>5.3f}"
              for row, r in results.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = [row.strip() for row in args.rows.split(",")]
    unknown = [row for row in rows if row not in ROWS]
    if unknown:
        print(f"error: --rows: unknown row(s) {unknown}; rows are {list(ROWS)}", file=sys.stderr)
        return 2
    if rows[0] != BASELINE:
        rows.insert(0, BASELINE)  # every ratio is against a baseline from the same run
    try:
        base_args = train_args(args.config, args.set, args.steps)
    except cfg.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = run(rows, base_args, args.repeats)
    args.workdir.mkdir(parents=True, exist_ok=True)
    report = {"command": " ".join(["python -m app.bench", *(argv or sys.argv[1:])]),
              "steps": args.steps, "repeats": args.repeats, "rows": results}
    (args.workdir / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
