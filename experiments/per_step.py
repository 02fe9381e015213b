"""What one more training step costs each task: CPU seconds and, over links, bytes.

`tools.bench` reports a row's CPU seconds and link bytes over its whole run, which
includes starting TensorFlow, tracing, evaluation and the export. This runs the
bench twice on the same rows, `--steps A,B`, and divides the difference of each
row's figures by B - A: what the two runs share cancels out, and what is left is
the cost of a step in steady state, counted rather than predicted.

    python experiments/per_step.py --rows baseline,ps_2w2p,ps_2w2p_spe8,ps_2w2p_spe8_once \
        --steps 100,300 --link 10gbit --out docs/results/per_step_b32.json

--config, --set, --rows, --repeats and --link go to `tools.bench` as they are. With
--link (root: launch.local runs the cluster in a network namespace) each task's link
counts the bytes into and out of it; a rate far above what the cores can move keeps
the link from setting the pace.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from tools import bench, bench_report  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python experiments/per_step.py",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--steps", required=True, metavar="A,B",
                        help="the two runs' training steps, A < B")
    # What tools.bench takes, passed on to it.
    parser.add_argument("--config", default="configs/mnist.toml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rows", required=True, help="tools.bench's rows, comma-separated")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--link", metavar="RATE[,DELAY]", help="as tools.bench --link")
    parser.add_argument("--workdir", type=pathlib.Path, default=pathlib.Path("runs/per_step"))
    parser.add_argument("--out", type=pathlib.Path, help="the JSON record to write")
    args = parser.parse_args(argv)
    try:
        args.short, args.long = (int(s) for s in args.steps.split(","))
    except ValueError:
        parser.error(f"--steps {args.steps}: give two step counts, e.g. --steps 100,300")
    if not 0 < args.short < args.long:
        parser.error(f"--steps {args.steps}: the first must be less than the second, both > 0")
    return args


def bench_args(args: argparse.Namespace) -> list[str]:
    """The tools.bench arguments both runs share."""
    return ["--config", args.config, *(a for item in args.set for a in ("--set", item)),
            "--rows", args.rows, "--repeats", str(args.repeats),
            *(["--link", args.link] if args.link else [])]


def per_step(short: dict, long: dict, steps: int) -> dict:
    """One row's CPU ms and link KiB of a step, by task type, from its two runs."""
    out = {"cpu_ms_per_step": {
        task: round((long["cpu_seconds"][task] - short["cpu_seconds"].get(task, 0)) * 1000
                    / steps, 2)
        for task in long["cpu_seconds"]}}
    out["cpu_ms_per_step_in_all"] = round(sum(out["cpu_ms_per_step"].values()), 2)
    if "link_mib" in long:
        # [KiB into the task's link, KiB out of it] a step, for each task
        out["link_kib_per_step"] = {
            task: [round((long["link_mib"][task][i] - short["link_mib"][task][i]) * 1024
                         / steps, 1) for i in (0, 1)]
            for task in long["link_mib"]}
        out["link_kib_per_step_out_of_every_task"] = round(
            sum(into_out[1] for into_out in out["link_kib_per_step"].values()), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reports = []
    for steps in (args.short, args.long):
        workdir = args.workdir / f"steps{steps}"
        code = bench.main([*bench_args(args), "--steps", str(steps), "--workdir", str(workdir)])
        if code:
            return code
        reports.append(json.loads((workdir / "bench.json").read_text()))
    short, long = reports
    rows = {name: {"what": row["what"], **per_step(short["rows"][name], row,
                                                   args.long - args.short),
                   "examples_per_sec": [short["rows"][name]["examples_per_sec"],
                                        row["examples_per_sec"]]}
            for name, row in long["rows"].items() if name in short["rows"]}
    command = " ".join(["python experiments/per_step.py",
                        *(sys.argv[1:] if argv is None else argv)])
    record = {"command": command, "machine": long["machine"],
              "date": datetime.date.today().isoformat(),
              "load_average": [short["load_average_before"], long["load_average_after"]],
              "steps": [args.short, args.long], "rows": rows}
    bench_report.emit(record, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
