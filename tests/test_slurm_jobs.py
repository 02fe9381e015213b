"""`sbatch launch/slurm/train.sbatch` for real, on a one-node SLURM cluster on this machine.

The cluster (launch/slurm/local_cluster.py) starts once for the session, or
is used as it is if `make slurm-cluster` already started it. It needs root and
apt-get (or SLURM installed); elsewhere these tests skip and say why. Every
job runs several tasks on the one node, trains the MLP for a few hundred
steps at most, and writes its workdir under pytest's tmp_path.
"""

import datetime
import json
import pathlib
import re
import subprocess
import sys
import time

import pytest

from app.cluster.preemption import EXIT_CODE
from launch.slurm import local_cluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parent.parent
# A guard against a hung job, not a timing assertion.
JOB_TIMEOUT_S = 600
SMALL = ["--set", "task.model=mlp", "--set", "task.train_examples=2048",
         "--set", "task.validation_examples=256", "--set", "task.test_examples=500",
         "--set", "train.verbose=0"]
STEP = re.compile(r"^\[chief:0\] INFO step (\d+)$", re.M)


@pytest.fixture(scope="session")
def slurm() -> dict[str, str]:
    """The environment of SLURM's commands for the local cluster (SLURM_CONF)."""
    if reason := local_cluster.missing_prerequisite():
        pytest.skip(reason)
    state = local_cluster.DEFAULT_DIR
    ours = not all(local_cluster.running(state, d) for d in local_cluster.DAEMONS)
    command = [sys.executable, "-m", "launch.slurm.local_cluster"]
    if ours:
        started = subprocess.run([*command, "start"], cwd=ROOT, capture_output=True, text=True)
        assert started.returncode == 0, started.stdout + started.stderr
    env = {k: v for k, v in local_cluster.client_env(state).items()
           if not k.startswith(("SLURM_", "TF_"))}
    yield {**env, "SLURM_CONF": str(state / "slurm.conf"), "PYTHON": sys.executable}
    if ours:
        subprocess.run([*command, "stop"], cwd=ROOT, capture_output=True)


def submit(env: dict[str, str], out: pathlib.Path, sbatch_args: list[str],
           train_args: list[str], **variables: str) -> str:
    """sbatch train.sbatch from the project directory; the job id."""
    result = subprocess.run(
        ["sbatch", "--parsable", f"--output={out}", "--cpus-per-task=1", *sbatch_args,
         str(ROOT / "launch/slurm/train.sbatch"), *SMALL, *train_args],
        cwd=ROOT, env={**env, **variables}, capture_output=True, text=True, check=True)
    return result.stdout.strip().split(";")[0]


def job(env: dict[str, str], job_id: str) -> dict[str, str]:
    """`scontrol show job`'s fields (a finished job stays there for MinJobAge, 300 s)."""
    text = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env,
                          capture_output=True, text=True, check=True).stdout
    return dict(f.split("=", 1) for f in text.split() if "=" in f)


