"""Helpers for the end-to-end tests that run `python -m launch.local`.

Faults are injected at a step the tasks report themselves (`debug.log_every_steps`
makes a training task log `step S`), not after a delay: a loaded machine makes
every run slower, never earlier or later in its own count of steps.
"""

import json
import os
import pathlib
import re
import select
import signal
import subprocess
import sys
from collections.abc import Callable

from app.cluster import preemption
from launch.ports import Ports

STEP = re.compile(r"\[(\S+)\] INFO step (\d+)$")
# How long a SIGKILLed task may take to exit before a held run is released anyway.
EXIT_DEADLINE_S = 120


def launch(*args: str) -> subprocess.Popen:
    """`python -m launch.local ARGS`, its output (all tasks') readable line by line."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    return subprocess.Popen([sys.executable, "-u", "-m", "launch.local", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def signal_on(launcher: subprocess.Popen, plan: list[tuple[Callable[[str], bool], str]],
              sig: int = signal.SIGKILL, release: pathlib.Path | None = None,
              released_by: Callable[[str], bool] | None = None) -> tuple[str, int]:
    """Read the launcher's output to the end; send `sig` to each (trigger, victim) of
    `plan`'s victim (e.g. "worker:1", or "launch": the launcher itself) at the first
    line for which its trigger is true. (all output, how many were sent)

    A signal goes to the process the launcher started as that task, through a pidfd
    opened when the launcher said so (a pid let go and reused cannot be hit), and only
    while it runs: `kill` on a task that has exited but is not yet reaped succeeds
    and leaves its exit code 0, as if the signal had been shrugged off. Such a signal
    is not counted, and a line at the end of the output says so.

    `release`: the run's `debug.hold_file`, created once every signal of `plan` was
    sent and each task it went to has exited (or the output ended): the run held at
    the step that triggered them (`debug.hold_at_step`) goes on without that task.
    `released_by`: a trigger that creates `release` instead, at the first line it is
    true for once every signal was sent. A task told by SIGTERM stops at a step end,
    which a held run reaches once released: it is released once the task says it has
    seen the signal, so that the run cannot end before the signal takes effect.
    """
    lines, due, missed, released = [], list(plan), [], False
    tasks = {"launch": os.pidfd_open(launcher.pid)}
    try:
        for line in launcher.stdout:
            lines.append(line)
            if started := re.match(r"\[launch\] (\S+) started, pid (\d+)", line):
                if (before := tasks.get(started[1])) is not None:  # a relaunch's
                    os.close(before)
                tasks[started[1]] = task_pidfd(int(started[2]), launcher.pid)
            fired = [(t, v) for t, v in due if t(line)]
            for trigger, victim in fired:
                due.remove((trigger, victim))
                task = tasks[victim]
                if task is None or select.select([task], [], [], 0)[0]:  # exited already
                    missed.append(f"[test] {victim} had exited before {signal.Signals(sig).name} "
                                  f"was sent, at: {line}")
                else:
                    signal.pidfd_send_signal(task, sig)
                    if release and released_by is None:
                        select.select([task], [], [], EXIT_DEADLINE_S)  # until it exits
            if (release and not due and not released
                    and (released_by(line) if released_by else fired)):
                release.touch()
                released = True
    finally:
        if release:
            release.touch()  # never leave a run held
        for fd in tasks.values():
            if fd is not None:
                os.close(fd)
    return "".join(lines + missed), len(plan) - len(due) - len(missed)


def task_pidfd(pid: int, launcher: int) -> int | None:
    """A pidfd of the launcher's child `pid` (readable once it has exited), or None
    when that child has exited and been reaped already (`pid` may be another's now)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:  # the parent's pid: the field after the state
            parent = int(f.read().rpartition(")")[2].split()[1])
    except FileNotFoundError:  # reaped since the pidfd was opened: it says it has exited
        return fd
    if parent != launcher:
        os.close(fd)
        return None
    return fd


def signal_when(launcher: subprocess.Popen, trigger: Callable[[str], bool], victim: str,
                sig: int = signal.SIGKILL, release: pathlib.Path | None = None,
                released_by: Callable[[str], bool] | None = None) -> tuple[str, bool]:
    """Send `sig` to task `victim` at the first line for which `trigger` is true; see
    `signal_on`. (all output, whether sent)"""
    output, sent = signal_on(launcher, [(trigger, victim)], sig, release, released_by)
    return output, bool(sent)


def hold(step: int, release: pathlib.Path) -> tuple[str, ...]:
    """The `--set`s that hold a run's training tasks past `step` until `release` exists
    (`debug.hold_at_step`): pass `release` to `signal_on`, which creates it once the
    tasks it signalled have exited. Under parameter servers the chief logs the steps it
    schedules, ahead of the workers, so a kill read from its log may otherwise land
    after the run last needed the task, or after the run ended. A task acts on SIGTERM
    at a step end, which a held task reaches only once released: pass `released_by`
    too, a line that says it has seen the signal."""
    return ("--set", f"debug.hold_at_step={step}", "--set", f"debug.hold_file={release}")


def sigterm_seen(task: str = "") -> Callable[[str], bool]:
    """A `released_by` trigger: a MultiWorkerMirrored worker (`task`, or any) says it has
    seen SIGTERM and is agreeing with the others on a step to save at
    (`app.cluster.preemption.watcher`, polled once a second: a run that ends sooner
    would otherwise not stop)."""
    said = f"] INFO {preemption.AGREEING}"
    if task:
        return lambda line: line.startswith(f"[{task}{said}")
    return lambda line: said in line


def kill_on_line(launcher: subprocess.Popen, prefix: str, victim: str) -> tuple[str, bool]:
    """SIGKILL `victim` at the first line starting with `prefix`; see `signal_when`."""
    return signal_when(launcher, lambda line: line.startswith(prefix), victim)


def reached(reporter: str, step: int) -> Callable[[str], bool]:
    """A trigger: task `reporter` has logged step `step` or later."""
    def trigger(line: str) -> bool:
        m = STEP.match(line.rstrip("\n"))
        return bool(m) and m[1] == reporter and int(m[2]) >= step
    return trigger


def signal_at_step(launcher: subprocess.Popen, reporter: str, step: int, victim: str,
                   sig: int = signal.SIGKILL, release: pathlib.Path | None = None,
                   released_by: Callable[[str], bool] | None = None) -> tuple[str, bool]:
    """Send `sig` to `victim` once task `reporter` has logged step `step` or later;
    `release`, `released_by`: see `signal_on`."""
    return signal_when(launcher, reached(reporter, step), victim, sig, release, released_by)


def signal_at_steps(launcher: subprocess.Popen, reporter: str, victims: dict[int, str],
                    sig: int = signal.SIGKILL, release: pathlib.Path | None = None
                    ) -> tuple[str, int]:
    """Send `sig` to each of `victims` ({step: task}) once task `reporter` has logged
    that step or later; `release`: see `signal_on`. (all output, how many were sent)"""
    return signal_on(launcher, [(reached(reporter, step), victim)
                                for step, victim in sorted(victims.items())], sig, release)


def steps_reported(output: str, task: str) -> list[int]:
    """The steps `task` logged, in order."""
    return [int(m[2]) for line in output.splitlines()
            if (m := STEP.match(line)) and m[1] == task]


def run_workers(*args: str, timeout: float = 300) -> list[str]:
    """`python ARGS` as both tasks of a 2-worker TF_CONFIG cluster, at once; their
    outputs, each checked to have exited 0."""
    with Ports() as ports:  # held until both have run (launch/ports.py)
        workers = ports.addresses("localhost", 2)
        procs = []
        for i in range(2):
            tf_config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}}
            env = {**os.environ, "TF_CONFIG": json.dumps(tf_config)}
            procs.append(subprocess.Popen([sys.executable, *args], env=env, text=True,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, output in zip(procs, outputs, strict=True):
        assert p.returncode == 0, output[-5000:]
    return outputs
