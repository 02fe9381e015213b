"""The processes of `launch.local`: one `Process` per TF task, what their exit codes
mean, and `--restart task`, which relaunches a failed task alone.

`--restart task` does for one task what Kubernetes does for one pod of a TFJob
under `restartPolicy: ExitCode`: the same command, the same TF_CONFIG and so the
same port, while the other tasks keep running. It needs parameter servers: a
restarted chief reconnects to the ps and workers that kept serving
(`app.cluster.serving.serve` waits for a chief that left without finishing)
and resumes from the backup; a restarted worker is taken back by the chief's
ClusterCoordinator; a lost ps fails the chief (its variables are gone), which
is then restarted too and resumes from the backup.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from app.cluster.memory import EXIT_CODE as OUT_OF_MEMORY
from app.cluster.preemption import EXIT_CODE as PREEMPTED
from app.cluster.tf_config import TaskLost
from app.state.workdir import ExportFailed

STOP_GRACE_S = 15  # a task told to stop (SIGTERM) saves its backup within it
# Once the lead has finished, every other task ends by itself: a ps or worker of a
# parameter-server cluster when it sees the chief's marker, a MultiWorkerMirrored
# worker once it has exported its own copy as the lead did (seconds, but 15 s were
# too few on a loaded machine), an evaluator once it has evaluated the last
# checkpoint. Only a task that has hung is stopped, after this long.
FINISH_GRACE_S = 300
EVALUATOR_GRACE_S = 300
# A task's last lines are in its pipe when it exits; the copier has them out within
# this long unless the pipe is held open by a process the task started.
COPY_GRACE_S = 60
# What app.train's exit codes mean. Relaunches follow any failure but 2, 5 and 6: a
# configuration or storage mistake, a task out of its memory limit, or a model that
# cannot be exported would fail again, where a lost task, a preemption (the backup
# saved) or a crash need not.
EXIT_CODES = {2: "configuration or storage error", TaskLost.exit_code: "a task was lost",
              PREEMPTED: "preempted, backup saved",
              OUT_OF_MEMORY: "out of its memory limit, runtime.memory_limit_gib",
              ExportFailed.exit_code: "trained, but the export failed"}
# Out of memory again with the same limit; an export that failed after a finished run.
NOT_RETRIED = (0, 2, OUT_OF_MEMORY, ExportFailed.exit_code)


def not_retried() -> str:
    """The failures no relaunch follows, for the launchers' help: "2 (...), 5 (...) and 6 (...)"."""
    codes = [f"{code} ({EXIT_CODES[code]})" for code in NOT_RETRIED if code]
    return ", ".join(codes[:-1]) + " and " + codes[-1]


