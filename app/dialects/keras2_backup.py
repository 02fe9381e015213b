"""Keras 2's backup of its fit(): tf_keras' BackupAndRestore, with the project's
position, schedule and SIGTERM handling (`app.state.backup`)."""

from __future__ import annotations

import tensorflow as tf
import tf_keras as keras

from app.state import backup as backups


class Backup(keras.callbacks.BackupAndRestore, backups.Backup):
    """Keras' BackupAndRestore in <workdir>/backup, saving at each epoch's end, every
    `every_steps` steps (0: epoch ends only), and at the first step boundary after
    SIGTERM, after which it raises `preemption.Preempted`.

    A resumed fit() goes on from the saved step, where BackupAndRestore alone
    would not in two cases:

    - Under ParameterServerStrategy its batch hooks return at once (tf_keras
      2.21 callbacks.py: "Skip batch update for PSS Strategy"), so an integer
      save_freq never saves, not even at epoch ends (tried with tf_keras 2.21).
      Keras gives no reason; there a batch "ends" when it is scheduled, so a
      backup taken then would claim steps not yet run. Here a save first joins
      the coordinator: every scheduled step has then run, and the saved step
      is exact.
    - With save_freq="epoch", Keras resumes at the epoch after the saved one
      (worker_training_state.maybe_load_initial_counters_from_ckpt): a SIGTERM
      backup from mid-epoch would skip the epoch's rest. With an integer
      save_freq it resumes at the saved batch + 1, so the parent always gets
      one; the saving schedule is this class's own (`backups.Backup`).
    """

    def __init__(self, backup_dir: str, every_steps: int = 0):
        keras.callbacks.BackupAndRestore.__init__(self, backup_dir,
                                                  save_freq=max(every_steps, 1))
        backups.Backup.__init__(self, backup_dir, every_steps)
        self._begin = 0
        self._saved_at: tuple[int, int] | None = None

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)  # restores the backup, if there is one
        self._back_up_random_generators()
        self.listen(self.model.distribute_strategy,
                    self._training_state.read_checkpoint_manager)

    def _back_up_random_generators(self) -> None:
        """Make the backup hold the state of each random layer's `tf.random.Generator`
        (layers built under `train.deterministic`), and restore it from the backup.

        tf_keras 2.21 keeps the generators out of a model's checkpoint ("for backward
        compatibility", base_layer.BaseRandomLayer): from the model's checkpoint alone a
        resumed run's dropout starts from the generators' initial state. Added to that
        checkpoint after it was restored, they are restored as they are added (a
        tf.train.Checkpoint's deferred restoration: values it read for objects it did
        not have yet go to them when they are attached)."""
        generators = random_generators(self.model)
        if generators:
            checkpoint = self._training_state.read_checkpoint_manager.checkpoint
            checkpoint.random_generators = generators  # the write manager's too

    def on_train_batch_begin(self, batch, logs=None):
        # The parent records the batch in a variable here, every step (under
        # ParameterServerStrategy that variable lives on a ps task); this class
        # records it only when it saves.
        self._begin = batch

    def on_train_batch_end(self, batch, logs=None):
        self.steps_run(batch + 1 - self._begin)
        if batch + 1 >= self.params["steps"]:
            return  # the epoch's last step: saved at the epoch's end, after its evaluations
        self.at(self._current_epoch, batch + 1)
        self.stop_if_asked()
        if self.due():
            self.save()

    def on_epoch_end(self, epoch, logs=None):
        self.at(self._current_epoch, self.params["steps"])  # resumes at the next epoch's start
        self.save()
        self.stop_if_asked()

    def on_train_end(self, logs=None):
        super().on_train_end(logs)  # deletes the backup
        self.close()

    def save(self) -> None:
        batch = self.step - 1
        if self._saved_at == (self._current_epoch, batch):
            return
        coordinator = getattr(self.model, "_cluster_coordinator", None)
        if coordinator is not None:
            coordinator.join()  # the steps scheduled so far have run
        # WorkerTrainingState's record of the saved step (tf_keras 2.21), read on resume.
        self._training_state._ckpt_saved_batch.assign(batch)
        self._backup(epoch=self._current_epoch, batch=batch)
        self.since_save, self._saved_at = 0, (self._current_epoch, batch)


def random_generators(model: keras.Model) -> list[tf.random.Generator]:
    """The `tf.random.Generator` of each random layer of `model` that draws from one, in
    the model's order (the same for every build of one model).

    tf_keras 2.21 keeps it at `layer._random_generator._generator` (backend.RandomGenerator;
    None for TF1's stateful random ops, the default); there is no public way to it. If it
    moves this finds none, and tests/test_determinism.py's Keras 2 resumes differ."""
    found = []
    for layer in [model, *model.submodules]:
        generator = getattr(getattr(layer, "_random_generator", None), "_generator", None)
        if isinstance(generator, tf.random.Generator):
            found.append(generator)
    return found
