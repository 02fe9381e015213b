"""Resume on the in-process parameter-server cluster of conftest.py (2 workers, 2 ps,
this process the chief): fit() under a ClusterCoordinator and the sync loop go on
from the step of their last backup, with the state they had there."""

import signal

import numpy as np
import pytest
import tensorflow as tf

from app import config as cfg
from app import trainer
from app.cluster import preemption
from app.dialects import keras3
from app.distribute.ps import sync as sync_ps
from app.distribute.ps import variables as ps_variables
from app.state import workdir
from tests.conftest import tiny_task
from tests.probing import Interrupted, Probe, attach

pytestmark = pytest.mark.cluster

STEPS = 512 // 16  # per epoch: conftest's tiny_datasets at batch 16


def _config(*overrides: str) -> cfg.Config:
    # The MLP: a backup every few steps of the CNN and its Adam slots (40 MB) is slow here.
    return cfg.load(None, ["train.epochs=2", "train.global_batch_size=16", "train.verbose=0",
                           "eval.batch_size=64", "eval.test_every_epoch=false",
                           "task.model=mlp", *overrides])


# SIGTERM during step 3's callbacks: tf_keras' fit (Backup, on a task's pipeline) and the
# project's loop (coordinated.LoopBackup: by index in either Keras) save after step 4,
# the rerun going on from the step after.
@pytest.mark.parametrize("keras, by_index, resumed_at", [
    ("tf_keras", "false", (1, 5)), ("tf_keras", "true", (1, 5)), ("keras", "true", (1, 5))])
def test_fit_under_a_coordinator_resumes_mid_epoch(ps_strategy, ps_cluster, tmp_path,
                                                    monkeypatch, keras, by_index, resumed_at):
    # BackupAndRestore alone never saves here with an integer save_freq (its batch
    # hooks return under ParameterServerStrategy): the rerun would start at step 0.
    config = _config("checkpoint.every_steps=5", f"task.keras={keras}",
                     f"data.by_index={by_index}")
    attach(monkeypatch, Probe(stop_at=(0, 12)))
    with pytest.raises(Interrupted):
        trainer.run(config, tmp_path, strategy=ps_strategy, cluster=ps_cluster,
                    task=tiny_task(config))
    # Steps 13 and on were scheduled, maybe run, but not saved: the backup of step 10 is.
    attach(monkeypatch, Probe(stop_at=(1, 3), how="sigterm"))
    with pytest.raises(preemption.Preempted):
        trainer.run(config, tmp_path, strategy=ps_strategy, cluster=ps_cluster,
                    task=tiny_task(config))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # ignored on the way out; not in pytest
    probe = attach(monkeypatch, Probe())
    metrics = trainer.run(config, tmp_path, strategy=ps_strategy, cluster=ps_cluster,
                    task=tiny_task(config))
    assert probe.seen[0] == resumed_at
    assert metrics["steps"] == 2 * STEPS
    assert [row["epoch"] for row in metrics["history"]] == [1, 2]


def _state(model, training) -> dict:
    """What a sync backup must bring back, read from the chief."""
    optimizer = model.optimizer
    variables = optimizer.variables() if callable(optimizer.variables) else optimizer.variables
    weights = model.get_weights() if keras3.owns(model) else ps_variables.gather_weights(model)
    return {"weights": weights,
            "slots": [np.asarray(v) if keras3.owns(v) else np.asarray(tf.convert_to_tensor(v))
                      for v in variables],
            "iterations": int(optimizer.iterations.numpy()),
            "version": int(training.exchange.version.numpy())}


@pytest.mark.parametrize("keras", ["tf_keras", "keras"])
def test_sync_run_resumes_its_parameters_slots_version_and_position(
        ps_strategy, ps_cluster, tmp_path, monkeypatch, keras):
    trainings = []

    class Recorded(sync_ps.SyncTraining):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            trainings.append(self)

    monkeypatch.setattr(sync_ps, "SyncTraining", Recorded)
    config = _config("ps.mode=sync", "checkpoint.every_steps=3", f"task.keras={keras}")
    # Crashed after update 8 of epoch 1: the backup of update 6 holds.
    attach(monkeypatch, Probe(stop_at=(0, 7)))
    with pytest.raises(Interrupted):
        trainer.run(config, tmp_path, strategy=ps_strategy, cluster=ps_cluster,
                    task=tiny_task(config))

    saved = {}

    def save_state(model, epoch, batch):
        if (epoch, batch) == (1, 4):  # SIGTERM here: the backup is of this update
            saved.update(_state(model, trainings[-1]))

    probe = attach(monkeypatch, Probe(stop_at=(1, 4), how="sigterm", on_batch=save_state))
    with pytest.raises(preemption.Preempted):
        trainer.run(config, tmp_path, strategy=ps_strategy, cluster=ps_cluster,
                    task=tiny_task(config))
    assert probe.seen[0] == (0, 6)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # ignored on the way out; not in pytest

    restored = {}
    probe = attach(monkeypatch, Probe(
        on_begin=lambda model: restored.update(_state(model, trainings[-1]))))
    metrics = trainer.run(config, tmp_path, strategy=ps_strategy, cluster=ps_cluster,
                    task=tiny_task(config))
    assert probe.seen[0] == (1, 5)
    assert restored["iterations"] == saved["iterations"] == STEPS + 5
    assert restored["version"] == saved["version"] == STEPS + 5
    for name in ("weights", "slots"):
        assert len(restored[name]) == len(saved[name]) > 0
        for got, want in zip(restored[name], saved[name], strict=True):
            np.testing.assert_array_equal(got, want)
    assert metrics["steps"] == 2 * STEPS
    assert sum(metrics["contributions"]) == 2 * 2 * STEPS  # both workers, every update
    assert [row["epoch"] for row in metrics["history"]] == [1, 2]
    assert not workdir.has_backup(tmp_path)
