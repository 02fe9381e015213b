"""`python -m app.bench`: training throughput of each strategy, side by side.

Each row is a real `python -m app.train` run in its own process (logical
devices and thread pools are fixed when TensorFlow starts), or for the
multi-task rows a real cluster of processes from `launch.local`, on the same
model, synthetic data and global batch. Rows are interleaved over the
repeats, so a machine that slows down mid-benchmark slows every row alike.
Each row reports its median steady-state examples/s, its ratio to the
baseline row measured in the same invocation, the peak resident memory of
all its processes together, and for parameter-server rows the bytes each ps
task holds and their balance (largest / mean).

Every row starts from the plain settings (TensorFlow's own CPU kernels and
CPU allocator, float32, no XLA, one step per execution), so that a speed
switch shows up only in the row that turns it on. The `*defaults` rows run
at the project's defaults instead, what a user gets, and their ratio is to
the single process at those defaults (the `defaults` row).

    python -m app.bench --steps 300 --workdir runs/bench   # or: make bench

With `--link RATE` the multi-task rows run over shaped links (`launch.local
--link`), and each ps row's step time is set beside the least one app.plan
says those links allow; `--links A,B,C` runs them at each rate and draws
throughput against bandwidth, the single process as the ceiling:

    python -m app.bench --links 100mbit,1gbit,10gbit --rows baseline,ps_2w2p,mwms_2w
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

from app import config as cfg
from launch import network  # the link syntax of launch.local --link

_TRAIN = ("-m", "app.train")
_LOCAL = ("-m", "launch.local")  # one process per task, see launch/local.py


@dataclasses.dataclass(frozen=True)
class Row:
    what: str
    args: tuple[str, ...]
    base: str = "baseline"  # the row its ratio is to, measured in the same invocation


def _ps(workers: int, ps: int, *sets: str) -> tuple[str, ...]:
    return (*_LOCAL, "--workers", str(workers), "--ps", str(ps), *_sets(*sets))


def _sets(*items: str) -> tuple[str, ...]:
    return tuple(arg for item in items for arg in ("--set", item))


_BASELINE = (*_TRAIN, "--strategy", "default")


def _switch(setting: str, note: str = "") -> Row:
    """The baseline with one speed switch turned on."""
    return Row(f"baseline + {setting}{note}", (*_BASELINE, *_sets(setting)))


# The straggler rows: 3 workers, worker 2 three times as slow, on real MNIST so
# that their test accuracy means something. Their global batch (96) divides over
# the 3 or 2 workers a sync update waits for; each row sees the same examples.
_STRAGGLER = ("debug.slow_worker=2", "debug.slow_factor=3", "train.global_batch_size=96",
              "task.source=mnist", "task.validation_examples=0", "task.test_examples=0")

# The settings every row starts from; rows and --set may change them.
PLAIN = ("runtime.onednn=false", "runtime.cpu_allocator=malloc", "train.precision=float32",
         "train.jit_compile=false", "train.steps_per_execution=1")


def _project_defaults() -> tuple[str, ...]:
    """PLAIN's settings at the project's default values, written as TOML values."""
    config = cfg.load(None)
    out = []
    for key in (item.split("=")[0] for item in PLAIN):
        section, name = key.split(".")
        out.append(f"{key}={json.dumps(getattr(getattr(config, section), name))}")
    return tuple(out)


DEFAULTS = _project_defaults()


def _at_defaults(what: str, args: tuple[str, ...]) -> Row:
    return Row(f"{what}, at the project's defaults", (*args, *_sets(*DEFAULTS)), base="defaults")


ROWS: dict[str, Row] = {
    "baseline": Row("plain Keras fit, one process, default strategy", _BASELINE),
    "defaults": _at_defaults("one process, default strategy", _BASELINE),
    "mwms_2w_defaults": _at_defaults("MultiWorkerMirrored, 2 worker processes", _ps(2, 0)),
    "ps_2w2p_defaults": _at_defaults("ParameterServer: chief + 2 workers + 2 ps", _ps(2, 2)),
    "onednn": _switch("runtime.onednn=true", " (the project's default)"),
    "bfc": _switch("runtime.cpu_allocator=bfc", " (the project's default)"),
    "spe8": _switch("train.steps_per_execution=8"),
    "xla": _switch("train.jit_compile=true"),
    "bf16": _switch("train.precision=mixed_bfloat16"),
    "mirrored_1dev": Row("MirroredStrategy on one device", (*_TRAIN, "--strategy", "mirrored")),
    # The device list is filled in at run time: two logical CPUs, or GPUs (see _devices).
    "mirrored_2dev": Row("MirroredStrategy on two devices", (*_TRAIN, "--strategy", "mirrored")),
    "mwms_2w": Row("MultiWorkerMirrored, 2 worker processes", _ps(2, 0)),
    "mwms_2w_fp16": Row("the same, gradients all-reduced as float16 (sync.compression=fp16)",
                        _ps(2, 0, "sync.compression=fp16")),
    "mwms_2w_onepack": Row("the same, one all-reduce after the backward pass (TF's default)",
                           _ps(2, 0, "sync.bytes_per_pack=0")),
    "ps_2w1p": Row("ParameterServer: chief + 2 workers + 1 ps", _ps(2, 1)),
    "ps_2w2p": Row("ParameterServer: chief + 2 workers + 2 ps", _ps(2, 2)),
    "ps_2w2p_rr": Row("the same without a partitioner (TF1's round-robin placement)",
                      _ps(2, 2, "ps.partitioner=none")),
    "ps_2w2p_fp16": Row("the same as ps_2w2p, gradients pushed as float16 (ps.compression=fp16)",
                        _ps(2, 2, "ps.compression=fp16")),
    "ps_2w2p_rr_fp16": Row("ps_2w2p_rr with gradients pushed as float16",
                           _ps(2, 2, "ps.partitioner=none", "ps.compression=fp16")),
    "straggler_async": Row("ParameterServer async, 3 workers + 1 ps, worker 2 slowed 3x",
                           _ps(3, 1, *_STRAGGLER)),
    "straggler_sync_b0": Row("the same, ps.mode=sync, no backup worker",
                             _ps(3, 1, *_STRAGGLER, "ps.mode=sync")),
    "straggler_sync_b1": Row("the same, ps.mode=sync, 1 backup worker",
                             _ps(3, 1, *_STRAGGLER, "ps.mode=sync", "ps.backup_workers=1")),
    # The recommender rows, for `--config configs/recommender.toml --set task.table_scale=0.05`
    # (the baseline row is then the recommender in one process): the same task and
    # global batch with sharded tables on 2 ps tasks or replicated on 2 workers,
    # with tables 8 times as large, and with the hot ids at the front of each table.
    "rec_ps_2w2p": Row("recommender, ParameterServer: chief + 2 workers + 2 ps", _ps(2, 2)),
    "rec_mwms_2w": Row("recommender, MultiWorkerMirrored, 2 worker processes", _ps(2, 0)),
    "rec_ps_2w2p_8x": Row("rec_ps_2w2p with tables 8x as large (task.table_scale=0.4)",
                          _ps(2, 2, "task.table_scale=0.4")),
    "rec_mwms_2w_8x": Row("rec_mwms_2w with tables 8x as large (task.table_scale=0.4)",
                          _ps(2, 0, "task.table_scale=0.4")),
    "rec_ps_2w2p_ranked": Row("rec_ps_2w2p with the hot ids at the front of each table",
                              _ps(2, 2, "task.ids=ranked")),
}
BASELINE = "baseline"
DEFAULT_ROWS = ("baseline", "defaults", "mwms_2w_defaults", "ps_2w2p_defaults",
                "onednn", "bfc", "spe8", "xla", "mirrored_1dev", "mirrored_2dev",
                "mwms_2w", "mwms_2w_onepack", "mwms_2w_fp16", "ps_2w1p", "ps_2w2p", "ps_2w2p_rr")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m app.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/mnist.toml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every row, e.g. train.global_batch_size=128")
    parser.add_argument("--steps", type=int, default=300, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                        help="comma-separated subset of: " + ", ".join(ROWS))
    parser.add_argument("--workdir", type=pathlib.Path, default=pathlib.Path("runs/bench"))
    links = parser.add_mutually_exclusive_group()
    links.add_argument("--link", metavar="RATE[,DELAY]",
                       help="run the multi-task rows over links of RATE per task "
                            "(launch.local --link; needs root), e.g. 1gbit")
    links.add_argument("--links", metavar="RATE,RATE,...",
                       help="a bandwidth sweep: the multi-task rows at each rate, "
                            "e.g. 100mbit,1gbit,10gbit")
    return parser.parse_args(argv)


def link_list(args: argparse.Namespace) -> list[str | None]:
    """The links the multi-task rows run over: [None] for loopback as it is.
    ValueError naming the one that cannot be read."""
    texts = [args.link] if args.link else (args.links.split(",") if args.links else [None])
    for text in texts:
        if text is not None:
            network.parse_link(text)
    return texts


def multi_task(row: str) -> bool:
    """Whether `row` is a cluster of processes (launch.local), which links can shape."""
    return ROWS[row].args[:2] == _LOCAL


def entries(rows: list[str], links: list[str | None]) -> list[tuple[str, str, str | None]]:
    """(name, row, link) of each run: a multi-task row once per link ("ps_2w2p@1gbit"
    in a sweep), a single-process row once, with no link."""
    out = []
    for row in rows:
        for link in (links if multi_task(row) else [None]):
            out.append((f"{row}@{link}" if len(links) > 1 and link else row, row, link))
    return out


def train_args(config_path: str, overrides: list[str], steps: int) -> list[str]:
    """app.train arguments for a run of exactly `steps` steps of pure training."""
    config = cfg.load(config_path, [*PLAIN, *overrides])
    batch = config.train.global_batch_size
    fixed = [f"task.train_examples={steps * batch}",
             "task.validation_examples=0", f"task.test_examples={batch}", "train.epochs=1",
             "eval.test_every_epoch=false", "train.verbose=0"]
    if config.task.name == "mnist" and not any(o.startswith("task.source=") for o in overrides):
        fixed.insert(0, "task.source=synthetic")  # no files to read; --set task.source=mnist does
    return ["--config", config_path, *_sets(*PLAIN, *overrides, *fixed)]


def row_args(row: str, base_args: list[str], gpus: int, link: str | None = None) -> list[str]:
    """The command line of `row`: its module, the shared arguments, then its own settings."""
    module, rest = ROWS[row].args[:2], list(ROWS[row].args[2:])
    if row == "mirrored_2dev":
        rest += _devices(gpus)
    if link and multi_task(row):
        rest += ["--link", link]
    return [*module, *base_args, *rest]


def row_cluster(row: str) -> tuple[int, int, list[str]]:
    """(workers, ps tasks, --set items) of a multi-task row."""
    args = ROWS[row].args
    value = {flag: args[i + 1] for i, flag in enumerate(args) if flag.startswith("--")}
    sets = [args[i + 1] for i, flag in enumerate(args) if flag == "--set"]
    return int(value["--workers"]), int(value["--ps"]), sets


def plan_bound(row: str, link: str, config_path: str, overrides: list[str]
               ) -> tuple[float, str] | None:
    """app.plan's least step time of ps row `row` over `link`, in seconds, and what
    sets it ("what ps:1 sends"); None for a row without ps."""
    if not multi_task(row) or not row_cluster(row)[1]:
        return None
    from app import plan  # builds the model: TensorFlow, only when a link asks for it

    workers, num_ps, sets = row_cluster(row)
    config = cfg.load(config_path, [*PLAIN, *overrides, *sets])
    _, traffic = plan.predict(config, num_ps)
    return plan.step_time_bound(traffic, workers, network.parse_link(link).rate_bits)


def add_bounds(results: dict[str, dict], bounds: dict[str, tuple[float, str]]) -> None:
    """Set each bounded row's measured step time beside app.plan's bound."""
    for name, (seconds, binding) in bounds.items():
        r = results[name]
        r["plan_bound_ms"], r["plan_bound_link"] = round(seconds * 1000, 1), binding
        if r["steps_per_sec"]:
            r["step_ms"] = round(1000 / r["steps_per_sec"], 1)
            r["step_over_bound"] = round(r["step_ms"] / r["plan_bound_ms"], 3)


def bound_lines(results: dict[str, dict]) -> list[str]:
    """"ps_2w2p: step 560.0 ms, app.plan's bound 530.8 ms (what ps:1 sends): 1.055x"."""
    return [f"{name}: step {r.get('step_ms', 0):.1f} ms, app.plan's bound "
            f"{r['plan_bound_ms']:.1f} ms ({r['plan_bound_link']}): "
            f"{r.get('step_over_bound', 0):.3f}x"
            for name, r in results.items() if "plan_bound_ms" in r]


def _devices(gpus: int) -> list[str]:
    """Two replicas: two GPUs, one GPU split in two, or the CPU split in two."""
    if gpus >= 2:
        return []  # MirroredStrategy takes all the real GPUs
    if gpus == 1:
        return list(_sets("runtime.gpu_devices=2"))
    return list(_sets("runtime.cpu_devices=2"))


def measure(args: list[str], workdir: pathlib.Path) -> dict:
    """Run `python <args>` once; its metrics.json, with the peak memory of all its
    processes and the CPU seconds they used, summed by cluster task type."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    with open(workdir.with_suffix(".log"), "w") as log:
        process = subprocess.Popen([sys.executable, *args, "--workdir", str(workdir)],
                                   env=env, stdout=log, stderr=subprocess.STDOUT)
        peak, cpu, peaks = 0, {}, {}
        while process.poll() is None:
            pids = tree(process.pid)
            peak = max(peak, rss(pids))
            cpu.update(cpu_seconds(pids))  # a process that has ended keeps its last reading
            peaks.update(peak_rss(pids))
            time.sleep(0.2)
    if process.returncode:
        tail = workdir.with_suffix(".log").read_text()[-3000:]
        raise RuntimeError(f"benchmark run failed: {' '.join(args)}\n{tail}")
    metrics = json.loads((workdir / "metrics.json").read_text())
    metrics["peak_memory_mib"] = round(peak / 2**20, 1)
    by_task: dict[str, float] = {}
    for task, seconds in cpu.values():
        by_task[task] = round(by_task.get(task, 0) + seconds, 1)
    metrics["cpu_seconds"] = by_task
    largest: dict[str, float] = {}
    for task, peak_bytes in peaks.values():
        largest[task] = max(largest.get(task, 0), round(peak_bytes / 2**20, 1))
    metrics["peak_rss_mib_by_task"] = largest
    return metrics


