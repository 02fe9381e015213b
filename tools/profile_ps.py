"""`python -m tools.profile_ps`: where a parameter-server (or MultiWorkerMirrored) step's time goes.

Runs the bench's parameter-server row (chief + 2 workers + 2 ps under `launch.local`,
the bench's plain settings, synthetic MNIST read by index, global batch 32 unless
`--set` says otherwise), waits until the chief has logged `--warmup` steps, then
traces the chief, worker 0 and ps 0 for `--seconds` with TensorFlow's profiler
(every task's gRPC server serves it: `tf.profiler.experimental.client.trace`), and
sums what each traced task did, per training step:

- the chief: the time its coordinator threads spend in each closure's remote call,
  and the closures it scheduled (the steps in the window); in `ps.mode = "sync"` its
  updates' calls too, and the steps are the updates;
- worker 0: each closure's time on the worker, the time between its closures (waiting
  for the next one), and its ops' time by kind: the model's forward and backward
  pass, the optimizer's, reading the batch (the ops outside the model and the
  optimizer), and the transfers to and from the ps tasks (`_Send`, `_Recv`);
- ps 0: its ops' time by kind (the optimizer's apply, the variables it sends).

With `--ps 0` the cluster is MultiWorkerMirrored: worker 0 and worker 1 are traced,
each's train function calls counted as its closures, and its collective ops as the
all-reduce.

Op times are summed over a task's threads, so they can exceed the wall time when
ops run side by side. Beside them, each task's CPU milliseconds per step (from
/proc, between two of the chief's step lines `--warmup` steps apart, after the
trace). The traces stay in `--workdir`/trace for TensorBoard's profile plugin.

    python -m tools.profile_ps --out docs/results/profile_ps_b32.json
    python -m tools.profile_ps --set train.steps_per_execution=8 --out ...
    python -m tools.profile_ps --ps 0 --config configs/mnist_sync.toml --out ...
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterable

from tools import bench, bench_report, procstat

STEP = re.compile(r"\[(chief:0|worker:0)\] INFO step (\d+)$")
# The transfers between tasks: a variable read from a ps task, a gradient sent to one.
TRANSFERS = ("_Send", "_Recv", "_HostSend", "_HostRecv")
# Events named like ops that are not: a function's call, an input copied to a device.
NOT_OPS = ("EagerLocalExecute", "_Send input")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.profile_ps",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/mnist.toml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. train.steps_per_execution=8")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=300, help="steps before the trace")
    parser.add_argument("--seconds", type=float, default=5.0, help="how long to trace")
    parser.add_argument("--workdir", type=pathlib.Path, default=pathlib.Path("runs/profile_ps"))
    parser.add_argument("--out", type=pathlib.Path, help="the figures as JSON")
    return parser.parse_args(argv)


def launch(args: argparse.Namespace) -> subprocess.Popen:
    """The cluster, training far more steps than the trace needs (epochs without end
    over a task's examples, if it has fewer), logging every 10."""
    steps = args.warmup * 20
    train = [*bench.train_args(args.config, [*args.set, "debug.log_every_steps=10"], steps),
             "--set", "train.epochs=1000"]
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    return subprocess.Popen(
        [sys.executable, "-u", "-m", "launch.local", "--workers", str(args.workers),
         "--ps", str(args.ps), *train, "--workdir", str(args.workdir / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True)


class Steps:
    """The cluster's output, read on a thread of its own as it comes: the latest step
    the lead task logged is the one it is at now, not a line left waiting in the pipe
    while the trace ran (which made the CPU per step a backlog's, not the steps')."""

    def __init__(self, lines: Iterable[str]):
        self.log: list[str] = []
        self.step, self._ended = 0, False
        self._changed = threading.Condition()
        threading.Thread(target=self._read, args=(lines,), daemon=True).start()

    def _read(self, lines: Iterable[str]) -> None:
        for line in lines:
            with self._changed:
                self.log.append(line)
                if m := STEP.match(line.rstrip("\n")):
                    self.step = int(m[2])
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def reach(self, step: int) -> int:
        """Wait until the lead task has logged `step` or later; the step it logged last.
        RuntimeError, with the output's end, if the cluster ends first."""
        with self._changed:
            self._changed.wait_for(lambda: self.step >= step or self._ended)
            if self.step < step:
                raise RuntimeError(f"the cluster ended before step {step}:\n"
                                   + "".join(self.log[-40:]))
            return self.step


def tasks(pid: int) -> dict[str, tuple[int, str]]:
    """Each task of the cluster under `pid`: "worker:0" -> (its pid, its address)."""
    found = {}
    for p in procstat.tree(pid):
        try:
            environ = pathlib.Path(f"/proc/{p}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"TF_CONFIG="):
                tf_config = json.loads(item[len(b"TF_CONFIG="):])
                kind, index = tf_config["task"]["type"], tf_config["task"]["index"]
                found[f"{kind}:{index}"] = p, tf_config["cluster"][kind][index]
    return found


def trace(addresses: list[str], logdir: pathlib.Path, seconds: float) -> None:
    import tensorflow as tf  # only here: the launcher and the parsing need none

    tf.profiler.experimental.client.trace(",".join(f"grpc://{a}" for a in addresses),
                                          str(logdir), int(seconds * 1000))


def op_kind(name: str, model: str) -> str:
    """What an op of a training closure does, from its "scope/name:Type" name."""
    scope, _, kind = name.rpartition(":")
    if kind in TRANSFERS:
        return "transfers to and from other tasks"
    if kind.startswith("Collective"):
        return "the all-reduce"
    if "/Adam/" in scope or kind.startswith("ResourceApply"):
        return "the optimizer's update"
    if f"/{model}/" in scope or "gradient_tape/" in scope:
        return "forward and backward"
    return "reading the batch, loss and metrics"


def read_space(path: pathlib.Path):
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    space.ParseFromString(path.read_bytes())
    return next(p for p in space.planes if p.name == "/host:CPU")


def events(plane) -> list[tuple[str, str, int, int]]:
    """(thread, name, start, duration) of every event of `plane`, in picoseconds."""
    names = plane.event_metadata
    return [(line.name, names[e.metadata_id].name,
             line.timestamp_ns * 1000 + e.offset_ps, e.duration_ps)
            for line in plane.lines for e in line.events]


# The functions whose calls are a task's closures: the project's loop's (asynchronous
# steps, synchronous contributions), Keras' fit's.
CLOSURES = ("__inference_steps", "__inference_contribution", "__inference_train_function",
            "__inference_multi_step_on_iterator", "__inference_one_step_on_data")
# The chief's coordinator threads, each in a closure's remote call, by the function's name.
CLOSURE_CALLS = ("steps", "contribution")
# The chief's call of a synchronous update (app/distribute/ps/sync.py): one a step.
UPDATE_CALL = "_update"


def closures(evs: list[tuple[str, str, int, int]]) -> list[tuple[int, int]]:
    """(start, duration) of each closure run on a task: its function's local execution."""
    return sorted((start, dur) for _, name, start, dur in evs
                  if name.startswith("EagerLocalExecute: ") and any(c in name for c in CLOSURES))


def summarize(trace_dir: pathlib.Path, found: dict[str, tuple[int, str]], model: str,
              per_closure: int, seconds: float) -> dict:
    latest = max((trace_dir / "plugins" / "profile").iterdir())  # one directory a trace
    spaces = {path.name.split(".")[0]: path for path in latest.glob("*.xplane.pb")}

    def plane_of(task: str):
        host, port = found[task][1].rsplit(":", 1)
        return read_space(spaces[f"{host}_{port}"])

    figures: dict = {"window_s": seconds, "steps_per_closure": per_closure}
    if "chief:0" in found:
        figures["steps"], figures["chief"] = chief_figures(events(plane_of("chief:0")),
                                                           per_closure)
    for task in traced(found)[1:] if "chief:0" in found else traced(found):
        evs = events(plane_of(task))
        runs = closures(evs)
        steps = len(runs) * per_closure
        figures.setdefault("steps", steps)  # MultiWorkerMirrored: every worker runs each
        gaps = [b[0] - (a[0] + a[1]) for a, b in zip(runs, runs[1:], strict=False)]
        figures[task] = {"closures": len(runs), "closure_ms": _mean_ms([d for _, d in runs]),
                         "between_closures_ms": _mean_ms(gaps),
                         "ops_ms_per_step": _by_kind(evs, model, steps if runs else
                                                     figures["steps"])}
    return figures


def chief_figures(evs: list[tuple[str, str, int, int]], per_closure: int
                  ) -> tuple[int, dict]:
    """The steps in the window, and the chief's closures and their remote calls' mean
    time. A synchronous run's steps are its updates, not its contributions."""
    calls = [dur for _, name, _, dur in evs if name in CLOSURE_CALLS]
    figures = {"closures": len(calls), "closure_call_ms": _mean_ms(calls)}
    updates = [dur for _, name, _, dur in evs if name == UPDATE_CALL]
    if updates:
        figures |= {"updates": len(updates), "update_call_ms": _mean_ms(updates)}
        return len(updates), figures
    return len(calls) * per_closure, figures


def traced(found: dict[str, tuple[int, str]]) -> list[str]:
    """The tasks a trace covers: the chief, worker 0 and ps 0; or both workers of a
    MultiWorkerMirrored cluster."""
    return (["chief:0", "worker:0", "ps:0"] if "chief:0" in found
            else ["worker:0", "worker:1"])


def _mean_ms(durations_ps: list[int]) -> float:
    return round(sum(durations_ps) / len(durations_ps) / 1e9, 2) if durations_ps else 0.0


def _by_kind(evs, model: str, steps: int) -> dict[str, float]:
    """Milliseconds of op time per step, by `op_kind`, and the top ops."""
    kinds: collections.Counter = collections.Counter()
    ops: collections.Counter = collections.Counter()
    for _, name, _, dur in evs:
        if ":" in name and "/" in name and not name.startswith(NOT_OPS):
            kinds[op_kind(name, model)] += dur
            ops[name.rpartition(":")[2]] += dur
    per = max(steps, 1) * 1e9
    return {**{k: round(v / per, 2) for k, v in kinds.most_common()},
            "top op types": {k: round(v / per, 2) for k, v in ops.most_common(8)}}


def cpu_per_step(steps: Steps, found: dict[str, tuple[int, str]], count: int
                 ) -> dict[str, float]:
    """CPU milliseconds per step of each task, between two of the lead task's step
    lines at least `count` steps apart (after the trace)."""
    first = steps.reach(steps.step + 1)
    before = {task: _cpu(pid) for task, (pid, _) in found.items()}
    last = steps.reach(first + count)
    return {task: round((_cpu(pid) - before[task]) / (last - first) * 1000, 2)
            for task, (pid, _) in sorted(found.items())}


def _cpu(pid: int) -> float:
    return procstat.cpu_seconds([pid]).get(pid, ("", 0.0))[1]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from app import config as cfg

    config = cfg.load(args.config, [*bench.PLAIN, *args.set])
    args.workdir.mkdir(parents=True, exist_ok=True)
    launcher = launch(args)
    steps = Steps(launcher.stdout)
    try:
        steps.reach(args.warmup)
        found = tasks(launcher.pid)
        trace([found[t][1] for t in traced(found)], args.workdir / "trace", args.seconds)
        cpu = cpu_per_step(steps, found, args.warmup)
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)  # its own session: the whole cluster
        launcher.wait()
    figures = summarize(args.workdir / "trace", found, config.task.params.get("model", "cnn"),
                        config.train.steps_per_execution, args.seconds)
    figures["cpu_ms_per_step"] = cpu
    report = {"command": " ".join(["python -m tools.profile_ps",
                                   *(sys.argv[1:] if argv is None else argv)]),
              "date": datetime.date.today().isoformat(), "machine": bench_report.machine(),
              "load_average": [round(x, 2) for x in os.getloadavg()], **figures}
    bench_report.emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