class Process:
    """One task's process, its output copied line by line under its label."""

    # A task of the tf.data service (app/distribute/data_service.py) serves the trainers and ends
    # only when told: once the lead has finished, not with the others.
    serves_data = False

    def __init__(self, job: str, index: int, spec: dict, train_args: list[str],
                 hear: Callable[[str], None] | None = None):
        self.job, self.index, self.spec, self.train_args = job, index, spec, train_args
        self.hear = hear  # told each line copied (launch.network's step-timed partitions)
        self.label = f"{job}:{index}"
        self.process = subprocess.Popen(
            [sys.executable, "-u", "-m", *self.command()], env=self.environment(),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self._copier = threading.Thread(target=self._copy, daemon=True)
        self._copier.start()
        announce(f"{self.label} started, pid {self.process.pid}")

    def command(self) -> list[str]:
        return ["app.train", *self.train_args]

    def environment(self) -> dict[str, str]:
        return dict(os.environ, TF_CONFIG=json.dumps(
            {"cluster": self.spec, "task": {"type": self.job, "index": self.index}}))

    def _copy(self) -> None:
        prefix = f"[{self.label}]"
        for line in self.process.stdout:
            # app.train prefixes its own log lines; TF's and Keras' are not.
            line = line if line.startswith(prefix) else f"{prefix} {line}"
            sys.stdout.write(line)
            sys.stdout.flush()
            if self.hear:
                self.hear(line.rstrip("\n"))

    def again(self) -> Process:
        """The same task started anew: same command, same TF_CONFIG, same port."""
        return type(self)(self.job, self.index, self.spec, self.train_args, self.hear)

    def stop(self, now: bool = False) -> None:
        """SIGTERM (the task saves a backup, app/cluster/preemption.py), or SIGKILL `now`."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL if now else signal.SIGTERM)

    def finish(self, grace_s: float = STOP_GRACE_S) -> int:
        """Wait for the process to end: SIGTERM after `grace_s`, SIGKILL after another."""
        for escalate in (self.stop, self.process.kill, None):
            try:
                code = self.process.wait(timeout=grace_s)
                break
            except subprocess.TimeoutExpired:
                if escalate is None:
                    raise
                escalate()
        self._copier.join(timeout=COPY_GRACE_S)
        return code


class DataProcess(Process):
    """A dispatcher or tf.data worker: `python -m app.distribute.data_service` with `args`
    (in place of app.train's), outside TF_CONFIG's cluster."""

    serves_data = True

    def command(self):
        return ["app.distribute.data_service", *self.train_args]

    def environment(self):
        return dict(os.environ)


def stop_data(tasks: list[Process]) -> None:
    """Tell the tf.data service's tasks the job is over (SIGTERM; they exit 0)."""
    for task in tasks:
        if task.serves_data:
            task.stop()


def announce(message: str) -> None:
    print(f"[launch] {message}", flush=True)


def exit_text(code: int) -> str:
    """An exit code with its meaning, e.g. "204 (preempted, backup saved)"."""
    return f"{code} ({EXIT_CODES[code]})" if code in EXIT_CODES else str(code)


def grace(task: Process, lead_finished: bool = False) -> float:
    """How long `task` has to exit before it is stopped: FINISH_GRACE_S once the lead
    has finished (it ends by itself), else STOP_GRACE_S; an evaluator may still be
    evaluating the last checkpoint."""
    if task.job == "evaluator":
        return EVALUATOR_GRACE_S
    return FINISH_GRACE_S if lead_finished else STOP_GRACE_S


def restart_alone(tasks: list[Process], lead: Process, max_restarts: int,
                  terminated: threading.Event) -> int:
    """Watch every task; relaunch each that fails, alone, up to `max_restarts`
    times per task (Kubernetes counts a pod's restarts so); the exit code: the
    lead's 0, or the code of the failure not relaunched.

    Per task, not in all: a lost ps takes the chief with it (exit 203), and one
    restart each brings both back. A task that exits 0 (a ps or worker the
    finished chief let go) is left be.
    """
    restarts = dict.fromkeys((t.label for t in tasks), 0)
    while lead.process.poll() != 0 and not terminated.is_set():
        try:
            failed = next((t for t in tasks if t.process.poll() not in (None, 0)), None)
            if failed is None:
                time.sleep(0.5)
                continue
        except KeyboardInterrupt:
            stop_all(tasks, first=lead)
            raise
        code = failed.finish()
        announce(f"{failed.label} exited with {exit_text(code)}")
        if code in NOT_RETRIED or restarts[failed.label] == max_restarts:
            why = "not retried" if code in NOT_RETRIED else "no restart left"
            announce(f"{why}; stopping the other tasks")
            stop_all(tasks, first=lead)
            return max(code, 0) or 1  # a death by signal (-9) is 1
        restarts[failed.label] += 1
        announce(f"restart {restarts[failed.label]} of {max_restarts}: {failed.label} alone, "
                 "with its TF_CONFIG and port")
        tasks[tasks.index(failed)] = again = failed.again()
        lead = again if failed is lead else lead
    if terminated.is_set():
        announce("SIGTERM: passing it to every task (training tasks save a backup); "
                 "no restart")
        return stop_all(tasks, first=lead)
    announce(f"{lead.label} exited with 0; waiting for the other tasks to finish")
    stop_data(tasks)
    for task in tasks:
        if task is not lead:
            code = task.finish(grace(task, lead_finished=True))
            announce(f"{task.label} exited with {exit_text(code)}")
    return 0


def stop_all(tasks: list[Process], first: Process) -> int:
    """SIGTERM every task; wait for `first` (the chief saves its backup while the ps
    tasks still serve it), then the others; `first`'s exit code. Only the tasks
    still running are announced (the others have been)."""
    running = {task.label for task in tasks if task.process.poll() is None}
    for task in tasks:
        task.stop()
    for task in [first] + [t for t in tasks if t is not first]:
        code = task.finish(grace(task))
        if task.label in running:
            announce(f"{task.label} exited with {exit_text(code)}")
    return first.process.returncode