def tree(pid: int) -> list[int]:
    """`pid` and all its descendants, read from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue  # ended meanwhile
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def rss(pids: list[int]) -> int:
    """Resident bytes of `pids` together."""
    total, page = 0, os.sysconf("SC_PAGE_SIZE")
    for p in pids:
        try:
            total += int(pathlib.Path(f"/proc/{p}/statm").read_text().split()[1]) * page
        except OSError:
            pass
    return total


def task_type(pid: int) -> str | None:
    """The cluster task type of process `pid` (from its TF_CONFIG; "launcher" or "main"
    without one), or None once it has ended."""
    try:
        environ = pathlib.Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    task = "launcher" if b"launch.local" in cmdline else "main"
    for item in environ:
        if item.startswith(b"TF_CONFIG="):
            task = json.loads(item[len(b"TF_CONFIG="):]).get("task", {}).get("type", task)
    return task


def cpu_seconds(pids: list[int]) -> dict[int, tuple[str, float]]:
    """Per pid: its cluster task type (`task_type`) and the user + system CPU seconds
    it has used so far."""
    found, tick = {}, os.sysconf("SC_CLK_TCK")
    for p in pids:
        try:
            fields = pathlib.Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # ended meanwhile
        task = task_type(p)
        if task is not None:
            # utime and stime: fields 14 and 15, counted from the ")" that ends field 2.
            found[p] = task, (int(fields[11]) + int(fields[12])) / tick
    return found


def peak_rss(pids: list[int]) -> dict[int, tuple[str, int]]:
    """Per pid: its cluster task type (`task_type`) and the peak resident bytes the
    kernel recorded for it so far (VmHWM), so no peak falls between polls."""
    found = {}
    for p in pids:
        try:
            status = pathlib.Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue  # ended meanwhile
        task = task_type(p)
        if task is None:
            continue  # ended meanwhile
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                found[p] = task, int(line.split()[1]) * 1024
    return found


def run(schedule: list[tuple[str, str, str | None]], base_args: list[str], repeats: int,
        gpus: int, tmp: pathlib.Path) -> tuple[dict[str, dict], dict[str, str]]:
    """Measure each (name, row, link) of `schedule` `repeats` times, interleaved;
    (the summary of the runs that finished, the error of each row with a failed run).
    A failed run does not stop the others: a long sweep keeps what it measured."""
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in schedule}
    failed: dict[str, str] = {}
    for r in range(repeats):
        for i, (name, row, link) in enumerate(schedule):
            try:
                metrics = measure(row_args(row, base_args, gpus, link), tmp / f"{r}-{i}")
            except RuntimeError as e:
                failed.setdefault(name, str(e))
                print(f"  repeat {r + 1}/{repeats} {name}: failed", file=sys.stderr)
                continue
            if link:
                metrics["link"] = link
            runs[name].append(metrics)
            print(f"  repeat {r + 1}/{repeats} {name}: "
                  f"{metrics['train_examples_per_sec']:.0f} examples/s", file=sys.stderr)
    done = {name: metrics for name, metrics in runs.items() if metrics}
    return (summarize(done) if done else {}), failed


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per row: median examples/s, ratio to its base row, peak memory, ps figures."""
    results = {}
    for row, metrics in runs.items():
        samples = [m["train_examples_per_sec"] for m in metrics]
        results[row] = {
            "what": ROWS[row.split("@")[0]].what,
            "examples_per_sec": statistics.median(samples),
            "samples": samples,
            "steps_per_sec": statistics.median(m.get("train_steps_per_sec", 0) for m in metrics),
            # The task's headline metric (test_accuracy for MNIST; app/task.py).
            "metric": metrics[0].get("metric", "test_accuracy"),
            "test_metric": statistics.median(m.get(m.get("metric"), 0) for m in metrics),
            "peak_memory_mib": max(m["peak_memory_mib"] for m in metrics),
            "cpu_seconds": {task: statistics.median(m["cpu_seconds"].get(task, 0)
                                                    for m in metrics)
                            for task in metrics[0].get("cpu_seconds", {})},
            "num_replicas": metrics[0]["num_replicas"],
        }
        for key in ("mode", "backup_workers", "stale_dropped", "contributions", "link",
                    "test_auc", "bayes_test_auc", "ps_traffic"):
            if key in metrics[0]:
                results[row][key] = metrics[0][key]
        results[row]["peak_rss_mib_by_task"] = {
            task: max(m.get("peak_rss_mib_by_task", {}).get(task, 0) for m in metrics)
            for task in metrics[0].get("peak_rss_mib_by_task", {})}
        if "ps_bytes" in metrics[0]:
            results[row]["ps_bytes"] = metrics[0]["ps_bytes"]
            results[row]["ps_balance"] = metrics[0]["ps_balance"]
    first = next(iter(results))
    for name, r in results.items():
        base = ROWS[name.split("@")[0]].base
        r["ratio_to"] = base if base in results else first  # main() runs every base row
        r["ratio"] = round(r["examples_per_sec"] / results[r["ratio_to"]]["examples_per_sec"], 3)
    return results


