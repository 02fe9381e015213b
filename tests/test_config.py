import dataclasses

import pytest

from app import config as cfg


def test_defaults_are_the_default_config_file():
    from app import task as tasks

    assert tasks.create(cfg.load("configs/mnist.toml"))[1] == tasks.create(cfg.Config())[1]


def test_file_then_set_overrides_apply_in_order(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[train]\nepochs = 3\nlearning_rate = 2\n[task]\nsource = "synthetic"\n')
    config = cfg.load(str(path), ["train.epochs=5", "task.model=mlp", "train.epochs=7"])
    assert config.train.epochs == 7
    assert config.train.learning_rate == 2.0  # an int widens to float
    # The task's own parameters are kept as given, checked when the task is found.
    assert config.task.params == {"source": "synthetic", "model": "mlp"}


def test_round_trip_through_written_toml(tmp_path):
    config = cfg.load(None, ["train.epochs=2", "task.dir=/x y/z", "eval.test_every_epoch=false"])
    written = tmp_path / "config.toml"
    written.write_text(cfg.to_toml(config))
    assert cfg.load(str(written)) == config


@pytest.mark.parametrize("override, message", [
    ("trian.epochs=1", "unknown section 'trian' in 'trian.epochs'; sections are task, data"),
    ("train.epoch=1", "unknown key 'train.epoch'; keys of [train] are epochs,"),
    ("train.epochs=1.5", "train.epochs = 1.5 has type float, expected int (e.g. train.epochs = 5)"),
    ("train.epochs=three", "train.epochs = 'three' has type str, expected int"),
    ("train.epochs=-1", "train.epochs = -1 must be > 0"),
    ("runtime.cpu_devices=-5", "runtime.cpu_devices = -5 must be >= 0"),
    ("train.final_lr_fraction=2", "train.final_lr_fraction = 2.0 must be in [0, 1]"),
    ("runtime.strategy=tpu", "runtime.strategy = 'tpu' is not one of auto, default, mirrored"),
    ("epochs", "--set 'epochs': expected key=value, e.g. --set train.epochs=3"),
    ("ps.mode=semi", "ps.mode = 'semi' is not one of async, sync"),
    ("runtime.cpu_allocator=tcmalloc",
     "runtime.cpu_allocator = 'tcmalloc' is not one of bfc, malloc"),
    ("ps.backup_workers=-1", "ps.backup_workers = -1 must be >= 0"),
    ("debug.slow_worker=-2", "debug.slow_worker = -2 must be >= -1"),
    ("debug.slow_factor=0.5", "debug.slow_factor = 0.5 must be >= 1"),
    ("data.shard_policy=hint", "data.shard_policy = 'hint' is not one of auto, data, file, off"),
    ("task.name=", "task.name is empty; name a built-in task (mnist, recommender) or an import "
     "path"),
    ("task.name=mnsit", "task.name = 'mnsit' is neither a built-in task (mnist, recommender) nor "
     "an import path like 'my_package.my_module:MyTask'; did you mean mnist?"),
    ("runtime.memory_limit_gib=-1", "runtime.memory_limit_gib = -1.0 must be >= 0"),
    ("runtime.memory_limit_gib=0.5", "runtime.memory_limit_gib = 0.5 is below the 1 GiB a task "
     "needs to start TensorFlow at all (app/cluster/memory.py); give at least 1, or 0 for "
     "no limit"),
    ("debug.hold_at_step=5", "debug.hold_at_step = 5 needs debug.hold_file: the file whose "
     "creation ends the hold"),
])
def test_bad_overrides_name_the_field_and_fix(override, message):
    with pytest.raises(cfg.ConfigError) as e:
        cfg.load(None, [override])
    assert message in str(e.value)


def test_bad_files_are_explained(tmp_path):
    with pytest.raises(cfg.ConfigError, match="--config nope.toml: no such file"):
        cfg.load("nope.toml")
    # A directory: a launcher that reads the file (cfg.chosen) must not die of it either.
    with pytest.raises(cfg.ConfigError, match=f"--config {tmp_path}: cannot be read"):
        cfg.load(str(tmp_path))
    assert cfg.chosen(str(tmp_path), ["train.epochs=1"]) == {"train.epochs"}
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(cfg.ConfigError, match="not valid TOML"):
        cfg.load(str(bad))
    flat = tmp_path / "flat.toml"
    flat.write_text("epochs = 3\n")
    with pytest.raises(cfg.ConfigError, match="top-level key 'epochs' must be a \\[section\\]"):
        cfg.load(str(flat))


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.Config().train.epochs = 3
