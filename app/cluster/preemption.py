"""SIGTERM as "save and stop": what a preempted training task does before it is killed.

Kubernetes, SLURM and launch.local ask a task to stop with SIGTERM and kill
it a grace period later. A training task (the chief, each MultiWorkerMirrored
worker, a single process) then saves a backup at the next step boundary and
exits with `EXIT_CODE`; the relaunched job resumes from that backup. The
backups themselves are written by the subclasses of `app.state.backup.Backup`
(Keras' fit, the loop on a coordinator, ps.mode = sync); this module holds the
signal side.

Exit codes of `python -m app.train` (docs/troubleshooting.md has the table): 0 done,
1 an error the code does not anticipate (a traceback), 2 a configuration or storage
mistake, 5 out of `runtime.memory_limit_gib`, 6 the export failed, 203 a lost task
(`tf_config.TaskLost`), 204 preempted with the backup saved. Retrying cannot help 2,
5 or 6; launchers retry the others, and Kubeflow's `restartPolicy: ExitCode` retries
203 and 204 (it retries 128..255 only).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

from app.cluster.tf_config import TaskLost

log = logging.getLogger(__name__)

EXIT_CODE = 204  # retryable under Kubeflow's ExitCode policy: see tf_config.TaskLost
# What a MultiWorkerMirrored worker logs once it has seen SIGTERM (`watcher`).
AGREEING = "SIGTERM: agreeing with the other workers on a step to save at"


class Preempted(TaskLost):
    """Raised at a step boundary after SIGTERM, once the backup is saved.

    A TaskLost, so that the command line prints it as one line and exits with
    `exit_code`, as it does for a lost task; launchers retry both.
    """

    exit_code = EXIT_CODE


def preempted(where: str) -> Preempted:
    return Preempted(f"preempted (SIGTERM): backup saved in {where}; run the same command "
                     f"again to resume (exit code {EXIT_CODE})")


class Sigterm:
    """SIGTERM turned into a flag that the training loop reads at step boundaries.

    Between `install()` and `uninstall()` SIGTERM no longer kills the process;
    outside them it does, as before (nothing to save before training starts,
    and nothing to lose after it ends).
    """

    def __init__(self):
        self._event = threading.Event()
        self._previous = None
        self._installed = False

    def install(self) -> None:
        # signal.signal works in the main thread only: a loop driven from another
        # thread (none here) would simply not be told.
        if threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False

    def ignore(self) -> None:
        """After the backup: the process is on its way out with `EXIT_CODE`, and a
        second SIGTERM (a launcher stopping the job's other tasks) must not turn
        that into a death by signal."""
        if self._installed:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            self._installed = False

    def requested(self) -> bool:
        return self._event.is_set()

    def _handle(self, signum, frame) -> None:
        self._event.set()  # the loop logs when it acts on it


def mwms_handler(strategy, checkpoint_manager, save: Callable[[], None],
                 sigterm: Sigterm, stop: Callable[[], None]):
    """TensorFlow's `PreemptionCheckpointHandler` for a multi-worker MultiWorkerMirrored
    run, None for any other strategy.

    A SIGTERM reaches one worker (a Kubernetes pod being evicted), but every
    worker must save at the same step, as saving is collective. The handler
    agrees on that step through the coordination service: the worker told
    polls `sigterm` and publishes "save after step k + 1"; every worker calls
    `save` after that step, then `stop` (which raises `Preempted`).

    Called after Keras has restored the backup: the handler restores
    `checkpoint_manager` (the backup's reader, on every worker) once more,
    which gives every worker the same run counter, the step number the
    workers agree on. Its own SIGTERM handler is not used
    (`termination_watcher_fn` instead) so that `Sigterm` stays the one owner
    of the signal. Keras' `BackupAndRestore(save_before_preemption=True)`
    would build the same handler, but only on Google Cloud
    (tf_keras distributed_file_utils.support_on_demand_checkpoint_callback).

    Not used elsewhere: the handler refuses clusters with ps tasks
    (NotImplementedError, tensorflow/python/distribute/failure_handling), and
    in a single process it would add nothing to `Sigterm` but a step of delay.
    """
    import tensorflow as tf

    resolver = getattr(strategy, "cluster_resolver", None)
    if not (isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and resolver
            and resolver.cluster_spec().jobs):
        return None
    config = tf.distribute.experimental.TerminationConfig(
        termination_watcher_fn=watcher(sigterm), exit_fn=stop, save_fn=save)
    return tf.distribute.experimental.PreemptionCheckpointHandler(
        resolver, checkpoint_manager, termination_config=config)


def watcher(sigterm: Sigterm) -> Callable[[], bool]:
    """The handler's `termination_watcher_fn`: whether SIGTERM came, saying `AGREEING`
    when it first is. The handler's thread polls it once a second until then and
    stops there; nothing else is logged before the save, a step or more later."""
    def noticed() -> bool:
        if not sigterm.requested():
            return False
        log.info(AGREEING)
        return True
    return noticed


def close_mwms_handler(handler) -> None:
    """Stop the handler's watcher threads when training ends without a preemption.

    One of them blocks in the coordination service until a worker publishes a
    step; left running, it outlives training and can hold up the process's exit.
    The handler stops them itself only before it exits or in `__del__`, which
    never runs while the threads hold it. Private methods of TF 2.21's
    failure_handling.PreemptionCheckpointHandler; if they move, this does
    nothing and the threads (daemons) end with the process.
    """
    for name in ("_stop_poll_termination_signal_thread",
                 "_stop_cluster_wise_termination_watcher_thread"):
        stop = getattr(handler, name, None)
        if stop is not None:
            stop()


def outlive_the_chief() -> Callable[[], bool]:
    """For the ps and worker tasks of a parameter-server cluster: defer SIGTERM;
    returns whether it came.

    These tasks stop by themselves once the chief has gone
    (`app.cluster.serving.serve`). When a whole job is asked to stop (SLURM's
    time limit, a node drain), dying at once would take with them the
    variables (ps) and the steps in flight (workers) that the chief's backup
    needs; the chief saves, exits, and they follow with `EXIT_CODE`, so that
    a scheduler restarts them with it. A task that stays stuck is killed at
    the end of the grace period, as any other.
    """
    requested = threading.Event()

    def deferred(signum, frame) -> None:
        requested.set()
        log.info("SIGTERM: serving until the chief has saved its backup and left")

    signal.signal(signal.SIGTERM, deferred)
    return requested.is_set


def serving_preempted(label: str, chief_seen: bool = True) -> Preempted:
    if not chief_seen:
        # No chief has connected to this task since it started: none has trained
        # through it, so it cannot speak of a backup (a job whose chief stopped
        # before training, then cancelled, had none).
        return Preempted(f"preempted (SIGTERM) before any chief had connected to {label}; it "
                         f"stops (exit code {EXIT_CODE}): no training ran through it")
    return Preempted(f"preempted (SIGTERM): the chief has left, and {label} stops with it "
                     f"(exit code {EXIT_CODE}); run the job again to resume from the chief's "
                     "backup")
