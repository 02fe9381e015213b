"""Helpers for the end-to-end tests that run `python -m launch.local`."""

import os
import re
import signal
import subprocess
import time


def kill_on_line(launcher: subprocess.Popen, prefix: str, victim: str,
                 delay_s: float = 0.0) -> tuple[str, bool]:
    """Read the launcher's output to the end; SIGKILL task `victim` (e.g. "worker:1")
    `delay_s` after the first line starting with `prefix`. (all output, whether it killed)"""
    lines, pids, killed = [], {}, False
    for line in launcher.stdout:
        lines.append(line)
        if started := re.match(r"\[launch\] (\S+) started, pid (\d+)", line):
            pids[started[1]] = int(started[2])
        if not killed and line.startswith(prefix):
            time.sleep(delay_s)
            os.kill(pids[victim], signal.SIGKILL)
            killed = True
    return "".join(lines), killed
