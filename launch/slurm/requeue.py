"""`python -m launch.slurm.requeue STATUS`: after the training step, requeue a preempted job.

`train.sbatch` runs it with srun's exit status. A training task that got
SIGTERM (the time limit's `--signal=TERM@N`, a drain) saved its backup and
exited with `app.cluster.preemption.EXIT_CODE`, and srun passes on the highest exit
code of its tasks. SLURM requeues a job by itself only when it is
preempted or `scontrol requeue`d, not when it reaches its time limit: hence
the job requeues itself, under the same job id, so the same WORKDIR, where
the next run resumes from the backup. Any other status is passed on as it is.
"""

from __future__ import annotations

import os
import subprocess
import sys

from app.cluster.preemption import EXIT_CODE


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        print("usage: python -m launch.slurm.requeue STATUS (srun's exit status)",
              file=sys.stderr)
        return 2
    status, job = int(args[0]), os.environ.get("SLURM_JOB_ID")
    if status != EXIT_CODE or not job:
        return status
    print(f"job {job} preempted, backup saved (exit code {EXIT_CODE}): requeueing it; "
          "it resumes in the same WORKDIR", flush=True)
    # On success SLURM ends this batch script (SIGTERM) and the job goes back to
    # PENDING; scontrol's exit status matters only when it fails, e.g. --no-requeue.
    result = subprocess.run(["scontrol", "requeue", job])
    if result.returncode != 0:
        print(f"scontrol requeue {job} failed (exit code {result.returncode}): resubmit with "
              f"WORKDIR set to this job's to resume", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
