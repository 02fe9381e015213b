"""`python -m launch.slurm.local_cluster start|stop|status|install`: a one-node SLURM cluster.

    make slurm-cluster          # = python -m launch.slurm.local_cluster start
    sbatch --ntasks=4 launch/slurm/train.sbatch --set task.model=mlp
    make slurm-cluster-stop     # = python -m launch.slurm.local_cluster stop

`start` installs Debian's SLURM and MUNGE packages if they are missing
(apt-get; `install` does only that, CI's set-up step), writes `slurm.conf` and
every daemon's state, logs and sockets under `--dir` (default /tmp/tf-slurm),
starts munged, slurmctld and slurmd in the foreground of sessions of their
own, records their process ids, and returns once the node is idle. `stop`
cancels the cluster's jobs and stops exactly those processes. Needs root:
slurmd runs each job as its user, and munged runs as the `munge` user. A
missing prerequisite (not root, no apt-get, a port in use) is exit code 2 and
one line that names it and the fix.

munged gets a key and a socket of its own under `--dir`, so that a system
munged, if any, is left alone. The node is this machine, under its hostname
(`slurmd -C`), declared with `--cpus` CPUs whatever the real count
(`SlurmdParameters=config_overrides`), so that a one-node job can ask for as many
tasks as a real multi-node one. SLURM's commands read /etc/slurm/slurm.conf
unless SLURM_CONF says otherwise: `start` links it to this cluster's config
when no such file exists (and `stop` removes the link); otherwise export the
SLURM_CONF that `status` prints.
"""

from __future__ import annotations

import argparse
import errno
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time

from launch.slurm.slurm_conf import KILL_WAIT_S, node_line, slurm_conf

DEFAULT_DIR = pathlib.Path("/tmp/tf-slurm")
SYSTEM_CONF = pathlib.Path("/etc/slurm/slurm.conf")
# The executables this cluster runs, and the Debian package of each.
PACKAGES = {"munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd",
            "sbatch": "slurm-client"}
DAEMONS = ("munged", "slurmctld", "slurmd")  # started in this order, stopped in reverse
START_TIMEOUT_S = 60
STOP_GRACE_S = 15


class ClusterError(RuntimeError):
    """A prerequisite is missing or a daemon did not start; the message names the fix."""


