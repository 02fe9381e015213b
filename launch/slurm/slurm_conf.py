"""The slurm.conf of `launch.slurm.local_cluster`: one node, every file under one directory.

Each setting that is not SLURM's default says why it is here.
"""

from __future__ import annotations

import pathlib

# Seconds between SIGTERM and SIGKILL when a job is cancelled, requeued or out of
# time: how long a training task has to save its backup and leave (SLURM's
# default is 30; a loaded 2-core machine took 18 s for a PS job of 3 tasks).
KILL_WAIT_S = 60


def node_line(slurmd_c: str, cpus: int) -> str:
    """The node `slurmd -C` printed (`slurmd_c`), with `cpus` CPUs (one core each)."""
    fields = dict(f.split("=", 1) for f in slurmd_c.split()[:-1] if "=" in f)  # less UpTime
    return (f"NodeName={fields['NodeName']} CPUs={cpus} Boards=1 SocketsPerBoard=1 "
            f"CoresPerSocket={cpus} ThreadsPerCore=1 RealMemory={fields['RealMemory']} "
            "State=UNKNOWN")


def slurm_conf(state: pathlib.Path, node: str, ctld_port: int, slurmd_port: int) -> str:
    """slurm.conf of a one-node cluster whose files are all under `state`."""
    host = node.split()[0].removeprefix("NodeName=")
    return f"""\
# Written by `python -m launch.slurm.local_cluster start`; rewritten at each start.
ClusterName=tf-local
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire: also how long a requeued job waits before it may start again
# (SLURM default 120 s; short here, so that a requeue test need not wait).
AuthInfo=socket={state}/munge/munge.socket.2,cred_expire=10
StateSaveLocation={state}/slurmctld
SlurmdSpoolDir={state}/slurmd
SlurmctldPidFile={state}/run/slurmctld.pid
SlurmdPidFile={state}/run/slurmd.pid
SlurmctldLogFile={state}/log/slurmctld.log
SlurmdLogFile={state}/log/slurmd.log
JobCompType=jobcomp/filetxt
JobCompLoc={state}/log/jobcomp.log
# No cgroups: this may be a container. Processes are tracked by parent id.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# CPUs are the consumable resource, not memory: tasks share the machine's RAM.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# The node may declare more CPUs than it has (several tasks per core).
SlurmdParameters=config_overrides
ReturnToService=2
# Look for jobs to start every 5 s (SLURM's default 60): a requeued job waits
# for the next pass once it is eligible again.
SchedulerParameters=sched_interval=5
# A batch job may be requeued (scontrol requeue, or the job itself after a preemption).
JobRequeue=1
# How long a training task has to save its backup after SIGTERM (KILL_WAIT_S).
KillWait={KILL_WAIT_S}
{node}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
