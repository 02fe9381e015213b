"""A network on one machine: every task of a local cluster behind its own link.

`launch.local --link RATE[,DELAY]` re-runs itself in a private network
namespace (`unshare --net`) whose loopback is the only interface. There an
HTB root qdisc on `lo` gets two classes per task port, one per direction,
each limited to RATE; u32 filters send packets whose destination port is the
task's to its "in" class and packets whose source port is the task's to its
"out" class. DELAY, when given, is a netem qdisc under each class, so a
packet to or from a task waits DELAY once on its way.
`--partition TASK@SECONDS[+DURATION]` cuts a task off, SECONDS after every
task's server answers: a u32 filter ahead of
the shaping ones sends its port's packets, both ways, to a class whose queue
holds nothing (this kernel has no `action drop`), until it is removed again.

The honest limit: a TCP connection has the server's listening port at one end
and an ephemeral port at the client's. Only listening ports are known in
advance, so a task's link carries the traffic into and out of its *server*.
TensorFlow's gRPC runtime moves a tensor between tasks by having the
receiver ask the sender's server for it (RecvTensor), so the tensor itself
crosses the *sender's* "out" link and only the small request crosses an "in"
link. Under parameter servers, variable reads cross the ps task's out link
and gradient pushes cross the pushing worker's out link (the ps fetches
them); MultiWorkerMirrored's all-reduce chunks cross the sending worker's out
link. What a real network adds and this one does not: the receiving end's
"in" link, a worker's NIC taking the reads from every ps task at once or a ps
task's NIC taking every worker's gradients. A partitioned task likewise can
still reach the others' servers as a client: the chief's closures to a
partitioned worker stop, and what the ps fetches from it times out, but a
read it had already asked a ps for can still come back.
Within the namespace IPv6 is turned off and the cluster uses
127.0.0.1: u32's fixed offsets matched only part of the IPv6 traffic on
loopback (Linux 6.18), and a port that half escapes its link is no link.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from typing import NamedTuple

# Set on the namespace's launcher: the inode of the network namespace it came
# from, so that it can prove it is somewhere else before it touches `lo`.
NETNS_ENV = "LAUNCH_LOCAL_PARENT_NETNS"
HOST = "127.0.0.1"

RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
DELAY_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_SHAPING_PRIO = 1000  # after every partition filter (prio 10 + task index)
BLACKHOLE = "1:2"  # the class of a cut task's packets: its queue holds none
# A step a training task logs (debug.log_every_steps), as launch.local copies it.
_STEP = re.compile(r"\[(\S+)\] INFO step (\d+)$")


class NetworkError(RuntimeError):
    """A link cannot be set up; the message names what is missing and the fix."""


@dataclasses.dataclass(frozen=True)
class Link:
    """One task's link: `rate_bits` per second each way, `delay_s` added each way."""
    rate_bits: int
    delay_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Partition:
    """Cut `task` ("worker:1") off `at_s` seconds after every task serves, or once the
    lead task has logged step `at_step` (`debug.log_every_steps`), for `duration_s`
    seconds (None: until the run ends)."""
    task: str
    at_s: float | None
    duration_s: float | None = None
    at_step: int | None = None


def parse_link(text: str) -> Link:
    """`RATE[,DELAY]` as tc writes them: "1gbit", "100mbit,0.5ms", "10gbit,100us"."""
    rate_text, _, delay_text = text.partition(",")
    rate = _quantity(rate_text, RATE_UNITS, "--link", text,
                     "a rate such as 100mbit, 1gbit or 10gbit (units: bit, kbit, mbit, gbit, "
                     "tbit; bits per second, as tc counts them)")
    if rate < 1000:
        raise ValueError(f"--link {text!r}: a rate of {rate:g} bit/s is too slow for a "
                         "cluster to start; give at least 1kbit")
    delay = 0.0
    if delay_text:
        delay = _quantity(delay_text, DELAY_UNITS, "--link", text,
                          "RATE,DELAY with a delay such as 0.1ms, 100us or 2ms")
    return Link(int(rate), delay)


def _quantity(text: str, units: dict[str, float], flag: str, whole: str, fix: str) -> float:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*", text)
    if not match or match[2].lower() not in units:
        raise ValueError(f"{flag} {whole!r}: cannot read {text.strip()!r}; write {fix}")
    return float(match[1]) * units[match[2].lower()]