def table(results: dict[str, dict]) -> str:
    width = max(len(row) for row in results)
    lines = [f"{'row':<{width}}  examples/s  ratio  steps/s    metric  peak MiB  "
             "CPU s by task                  ps MiB (balance)",
             f"{'-' * width}  ----------  -----  -------  --------  --------  "
             "-----------------------------  ----------------"]
    for row, r in results.items():
        ps = ""
        if "ps_bytes" in r:
            ps = " / ".join(f"{b / 2**20:.1f}" for b in r["ps_bytes"]) + f" ({r['ps_balance']})"
        lines.append(f"{row:<{width}}  {r['examples_per_sec']:>10.0f}  {r['ratio']:>5.3f}  "
                     f"{r['steps_per_sec']:>7.2f}  {r['test_metric']:>8.4f}  "
                     f"{r['peak_memory_mib']:>8.0f}  "
                     f"{cpu_text(r.get('cpu_seconds', {})):<29}  {ps}")
    return "\n".join(lines)


def cpu_text(cpu: dict[str, float]) -> str:
    """CPU seconds by task type, largest first: "worker 96 ps 31 chief 12"."""
    return " ".join(f"{task} {seconds:.0f}"
                    for task, seconds in sorted(cpu.items(), key=lambda item: -item[1]))


