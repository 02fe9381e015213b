"""What one epoch sees when a task dies mid-epoch, with the tf.data service and without.

Each case is one `launch.local` run of the numbered task (tests/numbered.py):
one epoch of 16,384 numbered examples, batches of 16, a task SIGKILLed once the
chief (or worker 0) has logged step 200. metrics.json counts how many of the
epoch's examples were trained on 0, 1 and 2+ times, and how many examples of the
next epoch were read early. Parameter servers relaunch the dead task alone
(`--restart task`); MultiWorkerMirrored relaunches the job (`--restart job
--max-restarts 1`); a restarted chief or job resumes from its step-level backup,
saved every 50 steps; tf.data service tasks are relaunched alone under both.

    python examples/visitation.py                   # every case, ~15 min on 2 cores
    python examples/visitation.py --out docs/visitation.json
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

EXAMPLES, BATCH, KILL_AT = 16384, 16, 200
CLUSTERS = {
    "parameter servers": ["--workers", "2", "--ps", "1", "--restart", "task",
                          "--set", "checkpoint.every_steps=50"],
    "MultiWorkerMirrored": ["--workers", "2", "--ps", "0", "--restart", "job",
                            "--max-restarts", "1", "--set", "checkpoint.every_steps=50"],
}
# (what dies, its task, whether the case needs the service)
FAILURES = [("nothing", None, False), ("a trainer", "worker:1", False),
            ("the chief (resumes from its backup)", "chief:0", False),
            ("a tf.data worker", "data_worker:0", True),
            ("the dispatcher (restarted on its work_dir)", "dispatcher:0", True)]


def run(cluster: str, victim: str | None, service: bool, workdir: pathlib.Path) -> dict:
    args = [*CLUSTERS[cluster], "--workdir", str(workdir),
            "--set", "task.name=tests.numbered:Numbered", "--set", f"task.examples={EXAMPLES}",
            "--set", "train.epochs=1", "--set", f"train.global_batch_size={BATCH}",
            "--set", "train.verbose=0", "--set", "debug.log_every_steps=50"]
    args += ["--data-workers", "2"] if service else []
    launcher = launching.launch(*args)
    reporter = "chief:0" if "--ps" in args and args[args.index("--ps") + 1] != "0" else "worker:0"
    if victim:
        output, killed = launching.signal_at_step(launcher, reporter, KILL_AT, victim)
    else:
        output, killed = launcher.stdout.read(), False
    launcher.wait(timeout=120)
    (workdir.parent / f"{workdir.name}.log").write_text(output)
    if launcher.returncode:
        return {"exit_code": launcher.returncode}
    metrics = json.loads((workdir / "metrics.json").read_text())
    return {"signal_sent": killed, "steps": metrics["steps"],
            **{k: v for k, v in metrics.items() if k.startswith("visits_")}}


def table(rows: list[dict]) -> str:
    """The rows as docs/data_service.md shows them."""
    lines = ["| cluster | SIGKILLed | tf.data service | seen 0 times | once | 2+ times | "
             "read from the next epoch |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        counts = ([f"{row[k]:,}" for k in ("visits_0", "visits_1", "visits_2plus",
                                           "visits_later")]
                  if "visits_0" in row else [f"exit {row['exit_code']}", "", "", ""])
        lines.append(f"| {row['cluster']} | {row['killed']} | "
                     f"{'on' if row['service'] else 'off'} | {' | '.join(counts)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/visitation.json")
    parser.add_argument("--table", metavar="JSON", help="print the table of an earlier run")
    args = parser.parse_args(argv)
    if args.table:
        print(table(json.loads(pathlib.Path(args.table).read_text())["rows"]))
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cluster in CLUSTERS:
            for failure, victim, needs_service in FAILURES:
                if victim == "chief:0" and cluster != "parameter servers":
                    continue  # MultiWorkerMirrored has no chief: a trainer's row says it
                for service in ((True,) if needs_service else (False, True)):
                    workdir = pathlib.Path(tmp) / f"run{len(rows)}"
                    row = {"cluster": cluster, "killed": failure, "service": service,
                           **run(cluster, victim, service, workdir)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python examples/visitation.py " + " ".join(
        argv if argv is not None else sys.argv[1:]), "date": datetime.date.today().isoformat(),
        "examples": EXAMPLES, "batch": BATCH, "kill_at_step": KILL_AT, "rows": rows},
        indent=1) + "\n")
    print(table(rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