def parse_partition(text: str, tasks: Iterable[str]) -> Partition:
    """`TASK@SECONDS[+DURATION]` or `TASK@stepN[+DURATION]`, e.g. "worker:1@40+30" or
    "worker:1@step50+15", for one of `tasks`."""
    match = re.fullmatch(r"(\w+:\d+)@(step)?(\d+(?:\.\d+)?)(?:\+(\d+(?:\.\d+)?))?",
                         text.strip())
    if not match or (match[2] and "." in match[3]):
        raise ValueError(f"--partition {text!r}: write TASK@SECONDS[+DURATION], e.g. "
                         "worker:1@40+30 (cut worker 1 off 40 s after every task serves, "
                         "for 30 s), or TASK@stepN[+DURATION], e.g. worker:1@step50+15 (once "
                         "the chief logs step 50: --set debug.log_every_steps=10)")
    tasks = list(tasks)
    if match[1] not in tasks:
        raise ValueError(f"--partition {text!r}: this cluster has no task {match[1]}; "
                         f"its tasks are {', '.join(tasks)}")
    duration = float(match[4]) if match[4] else None
    if match[2]:
        return Partition(match[1], None, duration, at_step=int(match[3]))
    return Partition(match[1], float(match[3]), duration)


def task_ports(spec: dict[str, list[str]]) -> dict[str, int]:
    """{"worker:1": port, ...} for every task of a cluster spec, in a fixed order."""
    return {f"{job}:{i}": int(address.rpartition(":")[2])
            for job in sorted(spec) for i, address in enumerate(spec[job])}


def _classes(index: int) -> tuple[str, str]:
    """The HTB minor ids (hex) of task `index`'s "in" and "out" classes."""
    return f"{0x10 + 2 * index:x}", f"{0x11 + 2 * index:x}"


