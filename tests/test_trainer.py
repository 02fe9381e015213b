import json

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from app import config as cfg
from app import dialects, strategy, trainer
from app.run import callbacks, optimizers
from app.state import workdir as workdirs
from tests.conftest import one_device_reduction_mirrored, tiny_task

FIELDS = {"strategy", "num_replicas", "num_workers", "num_ps", "global_batch_size",
          "epochs_completed", "steps", "test_accuracy", "test_loss",
          "train_examples_per_sec", "wall_seconds"}


@pytest.fixture(scope="module")
def mirrored_run(tmp_path_factory, tiny_datasets):
    """Three epochs of Mirrored training over 2 logical CPUs, on tiny learnable data."""
    workdir = tmp_path_factory.mktemp("run")
    config = cfg.load(None, ["train.epochs=3", "train.global_batch_size=32",
                             "train.learning_rate=0.003", "eval.batch_size=33"])
    metrics = trainer.run(config, workdir, strategy=strategy.create("mirrored"),
                          task=tiny_task(config))
    return workdir, metrics, tiny_datasets


def test_mirrored_run_reports_metrics_and_writes_artifacts(mirrored_run):
    workdir, metrics, _ = mirrored_run
    assert FIELDS <= set(metrics)
    assert json.loads((workdir / "metrics.json").read_text()) == metrics
    assert metrics["strategy"] == "MirroredStrategy" and metrics["num_replicas"] == 2
    assert (metrics["epochs_completed"], metrics["steps"]) == (3, 3 * (512 // 32))
    assert metrics["num_test_examples"] == 101
    losses = [epoch["loss"] for epoch in metrics["history"]]
    assert losses[-1] < losses[0]
    assert metrics["test_accuracy"] > 0.5  # chance is 0.1
    assert {"val_accuracy", "test_accuracy"} <= set(metrics["history"][0])
    assert tf.train.latest_checkpoint(str(workdir / "checkpoints")).endswith("ckpt-3")
    assert (workdir / "export" / "saved_model.pb").exists()
    assert json.loads((workdir / workdirs.SHAPE_FILE).read_text()) == {
        "strategy": "MirroredStrategy", "workers": 1, "ps": 0, "replicas": 2}
    assert list((workdir / "tensorboard").glob("train/events.out.tfevents.*"))
    # Nothing that docs/outputs.md does not list (it lists workdirs.LAYOUT: tests/test_docs.py).
    written = {path.name + "/" * path.is_dir() for path in workdir.iterdir()}
    assert written <= set(workdirs.LAYOUT), written - set(workdirs.LAYOUT)


def test_test_accuracy_counts_every_test_image_exactly_once(mirrored_run):
    """101 images over 2 replicas in batches of 33 (the last, 2, split 1 + 1): nothing dropped,
    nothing doubled. (A last batch of 1 would leave a replica empty: docs/troubleshooting.md,
    oneDNN.)"""
    workdir, metrics, tiny = mirrored_run
    model = keras.models.load_model(workdir / "export")
    images, labels = tiny[2]
    logits = model.predict(images, verbose=0)  # raw uint8 pixels: the export scales them
    expected = np.mean(np.argmax(logits, axis=1) == labels)
    assert metrics["test_accuracy"] == pytest.approx(expected, abs=1e-6)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(labels, logits)
    assert metrics["test_loss"] == pytest.approx(float(loss), rel=1e-4)


def test_global_batch_must_split_over_replicas(tmp_path, tiny_datasets):
    config = cfg.load(None, ["train.global_batch_size=33"])
    with pytest.raises(cfg.ConfigError, match=r"global_batch_size \(33\) must be divisible by "
                                              r"the number of replicas \(2\); use 32 or 34"):
        trainer.run(config, tmp_path, strategy=strategy.create("mirrored"), task=tiny_task(config))


def test_batch_larger_than_the_training_set(tmp_path, tiny_datasets):
    config = cfg.load(None, ["train.global_batch_size=1024"])
    with pytest.raises(cfg.ConfigError, match=r"\(1024\) is larger than the training set "
                                              r"\(512 examples\)"):
        trainer.run(config, tmp_path, strategy=strategy.create("default"), task=tiny_task(config))


def test_throughput_leaves_out_warmup_and_epoch_starts(monkeypatch):
    clock = iter([0.0, 1.0, 1.5, 2.0,   # epoch 1: 4 calls of 2 steps each
                  100.0, 100.5, 101.0])  # epoch 2 starts late (after validation)
    monkeypatch.setattr(callbacks.time, "perf_counter", lambda: next(clock))
    meter = callbacks.Throughput(global_batch_size=10, warmup_steps=4)
    meter.on_epoch_begin(0)
    for last_step in (1, 3, 5, 7):  # steps_per_execution=2: Keras reports the last step run
        meter.on_train_batch_end(last_step)
    meter.on_epoch_begin(1)
    for last_step in (1, 3, 5):
        meter.on_train_batch_end(last_step)
    # Counted: epoch 1 after the 4 warm-up steps (2 calls, 1.0 s, 4 steps) and epoch 2
    # after its first call (2 calls, 1.0 s, 4 steps): 80 examples in 2 s.
    assert (meter.steps, meter.seconds) == (8, 2.0)
    assert meter.examples_per_sec() == 40.0


def test_throughput_under_a_coordinator_times_steps_run_not_scheduled(monkeypatch):
    class Coordinator:
        joins = 0

        def join(self):
            self.joins += 1

    coordinator = Coordinator()
    clock = iter([10.0, 14.0, 50.0, 52.0])
    monkeypatch.setattr(callbacks.time, "perf_counter", lambda: next(clock))
    meter = callbacks.Throughput(global_batch_size=10, warmup_steps=4, coordinator=coordinator)
    for epoch in range(2):
        meter.on_epoch_begin(epoch)
        for step in range(8):  # scheduled at once; they run later
            meter.on_train_batch_end(step)
        meter.on_epoch_end(epoch)  # fit() has joined the coordinator by now
    # The clock starts after the 4th step of epoch 1 has run (one join) and at the
    # start of epoch 2, and stops at each epoch's end: 4 steps in 4 s, 8 in 2 s.
    assert coordinator.joins == 1
    assert (meter.steps, meter.seconds) == (12, 6.0)


def test_throughput_without_enough_steps_is_zero():
    assert callbacks.Throughput(global_batch_size=10).examples_per_sec() == 0.0


@pytest.mark.parametrize("dialect", dialects.DIALECTS, ids=lambda d: d.NAME)
def test_cosine_restarts_anneal_every_epoch_from_a_decaying_peak(dialect):
    config = cfg.load(None, ["train.lr_schedule=cosine_restarts", "train.learning_rate=0.01",
                             "train.final_lr_fraction=0.01", "train.lr_cycle_decay=0.5"])
    lr = optimizers.learning_rate(config, steps_per_epoch=100, dialect=dialect)
    assert float(lr(0)) == pytest.approx(0.01)
    assert float(lr(99)) < 0.0002  # annealed by the end of the first epoch
    # Restarts at half the previous peak (Keras decays the cosine part, not the floor).
    assert float(lr(100)) == pytest.approx(0.01 * (0.01 + 0.99 * 0.5))
    assert float(lr(200)) == pytest.approx(0.01 * (0.01 + 0.99 * 0.25))


@pytest.mark.parametrize("dialect", dialects.DIALECTS, ids=lambda d: d.NAME)
def test_cosine_decays_once_over_the_whole_run(dialect):
    config = cfg.load(None, ["train.lr_schedule=cosine", "train.epochs=4",
                             "train.learning_rate=0.01", "train.final_lr_fraction=0.1"])
    lr = optimizers.learning_rate(config, steps_per_epoch=10, dialect=dialect)
    assert float(lr(0)) == pytest.approx(0.01)
    assert float(lr(20)) == pytest.approx(0.01 * (0.1 + 0.9 * 0.5))
    assert float(lr(40)) == pytest.approx(0.001)


def test_compression_without_an_all_reduce_is_refused(tmp_path, tiny_datasets):
    config = cfg.load(None, ["sync.compression=fp16", "train.epochs=1"])
    with pytest.raises(cfg.ConfigError) as e:
        trainer.run(config, tmp_path, strategy=strategy.create("default"), task=tiny_task(config))
    assert str(e.value) == ("sync.compression = fp16 compresses the all-reduce of "
                            "MultiWorkerMirrored and Mirrored runs, and this run has none "
                            "(DefaultStrategy); set it to none")
    assert list(tmp_path.iterdir()) == []


def test_a_ps_run_is_not_resumed_in_one_process(tmp_path, tiny_datasets):
    backup = tmp_path / workdirs.BACKUP_DIR / "chief" / "checkpoint"
    backup.parent.mkdir(parents=True)
    backup.write_text("state")
    shape = {"strategy": "ParameterServerStrategy", "workers": 2, "ps": 2, "replicas": 2}
    workdirs.write_json(tmp_path / workdirs.SHAPE_FILE, shape)
    config = cfg.load(None, ["train.epochs=1"])
    with pytest.raises(cfg.ConfigError) as e:
        trainer.run(config, tmp_path, strategy=strategy.create("default"), task=tiny_task(config))
    assert str(e.value) == (
        f"--workdir {tmp_path} holds an interrupted ParameterServerStrategy run; resuming it "
        "under DefaultStrategy is not supported: resume it with a TF_CONFIG that has ps "
        "tasks, or start a new --workdir")
    assert backup.read_text() == "state"
    assert json.loads((tmp_path / workdirs.SHAPE_FILE).read_text()) == shape


def test_fp16_compressed_run_learns_and_exports_a_loadable_model(tmp_path, tiny_datasets):
    config = cfg.load(None, ["sync.compression=fp16", "train.epochs=2",
                             "train.learning_rate=0.003", "eval.batch_size=33"])
    metrics = trainer.run(config, tmp_path, strategy=one_device_reduction_mirrored(),
                          task=tiny_task(config))
    losses = [epoch["loss"] for epoch in metrics["history"]]
    assert losses[-1] < losses[0]
    model = keras.models.load_model(tmp_path / "export")
    assert model.predict(tiny_datasets[2][0][:4], verbose=0).shape == (4, 10)


@pytest.mark.parametrize("override, message", [
    ("ps.mode=sync", "ps.mode = sync is parameter-server training and this run has no ps "
                     "tasks (DefaultStrategy); give TF_CONFIG chief, worker and ps jobs, or "
                     "use ps.mode = async"),
    ("debug.slow_worker=0", "debug.slow_worker = 0 slows a worker of a parameter-server "
                            "cluster, and this run has none (DefaultStrategy); set it to -1"),
    ("ps.compression=fp16", "ps.compression = fp16 compresses the gradients workers push to "
                            "ps tasks, and this run has none (DefaultStrategy); set it to none"),
    ("ps.read_compression=fp16", "ps.read_compression = fp16 compresses the variables workers "
                                 "read from ps tasks, and this run has none (DefaultStrategy); "
                                 "set it to none"),
])
def test_parameter_server_settings_without_ps_tasks_are_refused(override, message, tmp_path,
                                                                 tiny_datasets):
    config = cfg.load(None, [override, "train.epochs=1"])
    with pytest.raises(cfg.ConfigError) as e:
        trainer.run(config, tmp_path, strategy=strategy.create("default"),
                    task=tiny_task(config))
    assert str(e.value) == message
    assert list(tmp_path.iterdir()) == []  # refused before anything was written
