"""What `tools.bench` prints and draws: the results table, the bound lines, the charts
and the machine they were measured on.

`python -m tools.bench_report BENCH_JSON` prints a saved report's table again and
redraws its chart (beside it, as .png), e.g. after installing matplotlib:

    python -m tools.bench_report docs/results/bench_link_sweep.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import textwrap

from launch import network  # the link syntax of launch.local --link

NO_CHART = "no chart: matplotlib is missing; pip install -e '.[bench]'"


def text(results: dict[str, dict]) -> str:
    """The table, then each bounded row's step time beside tools.plan's bound."""
    return "\n".join([table(results), *bound_lines(results)])


def bound_lines(results: dict[str, dict]) -> list[str]:
    """"ps_2w2p: step 560.0 ms, tools.plan's bound 530.8 ms (what ps:1 sends): 1.055x"."""
    return [f"{name}: step {r.get('step_ms', 0):.1f} ms, tools.plan's bound "
            f"{r['plan_bound_ms']:.1f} ms ({r['plan_bound_link']}): "
            f"{r.get('step_over_bound', 0):.3f}x"
            for name, r in results.items() if "plan_bound_ms" in r]


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
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"  # its base row failed
        lines.append(f"{row:<{width}}  {r['examples_per_sec']:>10.0f}  {ratio:>5}  "
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
    names = [n for n in results if results[n]["ratio"] is not None]
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


def sweep_chart(results: dict[str, dict], title: str, path: pathlib.Path,
                ceiling: str) -> bool:
    """Examples/s of each multi-task row against its link rate, with row `ceiling`
    (one process, no network at all) as a line, as a PNG; False without matplotlib."""
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
    ax.axhline(results[ceiling]["examples_per_sec"], color="black", linestyle="--",
               linewidth=0.8, label=f"{ceiling}: one process, no network")
    ax.set_xscale("log")
    ax.set_yscale("log")  # a ratio between two rows is the same gap at every rate
    ax.set_xlabel("link rate of each task, each way (bit/s)")
    ax.set_ylabel("examples/s (log scale)")
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


def emit(record: dict, out: pathlib.Path | None) -> None:
    """Print a measurement's `record` as JSON and, given `out`, write it there too (the
    records under docs/results/)."""
    text = json.dumps(record, indent=2) + "\n"
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    print(text, end="")


def title(command: str, host: dict) -> str:
    """A chart's title: the command, wrapped, and the machine."""
    return (textwrap.fill(command, 110)  # a sweep's command outruns the figure's width
            + f"\n{host['cpu']}, {host['cores']} cores, GPU: {host['gpu']}")


def draw(report: dict, path: pathlib.Path) -> bool:
    """The chart of a bench.json `report` as a PNG: throughput against bandwidth for a
    sweep, else ratios and ps bytes; False without matplotlib."""
    results = report["rows"]
    heading = title(report["command"], report["machine"])
    if len(report.get("links", ())) > 1:
        return sweep_chart(results, heading, path, ceiling=next(iter(results)))  # a base row
    return chart(results, heading, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench_report",
        description="Print a saved bench.json report's table and draw its chart again.")
    parser.add_argument("report", type=pathlib.Path, help="a bench.json that tools.bench wrote")
    parser.add_argument("--out", type=pathlib.Path, help="the PNG (default: the report's "
                                                          "path with .png)")
    args = parser.parse_args(argv)
    try:
        report = json.loads(args.report.read_text())
        print(text(report["rows"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"error: {args.report}: not a report tools.bench wrote ({type(e).__name__}: {e})",
              file=sys.stderr)
        return 2
    out = args.out or args.report.with_suffix(".png")
    if not draw(report, out):
        print(NO_CHART, file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