def wait_for_end(env: dict[str, str], job_id: str,
                 timeout_s: float = JOB_TIMEOUT_S) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while (fields := job(env, job_id))["JobState"] not in (
            "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id], env=env)
            pytest.fail(f"job {job_id} still {fields['JobState']} after {timeout_s:g} s")
        time.sleep(1)
    return fields


def read(path: pathlib.Path) -> str:
    return path.read_text() if path.exists() else ""


@pytest.fixture(scope="module")
def mwms_job(slurm, tmp_path_factory) -> tuple[str, pathlib.Path, pathlib.Path]:
    """A MultiWorkerMirrored job of 2 tasks: (job id, workdir, output file).

    Submitted when first asked for, by the requeue test, so that it trains while
    that test's job waits on SLURM (the requeue, `cred_expire`, the scheduler):
    the two together take little more than the requeue test alone."""
    tmp = tmp_path_factory.mktemp("mwms")
    workdir, out = tmp / "work", tmp / "job.out"
    job_id = submit(slurm, out, ["--ntasks=2"],
                    ["--set", "train.epochs=2", "--set", "train.global_batch_size=64"],
                    PS="0", CONFIG="configs/mnist_sync.toml", WORKDIR=str(workdir),
                    PORT="2322")  # the PS job on the same node has 2222 and up
    yield job_id, workdir, out
    subprocess.run(["scancel", job_id], env=slurm, capture_output=True)  # if still running


def test_parameter_server_job_requeued_mid_epoch_resumes_and_completes(slurm, mwms_job,
                                                                         tmp_path):
    """`scontrol requeue` in epoch 2 of 2: SLURM sends SIGTERM to every task, the chief
    saves its backup and exits EXIT_CODE (204); the job comes back under the same id, hence the same
    WORKDIR, resumes from the backup and finishes; no epoch is trained twice."""
    workdir, out = tmp_path / "work", tmp_path / "job.out"
    job_id = submit(slurm, out, ["--ntasks=3"],
                    ["--set", "train.epochs=2", "--set", "debug.log_every_steps=8"],
                    PS="1", CONFIG="configs/mnist_ps.toml", WORKDIR=str(workdir))
    deadline = time.monotonic() + JOB_TIMEOUT_S
    # 1792 training examples, batch 32: 56 steps an epoch; step 64 is in epoch 2.
    while not [s for s in STEP.findall(read(out)) if int(s) >= 64]:
        assert job(slurm, job_id)["JobState"] in ("PENDING", "RUNNING"), read(out)
        assert time.monotonic() < deadline, read(out)
        time.sleep(0.5)
    subprocess.run(["scontrol", "requeue", job_id], env=slurm, check=True)
    fields = wait_for_end(slurm, job_id)
    log = read(out)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == (
        "COMPLETED", "0:0", "1"), log
    assert f"preempted (SIGTERM): backup saved in {workdir}" in log
    assert f"(exit code {EXIT_CODE})" in log
    assert "DUE TO JOB REQUEUE" in log
    metrics = json.loads((workdir / "metrics.json").read_text())
    assert [row["epoch"] for row in metrics["history"]] == [1, 2]
    assert metrics["num_ps"] == 1 and metrics["num_workers"] == 1
    # The second run went on from the SIGTERM backup: past the last step the first
    # run reported, not from step 0 nor from epoch 2's start (56). SLURM's SIGTERM
    # can reach the chief only as epoch 2 ends (fast MLP steps, a loaded machine):
    # then the backup is the last epoch's, and the second run trains no step.
    first_run, second_run = log.split("DUE TO JOB REQUEUE", 1)
    before, after = ([int(s) for s in STEP.findall(run)] for run in (first_run, second_run))
    assert max(before) >= 64 and all(step > max(before) for step in after), (before, after)
    assert after or "backup of epoch 2, step 56 saved" in log, log


def test_multi_worker_mirrored_job_two_tasks_on_one_node(slurm, mwms_job):
    job_id, workdir, out = mwms_job
    fields = wait_for_end(slurm, job_id)
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), read(out)
    metrics = json.loads((workdir / "metrics.json").read_text())
    assert metrics["strategy"] == "MultiWorkerMirroredStrategy"
    assert metrics["num_workers"] == 2
    assert [row["epoch"] for row in metrics["history"]] == [1, 2]
    assert (fields["NumNodes"], fields["NumTasks"]) == ("1", "2")  # two tasks on one node


def test_a_chief_refusing_a_finished_workdir_ends_every_task_of_the_job(slurm, tmp_path):
    """The chief exits 2 at once; it tells the ps and the worker, which stop with its
    code instead of waiting for it until the time limit: the job ends within
    cluster.connect_timeout_s and a minute, and every task says why."""
    workdir, out = tmp_path / "done", tmp_path / "job.out"
    workdir.mkdir()
    (workdir / "metrics.json").write_text("{}")
    # How long the failed chief waits for the ps and the worker to be up to tell them
    # (it tells each once it is up). A task up only after that finds no chief and the
    # earlier run's metrics.json, and stops as after a finished run; a CI runner once
    # took 36 s to start one beside three test runners. So the wait must exceed any
    # start; the job still ends as soon as both are told.
    connect_timeout_s = 120
    job_id = submit(slurm, out, ["--ntasks=3"],
                    ["--set", f"cluster.connect_timeout_s={connect_timeout_s}"],
                    PS="1", CONFIG="configs/mnist_ps.toml", WORKDIR=str(workdir),
                    PORT="2422")  # apart from the other jobs' ports
    fields = wait_for_end(slurm, job_id, timeout_s=connect_timeout_s + 60 + 120)
    log = read(out)
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "2:0"), log
    took = datetime.datetime.fromisoformat(fields["EndTime"]) - datetime.datetime.fromisoformat(
        fields["StartTime"])
    assert took.total_seconds() <= connect_timeout_s + 60, (took, log)
    assert f"--workdir {workdir} already holds a finished run" in log
    for task in ("ps:0", "worker:0"):
        assert f"failed with exit code 2: --workdir {workdir}" in log, log
        assert f"{task} stops with the same code" in log, log
    assert "resume from the chief's backup" not in log, log
