"""What every backup of a training run keeps: its position, its checkpoint, SIGTERM.

Four backups resume the project's runs: Keras 2's fit (`app.dialects.keras2_backup`),
Keras 3's fit (`app.dialects.keras3.Backup`), the loop on a ClusterCoordinator
(`app.distribute.ps.coordinated.LoopBackup`) and the synchronous parameter servers'
(`app.distribute.ps.sync.SyncBackup`). Each is a `Backup`: its position (the epoch
and the steps done in it), the count of steps since it last saved (when the next
save is due), and SIGTERM turned into "save, then stop" (`app.cluster.preemption`).
The two loops of the project's own also keep their checkpoint here
(`track`, `restore`, `write`, `delete`); Keras' BackupAndRestore keeps the callbacks'.
"""

from __future__ import annotations

import logging
import pathlib
import shutil
from typing import NoReturn

import tensorflow as tf

from app.cluster import preemption

log = logging.getLogger(__name__)


class Backup:
    """The backup of a run in `directory`, saved every `every_steps` steps (0: at
    epoch ends only) and at the first step boundary after SIGTERM, after which it
    raises `preemption.Preempted`.

    A subclass keeps the position current (`at`), counts the steps run
    (`steps_run`), and says how it saves (`save`); the default saves the tracked
    checkpoint (`track`) at the position.
    """

    def __init__(self, directory: str | pathlib.Path, every_steps: int = 0):
        self.directory = directory  # named by `preemption.Preempted`'s message
        self.every_steps = every_steps
        self.sigterm = preemption.Sigterm()
        self.epoch = 0  # the position: the epoch (from 0), the steps done in it
        self.step = 0
        self.since_save = 0  # steps run since the last save
        self.manager: tf.train.CheckpointManager | None = None  # once `track`ed
        self._handler = None  # MultiWorkerMirrored's PreemptionCheckpointHandler

    # The position, and when a save is due.

    def at(self, epoch: int, step: int) -> None:
        """The run is at step `step` (done) of epoch `epoch` (from 0): what `stop` says."""
        self.epoch, self.step = epoch, step

    def steps_run(self, steps: int = 1) -> None:
        self.since_save += steps

    def due(self) -> bool:
        """Whether `every_steps` steps have run since the last save."""
        return bool(self.every_steps) and self.since_save >= self.every_steps

    # The checkpoint of the project's own loops.

    def track(self, **objects) -> None:
        """Checkpoint `objects` and the position in `directory`, the newest one kept.
        The position's variables are made here, where the caller is (a loop's chief
        makes them outside any strategy's scope)."""
        self._epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="backup_epoch")
        self._step = tf.Variable(0, dtype=tf.int64, trainable=False, name="backup_step")
        checkpoint = tf.train.Checkpoint(**objects, epoch=self._epoch, step=self._step)
        self.manager = tf.train.CheckpointManager(checkpoint, str(self.directory), max_to_keep=1)

    def restore(self) -> tuple[int, int]:
        """Restore the last backup, if there is one: (epoch, step) to go on from.
        From here on SIGTERM means save and stop."""
        self.listen()
        latest = self.manager.latest_checkpoint
        if latest:
            self.manager.checkpoint.restore(latest).assert_existing_objects_matched()
            self.resumed(latest)
        self.at(int(self._epoch.numpy()), int(self._step.numpy()))
        return self.epoch, self.step

    def resumed(self, path: str) -> None:
        """Called once the backup at `path` is restored."""
        log.info("resumed from %s: epoch %d, step %d", path,
                 int(self._epoch.numpy()) + 1, int(self._step.numpy()))

    def write(self, epoch: int, step: int) -> None:
        """Save the tracked checkpoint with (epoch, step) as the position to go on from."""
        self._epoch.assign(epoch)
        self._step.assign(step)
        self.manager.save()
        self.since_save = 0

    def save(self) -> None:
        """Save at the position (`at`)."""
        self.write(self.epoch, self.step)

    def delete(self) -> None:
        """Training is over: the backup goes, as BackupAndRestore's does."""
        self.close()
        shutil.rmtree(self.directory, ignore_errors=True)

    # SIGTERM: save, then stop.

    def listen(self, strategy=None, manager: tf.train.CheckpointManager | None = None) -> None:
        """From now on SIGTERM means save and stop. Under a multi-worker
        MultiWorkerMirroredStrategy every worker saves at the step they agree on
        (`preemption.mwms_handler`, which reads the run counter from `manager`)."""
        self.sigterm.install()
        if strategy is not None:
            self._handler = preemption.mwms_handler(strategy, manager, save=self.save,
                                                    sigterm=self.sigterm, stop=self.stop)

    def close(self) -> None:
        """Training ended: SIGTERM kills again."""
        if self._handler is not None:
            preemption.close_mwms_handler(self._handler)
        self.sigterm.uninstall()

    def stop_if_asked(self) -> None:
        """At a step boundary: after SIGTERM, save and stop (under MultiWorkerMirrored at
        the step all workers agree on)."""
        if self._handler is not None:
            self._handler.save_checkpoint_if_preempted()
        elif self.sigterm.requested():
            self.save()
            self.stop()

    def stop_if_saved_and_asked(self) -> None:
        """After a save: stop if SIGTERM came (and no handler decides when)."""
        if self._handler is None and self.sigterm.requested():
            self.stop()

    def stop(self) -> NoReturn:
        """The backup is saved: raise `Preempted`, which exits with its exit code."""
        self.sigterm.ignore()
        log.warning("SIGTERM: backup of epoch %d, step %d saved; stopping",
                    self.epoch + 1, self.step)
        raise preemption.preempted(str(self.directory))