def which(name: str) -> str | None:
    """`name` on PATH or in the sbin directories (a non-login root shell may lack them)."""
    return shutil.which(name, path=os.pathsep.join(
        [os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/bin"]))


def missing_prerequisite() -> str | None:
    """Why `start` cannot work here (not root; packages missing and no apt-get), or None."""
    if os.geteuid() != 0:
        return ("the local SLURM cluster needs root (slurmd runs jobs as their users, munged "
                "as the munge user): run it as root, e.g. sudo make slurm-cluster")
    missing = [pkg for exe, pkg in PACKAGES.items() if which(exe) is None]
    if missing and which("apt-get") is None:
        return (f"SLURM's packages {' '.join(missing)} are not installed and there is no "
                "apt-get to install them: install them with this system's package manager")
    return None


def install_packages() -> None:
    """apt-get install the packages whose executables are missing (apt-get update first
    only if the install fails: a fresh CI image may have no package lists)."""
    missing = sorted({pkg for exe, pkg in PACKAGES.items() if which(exe) is None})
    if not missing:
        return
    print(f"installing {' '.join(missing)} (apt-get)", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing]
    result = subprocess.run(install, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        result = subprocess.run(install, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:]
        raise ClusterError(f"apt-get install {' '.join(missing)} failed ({' '.join(tail)}): "
                           "run it by hand to see why")


def check_port(port: int, flag: str) -> None:
    with socket.socket() as s:
        # As the daemons bind: the last cluster's connections in TIME_WAIT do not count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise ClusterError(f"port {port} is in use (see: ss -ltnp 'sport = :{port}'): stop "
                               f"what listens there, or pass {flag} with a free port") from None


def pid_file(state: pathlib.Path, daemon: str) -> pathlib.Path:
    return state / f"{daemon}.started.pid"


def running(state: pathlib.Path, daemon: str) -> int | None:
    """The pid of `daemon` as this module started it, if that process still runs it
    (a recycled pid belongs to some other program and is not ours to signal)."""
    try:
        pid = int(pid_file(state, daemon).read_text())
        exe = os.readlink(f"/proc/{pid}/exe")
    except (OSError, ValueError):
        return None
    # Debian's /usr/sbin/slurmd is a link (alternatives) to slurmd-wlm.
    return pid if exe == os.path.realpath(which(daemon) or daemon) else None


def client_env(state: pathlib.Path) -> dict[str, str]:
    return {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}


def spawn(state: pathlib.Path, daemon: str, args: list[str], **kwargs) -> None:
    log = open(state / "log" / f"{daemon}.out", "ab")  # the child inherits it
    proc = subprocess.Popen([which(daemon) or daemon, *args], stdin=subprocess.DEVNULL,
                            stdout=log, stderr=log, start_new_session=True,
                            env=client_env(state), **kwargs)
    pid_file(state, daemon).write_text(f"{proc.pid}\n")


def wait_for(what: str, ready, state: pathlib.Path, daemon: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():
        if running(state, daemon) is None:
            raise ClusterError(f"{daemon} exited while starting: see {state}/log/{daemon}*")
        if time.monotonic() > deadline:
            raise ClusterError(f"{what} not within {START_TIMEOUT_S} s: see {state}/log/")
        time.sleep(0.5)


def start_munge(state: pathlib.Path) -> None:
    """munged as the munge user, with a key and socket under `state` (munged refuses
    a key or a socket directory that other users could write, or could not enter)."""
    import pwd

    munge = pwd.getpwnam("munge")
    home = state / "munge"
    home.mkdir(exist_ok=True)
    os.chown(home, munge.pw_uid, munge.pw_gid)
    home.chmod(0o755)  # clients must reach the socket; the key itself is 0600
    key = home / "munge.key"
    as_munge = {"user": munge.pw_uid, "group": munge.pw_gid, "extra_groups": []}
    if not key.exists():
        subprocess.run([which("mungekey") or "mungekey", "--create", f"--keyfile={key}"],
                       check=True, **as_munge)
    sock = home / "munge.socket.2"
    spawn(state, "munged", ["--foreground", f"--socket={sock}", f"--key-file={key}",
                            f"--pid-file={home}/munged.pid", f"--log-file={home}/munged.log",
                            f"--seed-file={home}/munged.seed"], **as_munge)
    wait_for("munged's socket", sock.exists, state, "munged")


def node_state(state: pathlib.Path) -> str:
    result = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True,
                            env=client_env(state))
    return result.stdout.strip() if result.returncode == 0 else ""


def start(state: pathlib.Path, cpus: int, ctld_port: int, slurmd_port: int) -> None:
    if all(running(state, d) for d in DAEMONS):
        print(f"already running ({state})")
        return
    if any(running(state, d) for d in DAEMONS):
        raise ClusterError(f"a part of the cluster in {state} still runs: "
                           f"python -m launch.slurm.local_cluster stop --dir {state}, then start")
    if reason := missing_prerequisite():
        raise ClusterError(reason)
    check_port(ctld_port, "--ctld-port")
    check_port(slurmd_port, "--slurmd-port")
    install_packages()
    for sub in ("slurmctld", "slurmd", "run", "log"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    conf = state / "slurm.conf"
    slurmd_c = subprocess.run([which("slurmd") or "slurmd", "-C"], capture_output=True,
                              text=True, check=True).stdout
    conf.write_text(slurm_conf(state, node_line(slurmd_c, cpus), ctld_port, slurmd_port))
    if not SYSTEM_CONF.exists() and not SYSTEM_CONF.is_symlink():
        SYSTEM_CONF.parent.mkdir(parents=True, exist_ok=True)
        SYSTEM_CONF.symlink_to(conf)  # plain `sbatch` finds this cluster
    try:
        start_munge(state)
        spawn(state, "slurmctld", ["-D", "-f", str(conf)])
        spawn(state, "slurmd", ["-D", "-f", str(conf)])
        wait_for("the node idle", lambda: node_state(state) == "idle", state, "slurmd")
    except ClusterError:
        stop(state)  # what did start, so that the next `start` begins clean
        raise
    print(f"SLURM cluster up: 1 node, {cpus} CPUs, state in {state}")
    print(f"export SLURM_CONF={conf}" if os.path.realpath(SYSTEM_CONF) != str(conf)
          else f"({SYSTEM_CONF} links to {conf})")


def stop(state: pathlib.Path) -> None:
    """Cancel the cluster's jobs (their tasks are slurmd's children's), then stop the
    daemons this module started, newest first; nothing else is signalled."""
    if running(state, "slurmctld") and running(state, "slurmd"):
        env = client_env(state)
        if jobs := _job_ids(env):
            print(f"cancelling jobs {' '.join(jobs)}")
            subprocess.run(["scancel", *jobs], env=env, capture_output=True)
        deadline = time.monotonic() + KILL_WAIT_S + STOP_GRACE_S  # SIGTERM, SIGKILL, gone
        while _job_ids(env) and time.monotonic() < deadline:
            time.sleep(1)
    for daemon in reversed(DAEMONS):
        pid = running(state, daemon)
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_GRACE_S
            while running(state, daemon) and time.monotonic() < deadline:
                time.sleep(0.2)
            if running(state, daemon):
                os.kill(pid, signal.SIGKILL)
            print(f"stopped {daemon} (pid {pid})")
        pid_file(state, daemon).unlink(missing_ok=True)
    if SYSTEM_CONF.is_symlink() and os.readlink(SYSTEM_CONF) == str(state / "slurm.conf"):
        SYSTEM_CONF.unlink()


def _job_ids(env: dict[str, str]) -> list[str]:
    result = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True,
                            env=env)
    return result.stdout.split() if result.returncode == 0 else []


def status(state: pathlib.Path) -> bool:
    """Print each daemon's pid or `not running`, and the node; True if all run."""
    pids = {d: running(state, d) for d in DAEMONS}
    for daemon, pid in pids.items():
        print(f"{daemon}: {f'running, pid {pid}' if pid else 'not running'}")
    if all(pids.values()):
        print(f"node: {node_state(state) or 'unknown'}")
        print(f"export SLURM_CONF={state / 'slurm.conf'}")
    return all(pids.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.slurm.local_cluster",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("start", "stop", "status", "install"))
    parser.add_argument("--dir", type=pathlib.Path, default=DEFAULT_DIR,
                        help=f"config, state and logs (default {DEFAULT_DIR})")
    parser.add_argument("--cpus", type=int, default=8,
                        help="CPUs the node declares (default 8: train.sbatch's 4 tasks x 2)")
    parser.add_argument("--ctld-port", type=int, default=6817, help="slurmctld's port")
    parser.add_argument("--slurmd-port", type=int, default=6818, help="slurmd's port")
    args = parser.parse_args(argv)
    state = args.dir.resolve()
    try:
        if args.command == "start":
            start(state, args.cpus, args.ctld_port, args.slurmd_port)
        elif args.command == "install":
            if reason := missing_prerequisite():
                raise ClusterError(reason)
            install_packages()
        elif args.command == "stop":
            stop(state)
        else:
            return 0 if status(state) else 1
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
