"""Memory and CPU time of a process and its descendants, read from /proc (Linux).

`tools.bench` polls these while a run is going: a cluster of `launch.local` is
a tree of processes, and each process's cluster task type comes from its
TF_CONFIG, so the figures can be summed by task type.
"""

from __future__ import annotations

import json
import os
import pathlib


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
    return _field(pids, "status", "VmHWM:", 1024)


def read_chars(pids: list[int]) -> dict[int, tuple[str, int]]:
    """Per pid: its cluster task type (`task_type`) and the bytes it has read so far
    through read() and pread() calls (`rchar` of /proc/<pid>/io: from the page cache
    or the disk alike)."""
    return _field(pids, "io", "rchar:", 1)


def _field(pids: list[int], name: str, key: str, unit: int) -> dict[int, tuple[str, int]]:
    """Per pid: its task type and the number after `key` in /proc/<pid>/<name>, times
    `unit`; a process that has ended meanwhile is left out."""
    found = {}
    for p in pids:
        try:
            text = pathlib.Path(f"/proc/{p}/{name}").read_text()
        except OSError:
            continue
        task = task_type(p)
        if task is None:
            continue
        for line in text.splitlines():
            if line.startswith(key):
                found[p] = task, int(line.split()[1]) * unit
    return found
