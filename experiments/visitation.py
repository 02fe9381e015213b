"""What one epoch sees when a task dies mid-epoch: tables of `launch.local` runs.

Each case runs the numbered task (tests/numbered.py): one epoch of 16,384
numbered examples, batches of 16, a backup every 50 steps, a fault once the lead
task (the chief, or worker 0 without ps) has logged step 200. metrics.json counts
how many of the epoch's examples were trained on 0, 1 and 2+ times, and how many
examples of the next epoch were read early.

- The service table (the default): the task's pipeline (`Numbered`), with and
  without the tf.data service, under parameter servers (chief + 2 workers + 1 ps,
  `--restart task`) and MultiWorkerMirrored (2 workers, `--restart job
  --max-restarts 1`); one task SIGKILLed.
- The by-index table (`--by-index-table`): the pipeline and the same examples read
  by index (`IndexedNumbered`, app/indexed.py), without the service, under
  parameter servers (chief + 2 workers + 2 ps) and MultiWorkerMirrored, through
  SIGKILLs of each kind of task and SIGTERMs of the whole job (every task saves a
  backup and exits 204), the job requeued on the same or another cluster shape.
- The window (`--window N`): the by-index worker SIGKILL N times, counting how
  often the step the dead worker held runs again after its update (or part of
  it) had reached the ps: an update applied twice. With `--set
  train.steps_per_execution=K` a closure holds K steps, and runs again whole.
- The records table (`--records-table`): the by-index cases, the examples read
  from TFRecord files at their offsets (`RecordsNumbered`, `data.indexed_records`),
  as many and as large as `--examples`, `--files` and `--pad-floats` say, every
  task under `--memory-limit-gib`.

    python experiments/visitation.py --out docs/results/visitation.json         # ~15 min
    python experiments/visitation.py --window 10 --out docs/results/visitation_window.json
    python experiments/visitation.py --window 10 --set train.steps_per_execution=8 \
        --out docs/results/visitation_window_spe8.json
    python experiments/visitation.py --by-index-table --out docs/results/visitation_by_index.json
    python experiments/visitation.py --table docs/results/visitation_by_index.json  # a table
    python experiments/visitation.py --records-table --examples 195000 --files 24 \
        --pad-floats 4096 --memory-limit-gib 1.5 --kill-at-step 4000 \
        --out docs/results/visitation_records.json

(the window's runs take ~8 min, the by-index table's ~20 min).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import pathlib
import re
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from app.cluster.preemption import EXIT_CODE as PREEMPTED  # noqa: E402
from tests import launching  # noqa: E402

EXAMPLES, BATCH, KILL_AT, BACKUP_EVERY = 16384, 16, 200, 50
PIPELINE, BY_INDEX = "tests.numbered:Numbered", "tests.numbered:IndexedNumbered"
RECORDS = "tests.numbered:RecordsNumbered"
# app.train flags every run of this invocation adds (the records table's data and limit).
EXTRA: list[str] = []
# A step the coordinator runs again: the closure a failed worker held, put back in its
# queue (TF 2.21 cluster_coordinator.py logs these two lines when it does so).
PUT_BACK = re.compile(r"\[chief:0\] ERROR (Worker|Remote function on worker) /job:worker\S* "
                      r"failed with")


@dataclasses.dataclass(frozen=True)
class Case:
    """One row's cluster and fault: `victim` (a task, or "launch": the launcher, and so
    every task) gets `sig` once the lead task has logged step KILL_AT; a run that then
    exits 204 (preempted, backup saved) is requeued with `requeue`'s flags, if any."""

    cluster: str
    what: str
    flags: tuple[str, ...]
    victim: str | None = None
    sig: int = signal.SIGKILL
    requeue: tuple[str, ...] | None = None


def ps(workers: int = 2, ps_tasks: int = 2) -> tuple[str, ...]:
    return ("--workers", str(workers), "--ps", str(ps_tasks), "--restart", "task")


def mwm(workers: int = 2) -> tuple[str, ...]:
    return ("--workers", str(workers), "--ps", "0", "--restart", "job", "--max-restarts", "1")