def _pyplot():
    """matplotlib.pyplot drawing to files, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def chart(results: dict[str, dict], title: str, path: pathlib.Path) -> bool:
    """Ratios as bars and the bytes of each ps task, as a PNG; False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    ps_rows = {row: r for row, r in results.items() if "ps_bytes" in r}
    fig, axes = plt.subplots(1, 2 if ps_rows else 1, figsize=(12 if ps_rows else 7, 4.5),
                             squeeze=False)
    ax = axes[0][0]
    names = list(results)
    ratios = [results[n]["ratio"] for n in names]
    ax.barh(names[::-1], ratios[::-1], color="tab:blue")
    ax.axvline(1.0, color="black", linewidth=0.8)
    for y, value in enumerate(ratios[::-1]):
        ax.text(value, y, f" {value:.2f}", va="center", fontsize=8)
    ax.set_xlabel("examples/s relative to the baseline (same run)")
    ax.set_title("throughput")
    if ps_rows:
        ax = axes[0][1]
        tasks = max(len(r["ps_bytes"]) for r in ps_rows.values())
        width = 0.8 / tasks
        for task in range(tasks):
            mib = [r["ps_bytes"][task] / 2**20 if task < len(r["ps_bytes"]) else 0
                   for r in ps_rows.values()]
            offset = (task - (tasks - 1) / 2) * width
            ax.bar([i + offset for i in range(len(ps_rows))], mib, width, label=f"ps:{task}")
        ax.set_xticks(range(len(ps_rows)), list(ps_rows), fontsize=8)
        ax.set_ylabel("MiB of variables and optimizer slots")
        ax.set_title("bytes per parameter server")
        ax.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def sweep_chart(results: dict[str, dict], title: str, path: pathlib.Path) -> bool:
    """Examples/s of each multi-task row against its link rate, with the single
    process (no network at all) as the ceiling, as a PNG; False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    curves: dict[str, list[tuple[int, float]]] = {}
    for name, r in results.items():
        if "link" in r:
            rate = network.parse_link(r["link"]).rate_bits
            curves.setdefault(name.split("@")[0], []).append((rate, r["examples_per_sec"]))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for row, points in curves.items():
        points.sort()
        ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=row)
    ax.axhline(results[BASELINE]["examples_per_sec"], color="black", linestyle="--",
               linewidth=0.8, label=f"{BASELINE}: one process, no network")
    ax.set_xscale("log")
    ax.set_xlabel("link rate of each task, each way (bit/s)")
    ax.set_ylabel("examples/s")
    ax.set_title("throughput against bandwidth")
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def machine() -> dict[str, str | int]:
    """What the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpus = []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        gpus = [g.strip() for g in out.stdout.splitlines() if g.strip()] if not out.returncode \
            else []
    except (OSError, subprocess.TimeoutExpired):
        pass
    return {"cpu": cpu, "cores": os.cpu_count() or 0, "gpus": len(gpus),
            "gpu": ", ".join(gpus) or "none"}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = [row.strip() for row in args.rows.split(",")]
    unknown = [row for row in rows if row not in ROWS]
    if unknown:
        print(f"error: --rows: unknown row(s) {unknown}; rows are {list(ROWS)}", file=sys.stderr)
        return 2
    bases = list(dict.fromkeys([BASELINE, *(ROWS[row].base for row in rows)]))
    rows = [*bases, *(row for row in rows if row not in bases)]  # ratios need them first
    try:
        links = link_list(args)
        if links != [None] and (problem := network.preflight()):
            raise ValueError(problem)  # before any row runs, not in the first cluster's log
        base_args = train_args(args.config, args.set, args.steps)
    except (cfg.ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    schedule = entries(rows, links)
    bounds = {name: bound for name, row, link in schedule
              if link and (bound := plan_bound(row, link, args.config, args.set))}
    host = machine()
    command = " ".join(["python -m app.bench", *(sys.argv[1:] if argv is None else argv)])
    args.workdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        results, failed = run(schedule, base_args, args.repeats, host["gpus"], pathlib.Path(tmp))
    for error in failed.values():
        print(f"error: {error}", file=sys.stderr)
    if not results:
        return 1
    add_bounds(results, {name: bound for name, bound in bounds.items() if name in results})
    report = {"command": command, "machine": host, "steps": args.steps,
              "repeats": args.repeats, **({"links": links} if links != [None] else {}),
              "rows": results, **({"failed": failed} if failed else {})}
    (args.workdir / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    title = (textwrap.fill(command, 110)  # a sweep's command outruns the figure's width
             + f"\n{host['cpu']}, {host['cores']} cores, GPU: {host['gpu']}")
    drawn = (sweep_chart if len(links) > 1 else chart)(results, title,
                                                      args.workdir / "bench.png")
    print("\n".join([table(results), *bound_lines(results)]))
    print(f"wrote {args.workdir / 'bench.json'}"
          + (f" and {args.workdir / 'bench.png'}" if drawn else
             " (no chart: matplotlib is missing; pip install -e '.[bench]')"))
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
