import pytest

from app import config as cfg
from app import workdir


def test_new_workdir_gets_the_config(tmp_path):
    config = cfg.load(None, ["train.epochs=2"])
    path = workdir.prepare(tmp_path / "run", config)
    assert cfg.load(str(path / "config.toml")) == config


def test_finished_run_is_never_overwritten(tmp_path):
    (tmp_path / "metrics.json").write_text("{}")
    with pytest.raises(cfg.ConfigError) as e:
        workdir.prepare(tmp_path, cfg.Config())
    assert str(e.value) == (f"--workdir {tmp_path} already holds a finished run "
                            "(metrics.json); choose a new --workdir")
    assert (tmp_path / "metrics.json").read_text() == "{}"


def test_interrupted_run_resumes_only_under_the_same_config(tmp_path):
    workdir.prepare(tmp_path, cfg.Config())
    (tmp_path / "backup" / "chief").mkdir(parents=True)
    (tmp_path / "backup" / "chief" / "checkpoint").write_text("state")
    assert workdir.prepare(tmp_path, cfg.Config()) == tmp_path
    with pytest.raises(cfg.ConfigError) as e:
        workdir.prepare(tmp_path, cfg.load(None, ["train.epochs=99"]))
    before = cfg.Config().train.epochs
    assert f"holds an interrupted run with a different config (train.epochs: {before} -> 99)" \
        in str(e.value)


def test_a_run_that_failed_before_training_is_simply_redone(tmp_path):
    workdir.prepare(tmp_path, cfg.load(None, ["train.global_batch_size=33"]))
    fixed = cfg.load(None, ["train.global_batch_size=32"])
    assert workdir.prepare(tmp_path, fixed) == tmp_path
    assert cfg.load(str(tmp_path / "config.toml")) == fixed


def test_config_is_replaced_not_rewritten_in_place(tmp_path):
    # Each task of a cluster writes config.toml while a relaunched peer may be reading it;
    # a reader must never see it truncated (it would parse as the defaults).
    workdir.prepare(tmp_path, cfg.Config())
    with open(tmp_path / "config.toml") as reader:
        workdir.prepare(tmp_path, cfg.load(None, ["train.epochs=2"]))
        assert reader.read() == cfg.to_toml(cfg.Config())
    assert cfg.load(str(tmp_path / "config.toml")).train.epochs == 2
    assert [p.name for p in tmp_path.iterdir()] == ["config.toml"]