PS, MWM = "parameter servers", "MultiWorkerMirrored"
SERVICE_CASES = [
    Case(PS, "nothing", ps(ps_tasks=1)),
    Case(PS, "a trainer", ps(ps_tasks=1), "worker:1"),
    Case(PS, "the chief (resumes from its backup)", ps(ps_tasks=1), "chief:0"),
    Case(PS, "a tf.data worker", ps(ps_tasks=1), "data_worker:0"),
    Case(PS, "the dispatcher (restarted on its work_dir)", ps(ps_tasks=1), "dispatcher:0"),
    Case(MWM, "nothing", mwm()),
    Case(MWM, "a trainer", mwm(), "worker:1"),
    Case(MWM, "a tf.data worker", mwm(), "data_worker:0"),
    Case(MWM, "the dispatcher (restarted on its work_dir)", mwm(), "dispatcher:0"),
]
WORKER_KILLED = Case(PS, "worker:1 SIGKILLed, relaunched", ps(), "worker:1")
BY_INDEX_CASES = [
    Case(PS, "nothing killed", ps()),
    WORKER_KILLED,
    Case(PS, "the chief SIGKILLed, resumed from its backup", ps(), "chief:0"),
    # The chief exits 203 (a ps lost); --restart task relaunches both, 1 of 3 restarts each.
    Case(PS, "ps:0 SIGKILLed; the chief exits 203, both relaunched", ps(), "ps:0"),
    Case(PS, "the job SIGTERMed, requeued", ps(), "launch", signal.SIGTERM, ps()),
    Case(PS, "the job SIGTERMed, resumed with 3 workers", ps(), "launch", signal.SIGTERM,
         ps(workers=3)),
    Case(PS, "the job SIGTERMed, resumed with 1 ps", ps(), "launch", signal.SIGTERM,
         ps(ps_tasks=1)),
    Case(MWM, "worker:1 SIGKILLed; the job restarts from its backup", mwm(), "worker:1"),
    # --workers 1 --ps 0 is one process, DefaultStrategy.
    Case(MWM, "the job SIGTERMed, resumed on 1 worker", mwm(), "launch", signal.SIGTERM,
         mwm(workers=1)),
]


# More `--set KEY=VALUE` overrides for every run (main's --set).
OVERRIDES: list[str] = []


def task_flags(task: str, workdir: pathlib.Path) -> list[str]:
    """app.train's flags: the numbered task's epoch, the backups, the step log, the
    records table's and OVERRIDES."""
    return [*EXTRA, "--workdir", str(workdir), "--set", f"task.name={task}",
            "--set", f"task.examples={EXAMPLES}", "--set", "train.epochs=1",
            "--set", f"train.global_batch_size={BATCH}", "--set", "train.verbose=0",
            "--set", f"checkpoint.every_steps={BACKUP_EVERY}",
            "--set", "debug.log_every_steps=50",
            *(arg for item in OVERRIDES for arg in ("--set", item))]


def lead(flags: tuple[str, ...]) -> str:
    """The task that logs the steps and whose exit is the job's."""
    return "worker:0" if flags[flags.index("--ps") + 1] == "0" else "chief:0"


