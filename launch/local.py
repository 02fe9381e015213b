"""`python -m launch.local`: every task of a cluster as a process on this machine.

Each task is `python -m app.train` with its own TF_CONFIG (free local ports
from portpicker) and the remaining arguments; each line it prints comes out
prefixed with its task, `[ps:0]`, `[worker:1]`. When the chief exits, the
other tasks are stopped and the launcher returns the chief's exit code. A
worker that dies early is left dead: the chief carries on without it.

    python -m launch.local --workers 2 --ps 1 --config configs/mnist_ps.toml
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading

from launch.inprocess import cluster_spec

STOP_GRACE_S = 15  # a ps/worker exits about 6 s after the chief


class Task:
    """One task's process, its output copied line by line under its label."""

    def __init__(self, job: str, index: int, spec: dict, train_args: list[str]):
        self.label = f"{job}:{index}"
        env = dict(os.environ, TF_CONFIG=json.dumps(
            {"cluster": spec, "task": {"type": job, "index": index}}))
        self.process = subprocess.Popen(
            [sys.executable, "-u", "-m", "app.train", *train_args], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self._copier = threading.Thread(target=self._copy, daemon=True)
        self._copier.start()
        announce(f"{self.label} started, pid {self.process.pid}")

    def _copy(self) -> None:
        prefix = f"[{self.label}]"
        for line in self.process.stdout:
            # app.train prefixes its own log lines; TF's and Keras' are not.
            sys.stdout.write(line if line.startswith(prefix) else f"{prefix} {line}")
            sys.stdout.flush()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def finish(self) -> int:
        """Wait for the process to end: SIGTERM after the grace period, SIGKILL after another."""
        for escalate in (self.stop, self.process.kill, None):
            try:
                code = self.process.wait(timeout=STOP_GRACE_S)
                break
            except subprocess.TimeoutExpired:
                if escalate is None:
                    raise
                escalate()
        self._copier.join(timeout=5)
        return code


def announce(message: str) -> None:
    print(f"[launch] {message}", flush=True)


def thread_settings(num_workers: int, train_args: list[str]) -> list[str]:
    """`--set` thread pools so that the tasks sharing this host share its cores,
    unless the arguments already choose them."""
    cores = os.cpu_count() or 1
    settings = {"runtime.intra_op_threads": max(1, cores // num_workers),
                # Fewer than workers + 1 can deadlock a ps serving all workers at once.
                "runtime.inter_op_threads": num_workers + 1}
    out = []
    for key, value in settings.items():
        if not any(arg.startswith(key + "=") for arg in train_args):
            out += ["--set", f"{key}={value}"]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.local",
                                     description=__doc__.split("\n")[0],
                                     epilog="Other arguments go to app.train, e.g. --config.")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=1)
    args, train_args = parser.parse_known_args(argv)
    if args.workers < 1 or args.ps < 1:
        parser.error("--workers and --ps must be at least 1")
    spec = cluster_spec(args.workers, args.ps)
    train_args = thread_settings(args.workers, train_args) + train_args
    tasks = [Task(job, i, spec, train_args)
             for job in ("ps", "worker") for i in range(len(spec[job]))]
    chief = Task("chief", 0, spec, train_args)
    try:
        code = chief.process.wait()
    except KeyboardInterrupt:
        chief.stop()
        code = chief.finish()
    if code == 0:  # ps and worker tasks see the chief go and exit by themselves
        announce("chief exited with 0; waiting for the other tasks to finish")
    else:
        announce(f"chief exited with {code}; stopping the other tasks")
        for task in tasks:
            task.stop()
    for task in tasks:
        announce(f"{task.label} exited with {task.finish()}")
    chief.finish()
    return code


if __name__ == "__main__":
    sys.exit(main())