def shaping_commands(ports: dict[str, int], link: Link, dev: str = "lo") -> list[list[str]]:
    """The tc command lines that give each task port its own `link`."""
    tc = ["tc"]
    rate = f"{link.rate_bits}bit"
    # No default class: packets of no task port (none here) bypass the classes.
    commands = [[*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb"],
                [*tc, "class", "add", "dev", dev, "parent", "1:", "classid", BLACKHOLE,
                 "htb", "rate", "1gbit"],
                [*tc, "qdisc", "add", "dev", dev, "parent", BLACKHOLE, "handle", "2:",
                 "pfifo", "limit", "0"]]
    for index, port in enumerate(ports.values()):
        for minor, field in zip(_classes(index), ("dport", "sport"), strict=True):
            # quantum: HTB's default (rate / 10) draws a kernel warning above ~16 Mbit/s.
            commands.append([*tc, "class", "add", "dev", dev, "parent", "1:",
                             "classid", f"1:{minor}", "htb", "rate", rate, "ceil", rate,
                             "quantum", "65536"])
            if link.delay_s:
                commands.append([*tc, "qdisc", "add", "dev", dev, "parent", f"1:{minor}",
                                 "handle", f"{minor}:", "netem", "delay",
                                 f"{round(link.delay_s * 1e6)}us"])
            commands.append(_filter(dev, _SHAPING_PRIO, field, port, f"1:{minor}"))
    return commands


def _filter(dev: str, prio: int, field: str, port: int, flowid: str) -> list[str]:
    return ["tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip",
            "prio", str(prio), "u32", "match", "ip", field, str(port), "0xffff",
            "flowid", flowid]


def partition_commands(ports: dict[str, int], task: str, cut: bool,
                       dev: str = "lo") -> list[list[str]]:
    """The tc command lines that cut `task` off (`cut`) or let it back on."""
    index = list(ports).index(task)
    prio = 10 + index  # ahead of the shaping filters; one prio per task, to delete it alone
    if not cut:
        return [["tc", "filter", "del", "dev", dev, "parent", "1:", "protocol", "ip",
                 "prio", str(prio)]]
    return [_filter(dev, prio, field, ports[task], BLACKHOLE) for field in ("dport", "sport")]


def preflight() -> str | None:
    """Why links cannot be made here (a message that says the fix), or None."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return (f"--link needs {' and '.join(f'`{t}`' for t in missing)} from iproute2, "
                "not found on PATH; install iproute2 (apt-get install iproute2, or "
                "dnf install iproute iproute-tc)")
    if shutil.which("unshare") is None:
        return ("--link needs `unshare` from util-linux, not found on PATH; install "
                "util-linux (apt-get install util-linux)")
    if os.geteuid() != 0:
        return ("--link needs root to make a network namespace and shape its loopback "
                "(CAP_SYS_ADMIN and CAP_NET_ADMIN): run the launcher as root, e.g. "
                "sudo -E python -m launch.local ...")
    problem = probe_namespace()
    if problem:
        return (f"--link: network namespaces are not permitted here ({problem}); in a "
                "container, start it with --privileged or --cap-add SYS_ADMIN "
                "--cap-add NET_ADMIN")
    return None


def probe_namespace() -> str | None:
    """None if `unshare --net` works here, else what it said."""
    result = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True,
                            timeout=30)
    if result.returncode == 0:
        return None
    return result.stderr.strip() or f"unshare --net exited with {result.returncode}"


def netns_id() -> str:
    """This process's network namespace, e.g. "net:[4026531833]"."""
    return os.readlink("/proc/self/ns/net")


def run_in_namespace(python_args: list[str]) -> int:
    """Run `python <python_args>` in a network namespace of its own; its exit code."""
    env = dict(os.environ, **{NETNS_ENV: netns_id()})
    process = subprocess.Popen(["unshare", "--net", "--", sys.executable, "-u", *python_args],
                               env=env)  # unshare execs python: process is the launcher
    # SIGTERM is sent to this process alone: pass it on, and the launcher stops its tasks.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: process.send_signal(signum))
    try:
        return process.wait()
    except KeyboardInterrupt:  # it had the same SIGINT: let it stop its tasks
        return process.wait()
    finally:
        signal.signal(signal.SIGTERM, previous)


def inside() -> bool:
    """Whether this process was started by `run_in_namespace`."""
    return NETNS_ENV in os.environ


def setup_loopback() -> None:
    """Bring this namespace's loopback up, IPv4 only (see the module docstring)."""
    if os.environ.get(NETNS_ENV) == netns_id():
        # Never shape the loopback of the machine's own namespace.
        raise NetworkError(f"refusing to shape `lo`: {NETNS_ENV} says this process is still "
                           f"in the namespace it started from ({netns_id()}); unset "
                           f"{NETNS_ENV} and run the launcher again")
    ipv6 = "/proc/sys/net/ipv6/conf/lo/disable_ipv6"
    if os.path.exists(ipv6):
        with open(ipv6, "w") as f:
            f.write("1")
    run([["ip", "link", "set", "lo", "up"]])


def run(commands: list[list[str]]) -> None:
    """Run each command; NetworkError with the command and its error on a failure."""
    for command in commands:
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode:
            raise NetworkError(explain(command, result.stderr))


def explain(command: list[str], stderr: str) -> str:
    """The error of a failed command, with the fix where it is known."""
    text = f"`{' '.join(command)}` failed: {stderr.strip()}"
    if "netem" in command and "unknown" in stderr.lower():
        text += ("; this kernel has no netem qdisc, which a DELAY needs: load it "
                 "(modprobe sch_netem; on Ubuntu it comes with "
                 "linux-modules-extra-$(uname -r)), or give --link a RATE alone")
    return text


class Links:
    """The links of one cluster's tasks on this namespace's `lo`, and the
    partitions scheduled on them."""

    def __init__(self, link: Link, ports: dict[str, int], announce: Callable[[str], None]):
        self.ports, self.announce = ports, announce
        self._timers: list[threading.Timer] = []
        self._lock, self._cancelled = threading.Lock(), threading.Event()
        self._lead, self._by_step = "chief:0", []
        # A relaunch (--max-restarts) brings new ports: start from a bare `lo`.
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
        run(shaping_commands(ports, link))

    def schedule(self, partitions: Iterable[Partition], serving: Iterable[str],
                 lead: str = "chief:0") -> None:
        """Start the clocks of the timed `partitions` once every task of `serving`
        accepts connections: counted from the launch, they would also count
        TensorFlow's start-up, which takes 5 s on an idle machine and 30 s on a busy
        one. The others wait for task `lead` to log their step (`heard`): the
        training's own progress, the same on a loaded machine as on an idle one."""
        ports = [self.ports[task] for task in serving]
        timed = [p for p in partitions if p.at_step is None]
        self._lead, self._by_step = lead, [p for p in partitions if p.at_step is not None]
        if timed:
            threading.Thread(target=self._schedule_when_up, args=(timed, ports),
                             daemon=True).start()

    def heard(self, line: str) -> None:
        """A line of a task's output: a step the lead task logged starts the cuts due."""
        step = _STEP.match(line)
        if not (step and step[1] == self._lead and self._by_step):
            return
        with self._lock:
            due = [p for p in self._by_step if p.at_step <= int(step[2])]
            self._by_step = [p for p in self._by_step if p not in due]
            for p in due:
                if not self._cancelled.is_set():
                    self._start(0.0, p.task, True)
                    if p.duration_s is not None:
                        self._start(p.duration_s, p.task, False)

    def _start(self, after_s: float, task: str, cut: bool) -> None:
        timer = threading.Timer(after_s, self.set_cut, (task, cut))
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    def _schedule_when_up(self, partitions: list[Partition], ports: list[int]) -> None:
        while not all(_answers(port) for port in ports):
            if self._cancelled.wait(0.5):
                return
        self.announce("every task serves; partitions count from now")
        with self._lock:
            for p in partitions:
                events = [(p.at_s, True)]
                if p.duration_s is not None:
                    events.append((p.at_s + p.duration_s, False))
                for at_s, cut in events:
                    if not self._cancelled.is_set():
                        self._start(at_s, p.task, cut)

    def set_cut(self, task: str, cut: bool) -> None:
        """Cut `task` off the network, or let it back on."""
        # What its link carried, read while the cut holds: the same at the cut and at
        # the reconnection, nothing passed.
        carried = None if cut else self.report([task])
        try:
            run(partition_commands(self.ports, task, cut))
        except NetworkError as e:  # on a timer's thread: say so, the run goes on
            self.announce(f"could not {'cut' if cut else 'reconnect'} {task}: {e}")
            return
        self.announce(f"{'partitioned' if cut else 'reconnected'} {task}; its link so far: "
                      f"{carried or self.report([task])}")

    def cancel(self) -> None:
        """Forget the partitions that have not happened yet."""
        with self._lock:
            self._cancelled.set()
            for timer in self._timers:
                timer.cancel()

    def report(self, tasks: Iterable[str] | None = None) -> str:
        """The bytes the links of `tasks` (all by default) carried so far:
        "ps:0 in 1.2 MiB out 850.3 MiB, ..."."""
        shown = subprocess.run(["tc", "-s", "class", "show", "dev", "lo"],
                               capture_output=True, text=True).stdout
        carried = link_bytes(self.ports, shown)
        return ", ".join(f"{task} in {carried[task][0] / 2**20:.1f} MiB "
                         f"out {carried[task][1] / 2**20:.1f} MiB"
                         for task in (self.ports if tasks is None else tasks))


def _answers(port: int) -> bool:
    """Whether a server accepts connections on `port` of this namespace's loopback."""
    try:
        with socket.create_connection((HOST, port), timeout=1):
            return True
    except OSError:
        return False


class Counters(NamedTuple):
    sent_bytes: int
    dropped: int  # packets
    overlimits: int  # times a packet had to wait for the class's rate


def class_counters(tc_output: str) -> dict[str, Counters]:
    """{classid: its counters} from `tc -s class show`."""
    found = re.findall(r"^class htb (\S+) .*\n\s*Sent (\d+) bytes \d+ pkt "
                       r"\(dropped (\d+), overlimits (\d+)", tc_output, flags=re.MULTILINE)
    return {classid: Counters(*map(int, numbers)) for classid, *numbers in found}


def link_bytes(ports: dict[str, int], tc_output: str) -> dict[str, tuple[int, int]]:
    """{task: (bytes into its port, bytes out of it)} from `tc -s class show`."""
    counters = class_counters(tc_output)
    return {task: tuple(counters.get(f"1:{minor}", Counters(0, 0, 0)).sent_bytes
                        for minor in _classes(index))
            for index, task in enumerate(ports)}