def run(case: Case, task: str, workdir: pathlib.Path, service: bool = False) -> dict:
    """Run `case` (and its requeue) on `task`; the row's figures: each launch's exit code
    and seconds, the steps applied, the visit counts, the steps the coordinator ran
    again (the finishing chief's), the step a SIGTERM saved."""
    row: dict = {"exit_codes": [], "seconds": []}
    launches = [case.flags] + ([case.requeue] if case.requeue else [])
    for attempt, flags in enumerate(launches):
        start = time.monotonic()
        launcher = launching.launch(*flags, *task_flags(task, workdir),
                                    *(["--data-workers", "2"] if service else []))
        if attempt == 0 and case.victim:
            output, row["signal_sent"] = launching.signal_at_step(
                launcher, lead(flags), KILL_AT, case.victim, case.sig)
        else:
            output = launcher.stdout.read()
        launcher.wait(timeout=300 + EXAMPLES // 20)
        row["exit_codes"].append(launcher.returncode)
        row["seconds"].append(round(time.monotonic() - start))
        (workdir.parent / f"{workdir.name}.{attempt}.log").write_text(output)
        if saved := re.search(r"SIGTERM: backup of epoch \d+, step (\d+) saved", output):
            row["sigterm_saved_step"] = int(saved[1])
        if launcher.returncode != PREEMPTED:
            break
    if launcher.returncode:
        return row
    if lead(flags) == "chief:0":
        row["steps_put_back"] = len(PUT_BACK.findall(
            output[output.rfind("[launch] chief:0 started"):]))
    metrics = json.loads((workdir / "metrics.json").read_text())
    return {**row, "steps": metrics["steps"], "input": metrics["input"],
            **{k: v for k, v in metrics.items() if k.startswith("visits_")}}


def service_rows(tmp: pathlib.Path) -> list[dict]:
    """The pipeline, with and without the tf.data service (which the rows on a service
    task need)."""
    rows = []
    for case in SERVICE_CASES:
        on_service = case.victim in ("data_worker:0", "dispatcher:0")
        for service in (True,) if on_service else (False, True):
            row = {"cluster": case.cluster, "killed": case.what, "service": service,
                   **run(case, PIPELINE, tmp / f"run{len(rows)}", service)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def by_index_rows(tmp: pathlib.Path) -> list[dict]:
    """Each case read from the pipeline, then by index, without the service."""
    rows = []
    for case in BY_INDEX_CASES:
        for task in (PIPELINE, BY_INDEX):
            row = {"cluster": case.cluster, "what": case.what,
                   "flags": " ".join(case.flags),
                   "requeue_flags": " ".join(case.requeue) if case.requeue else None,
                   **run(case, task, tmp / f"run{len(rows)}")}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def records_rows(tmp: pathlib.Path) -> list[dict]:
    """Each by-index case, its examples read from TFRecord files."""
    rows = []
    for case in BY_INDEX_CASES:
        row = {"cluster": case.cluster, "what": case.what, "flags": " ".join(case.flags),
               "requeue_flags": " ".join(case.requeue) if case.requeue else None,
               **run(case, RECORDS, tmp / f"run{len(rows)}")}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def window_rows(tmp: pathlib.Path, runs: int) -> list[dict]:
    """The by-index worker:1 SIGKILL, `runs` times: how often the step the dead worker
    held is run again after (part of) its update reached the ps."""
    rows = []
    for _ in range(runs):
        row = {"what": WORKER_KILLED.what,
               **run(WORKER_KILLED, BY_INDEX, tmp / f"run{len(rows)}")}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def counts(row: dict) -> list[str]:
    if "visits_0" not in row:  # a run that failed
        codes = row.get("exit_codes") or [row["exit_code"]]
        return ["exit " + ", ".join(map(str, codes)), "", "", ""]
    return [f"{row[k]:,}" for k in ("visits_0", "visits_1", "visits_2plus", "visits_later")]


def service_table(rows: list[dict]) -> str:
    """The rows as docs/data_service.md shows them ("What an epoch sees ...")."""
    lines = ["| cluster | SIGKILLed | tf.data service | seen 0 times | once | 2+ times | "
             "read from the next epoch |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['cluster']} | {row['killed']} | "
                     f"{'on' if row['service'] else 'off'} | {' | '.join(counts(row))} |")
    return "\n".join(lines)


def by_index_table(rows: list[dict]) -> str:
    """The rows as docs/data_service.md shows them ("... read by index")."""
    lines = ["| input | cluster | what happened | seen 0 times | once | 2+ times | "
             "read from the next epoch | updates applied | steps run again | exit codes | "
             "seconds |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        source = {"by_index": "by index", "pipeline": "pipeline"}.get(row.get("input"), "?")
        rerun = row.get("steps_put_back", "–")  # no coordinator without ps
        lines.append(
            f"| {source} | {row['cluster']} | {row['what']} | {' | '.join(counts(row))} | "
            f"{row.get('steps', ''):,} | {rerun} | {', '.join(map(str, row['exit_codes']))} | "
            f"{' + '.join(map(str, row['seconds']))} |")
    return "\n".join(lines)


def window_table(rows: list[dict]) -> str:
    """One line per run of `window_rows`; a step applied twice shows as more updates
    than steps (the optimizer's, on ps:0) or as examples seen twice (the counter's)."""
    lines = ["| run | steps run again | updates applied | seen 0 times | 2+ times | "
             "exit codes |", "|---|---|---|---|---|---|"]
    for i, row in enumerate(rows):
        lines.append(f"| {i + 1} | {row.get('steps_put_back', '')} | {row.get('steps', ''):,} | "
                     f"{row.get('visits_0', '')} | {row.get('visits_2plus', '')} | "
                     f"{', '.join(map(str, row['exit_codes']))} |")
    return "\n".join(lines)


def machine() -> str:
    """The CPU, as `lscpu` names it."""
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in lscpu.splitlines()
                 if line.startswith("Model name")), "unknown")


TABLES = {"service": service_table, "by_index": by_index_table, "window": window_table,
          "records": by_index_table}


def main(argv: list[str] | None = None) -> int:
    global EXAMPLES, KILL_AT
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--by-index-table", action="store_true",
                        help="the pipeline and by-index runs, without the tf.data service")
    parser.add_argument("--window", type=int, metavar="N",
                        help="the by-index worker:1 SIGKILL N times: how often a step is "
                             "applied twice")
    parser.add_argument("--records-table", action="store_true",
                        help="the by-index runs, the examples read from TFRecord files")
    parser.add_argument("--examples", type=int, default=EXAMPLES,
                        help="examples in the epoch (default %(default)s)")
    parser.add_argument("--files", type=int, default=8, help="--records-table: files")
    parser.add_argument("--pad-floats", type=int, default=0,
                        help="--records-table: floats of padding per record")
    parser.add_argument("--kill-at-step", type=int, default=KILL_AT,
                        help="the step after which the fault comes (default %(default)s)")
    parser.add_argument("--memory-limit-gib", type=float, default=0,
                        help="runtime.memory_limit_gib of every task (0: none)")
    parser.add_argument("--out", help="where the rows go (JSON); default "
                        "runs/visitation[_by_index|_window|_records].json")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every run, e.g. "
                             "train.steps_per_execution=8")
    parser.add_argument("--table", metavar="JSON", help="print the table of an earlier run")
    parser.add_argument("--runs", metavar="DIR", help="keep each run's workdir and launcher "
                        "output (run<N>.<launch>.log) there; default: a temporary directory")
    args = parser.parse_args(argv)
    if args.table:
        written = json.loads(pathlib.Path(args.table).read_text())
        print(TABLES[written.get("table", "service")](written["rows"]))
        return 0
    which = ("by_index" if args.by_index_table else "records" if args.records_table
             else "window" if args.window else "service")
    OVERRIDES[:] = args.set
    EXAMPLES, KILL_AT = args.examples, args.kill_at_step
    EXTRA.extend(["--set", f"runtime.memory_limit_gib={args.memory_limit_gib}"])
    with tempfile.TemporaryDirectory() as tmp:
        runs = pathlib.Path(args.runs or tmp)
        runs.mkdir(parents=True, exist_ok=True)
        if which == "records":
            EXTRA.extend(["--set", f"task.records_dir={runs / 'records'}",
                          "--set", f"task.files={args.files}",
                          "--set", f"task.pad_floats={args.pad_floats}"])
        rows = (by_index_rows(runs) if which == "by_index" else
                records_rows(runs) if which == "records" else
                window_rows(runs, args.window) if which == "window" else service_rows(runs))
    suffix = "" if which == "service" else f"_{which}"
    out = pathlib.Path(args.out or f"runs/visitation{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": "python experiments/visitation.py " + " ".join(
            argv if argv is not None else sys.argv[1:]),
        "date": datetime.date.today().isoformat(), "machine": machine(), "table": which,
        "examples": EXAMPLES, "batch": BATCH, "kill_at_step": KILL_AT, "extra_flags": EXTRA,
        "backup_every_steps": BACKUP_EVERY, "overrides": args.set, "rows": rows},
        indent=1) + "\n")
    print(TABLES[which](rows))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
