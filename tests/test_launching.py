"""tests/launching.py's fault injection: a signal reaches the task the launcher
started, while it runs, or is reported as missed; never a task that has exited."""

import subprocess
import sys

from tests import launching

# Stands for launch.local: starts task a:0, which exits 0 at once, and b:0, which
# runs; once a:0 has exited (not reaped: a zombie, as a task is between its exit and
# the launcher's next poll) it prints "go", then each task's exit code.
LAUNCHER = """
import os, subprocess, sys
a = subprocess.Popen([sys.executable, "-c", "pass"])
print(f"[launch] a:0 started, pid {a.pid}", flush=True)
b = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(f"[launch] b:0 started, pid {b.pid}", flush=True)
os.waitid(os.P_PID, a.pid, os.WEXITED | os.WNOWAIT)
print("go", flush=True)
print(f"a:0 exited with {a.wait()}, b:0 with {b.wait()}", flush=True)
"""


def test_a_signal_reaches_a_running_task_and_is_missed_on_one_that_has_exited():
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE,
                                text=True)
    go = lambda line: line == "go\n"  # noqa: E731
    output, sent = launching.signal_on(launcher, [(go, "a:0"), (go, "b:0")])
    launcher.wait(timeout=60)
    # os.kill would have "reached" a:0 too, and it would still have exited with 0.
    assert sent == 1, output
    assert "a:0 exited with 0, b:0 with -9" in output
    assert output.endswith("[test] a:0 had exited before SIGKILL was sent, at: go\n")
