import json
import pathlib

import pytest

from app import config as cfg
from app.state import workdir


def test_new_workdir_gets_the_config(tmp_path):
    config = cfg.load(None, ["train.epochs=2"])
    path = workdir.prepare(tmp_path / "run", config)
    assert cfg.load(str(path / "config.toml")) == config


def test_the_workdir_given_is_read_as_app_train_reads_it():
    assert workdir.given(["--set", "train.epochs=2", "--workdir", "runs/a"]) == "runs/a"
    assert workdir.given(["--workdir=runs/b", "--config", "c.toml"]) == "runs/b"
    assert workdir.given(["--workdir", "runs/a", "--workdir=runs/b"]) == "runs/b"  # the last
    assert workdir.given(["--set", "task.name=x", "--config", "c.toml"]) is None


def test_finished_run_is_never_overwritten(tmp_path):
    (tmp_path / "metrics.json").write_text("{}")
    with pytest.raises(cfg.ConfigError) as e:
        workdir.prepare(tmp_path, cfg.Config())
    assert str(e.value) == (f"--workdir {tmp_path} already holds a finished run "
                            "(metrics.json); choose a new --workdir")
    assert (tmp_path / "metrics.json").read_text() == "{}"


def interrupted(path: pathlib.Path, config: cfg.Config) -> None:
    """`path` as a run under `config` leaves it when stopped after a backup."""
    workdir.prepare(path, config)
    (path / "backup" / "chief").mkdir(parents=True)
    (path / "backup" / "chief" / "checkpoint").write_text("state")


def test_interrupted_run_resumes_only_under_the_same_config(tmp_path):
    interrupted(tmp_path, cfg.Config())
    assert workdir.prepare(tmp_path, cfg.Config()) == tmp_path
    with pytest.raises(cfg.ConfigError) as e:
        workdir.prepare(tmp_path, cfg.load(None, ["train.epochs=99"]))
    before = cfg.Config().train.epochs
    assert f"holds an interrupted run with a different config (train.epochs: {before} -> 99)" \
        in str(e.value)


def test_a_resumed_run_may_run_on_other_hosts_and_says_what_changed(tmp_path, caplog):
    # launch.local's thread settings for 2 workers, then for 1 (4 cores).
    interrupted(tmp_path, cfg.load(None, ["runtime.intra_op_threads=2",
                                          "runtime.inter_op_threads=3"]))
    resumed = cfg.load(None, ["runtime.intra_op_threads=4", "runtime.inter_op_threads=2",
                              "runtime.memory_limit_gib=2", "data.service=host:5050"])
    with caplog.at_level("INFO", logger="app.state.workdir"):
        assert workdir.prepare(tmp_path, resumed) == tmp_path
    assert caplog.messages == [
        "resuming with data.service '' -> 'host:5050', runtime.intra_op_threads 2 -> 4, "
        "runtime.inter_op_threads 3 -> 2, runtime.memory_limit_gib 0.0 -> 2.0"]
    assert cfg.load(str(tmp_path / "config.toml")) == resumed


def test_host_settings_do_not_hide_a_change_of_experiment(tmp_path):
    interrupted(tmp_path, cfg.Config())
    with pytest.raises(cfg.ConfigError) as e:
        workdir.prepare(tmp_path, cfg.load(None, ["runtime.intra_op_threads=4",
                                                  "runtime.onednn=false"]))
    assert "a different config (runtime.onednn: True -> False)" in str(e.value)


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


def test_a_directory_save_lands_whole_or_not_at_all(tmp_path):
    def half_then_fail(path):
        (path / "saved_model.pb").write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        workdir.save_dir(tmp_path / "export", half_then_fail)
    assert list(tmp_path.iterdir()) == []  # no export, no temporary left behind

    workdir.save_dir(tmp_path / "export", lambda path: (path / "v").write_text("1"))
    workdir.save_dir(tmp_path / "export", lambda path: (path / "v").write_text("2"))
    assert [p.name for p in tmp_path.iterdir()] == ["export"]
    assert (tmp_path / "export" / "v").read_text() == "2"


class FakeTFError(Exception):
    """The shape of a tf.errors.OpError: the file system's reason in `message`."""

    def __init__(self, message):
        super().__init__(message)
        self.message = message


@pytest.mark.parametrize("error, expected", [
    (OSError(28, "No space left on device", "/runs/a/backup/x"),
     "cannot write to --workdir /runs/a: No space left on device; free some space there or "
     "choose a --workdir on another disk"),
    (FakeTFError("/runs/a/backup/chief/ckpt-1_temp/part-0; Read-only file system"),
     "cannot write to --workdir /runs/a: Read-only file system; choose a --workdir this "
     "process can write"),
    (OSError(28, "No space left on device", "/tmp/worker-outputs-1/export"),
     "cannot write /tmp/worker-outputs-1/export: No space left on device; free some space "
     "there"),
])
def test_storage_faults_become_one_line_that_names_the_path(error, expected):
    fault = workdir.storage_error(error, pathlib.Path("/runs/a"))
    assert isinstance(fault, cfg.ConfigError) and str(fault) == expected


def test_other_errors_are_not_storage_faults():
    assert workdir.storage_error(OSError(2, "No such file or directory"),
                                 pathlib.Path("/runs/a")) is None
    assert workdir.storage_error(FakeTFError("Invalid argument: shapes"),
                                 pathlib.Path("/runs/a")) is None


PS = {"strategy": "ParameterServerStrategy", "workers": 2, "ps": 2, "replicas": 2}
MWM = {"strategy": "MultiWorkerMirroredStrategy", "workers": 2, "ps": 0, "replicas": 2}


def test_a_resumed_run_logs_how_its_cluster_changed(tmp_path, caplog):
    interrupted(tmp_path, cfg.Config())
    workdir.resume_shape(tmp_path, MWM, writes=True)
    one = {**MWM, "workers": 1, "replicas": 1}
    with caplog.at_level("INFO", logger="app.state.workdir"):
        workdir.resume_shape(tmp_path, one, writes=False)  # a worker: neither logs nor writes
        workdir.resume_shape(tmp_path, one, writes=True)
        workdir.resume_shape(tmp_path, one, writes=True)  # resumed again, on the same shape
    assert caplog.messages == ["resuming on 1 worker (was 2), with 1 replica (was 2)"]
    assert json.loads((tmp_path / workdir.SHAPE_FILE).read_text()) == one


def test_a_ps_run_resumed_on_more_ps_tasks_says_its_variables_are_resharded(tmp_path, caplog):
    interrupted(tmp_path, cfg.Config())
    workdir.resume_shape(tmp_path, PS, writes=True)
    with caplog.at_level("INFO", logger="app.state.workdir"):
        workdir.resume_shape(tmp_path, {**PS, "ps": 3}, writes=True)
    assert caplog.messages == ["resuming with 3 ps tasks (was 2): sharded variables and "
                               "their optimizer slots are restored into the new number of "
                               "shards"]


@pytest.mark.parametrize("before, now, fix", [
    (PS, MWM, "a TF_CONFIG that has ps tasks"),
    (PS, {**MWM, "strategy": "DefaultStrategy"}, "a TF_CONFIG that has ps tasks"),
    ({**MWM, "strategy": "MirroredStrategy"}, PS, "one process or a TF_CONFIG of worker "
                                                  "tasks, without ps tasks"),
])
def test_a_run_resumed_under_another_kind_of_strategy_is_refused_untouched(tmp_path, before,
                                                                           now, fix):
    interrupted(tmp_path, cfg.Config())
    workdir.resume_shape(tmp_path, before, writes=True)
    with pytest.raises(cfg.ConfigError) as e:
        workdir.resume_shape(tmp_path, now, writes=True)
    assert str(e.value) == (
        f"--workdir {tmp_path} holds an interrupted {before['strategy']} run; resuming it "
        f"under {now['strategy']} is not supported: resume it with {fix}, or start a new "
        "--workdir")
    assert json.loads((tmp_path / workdir.SHAPE_FILE).read_text()) == before
    assert (tmp_path / "backup" / "chief" / "checkpoint").read_text() == "state"


def test_synchronous_runs_resume_into_each_other_and_a_new_run_under_any(tmp_path, caplog):
    workdir.resume_shape(tmp_path, PS, writes=True)  # no backup: a new run
    workdir.resume_shape(tmp_path, MWM, writes=True)
    interrupted(tmp_path, cfg.Config())
    one = {"strategy": "DefaultStrategy", "workers": 1, "ps": 0, "replicas": 1}
    with caplog.at_level("INFO", logger="app.state.workdir"):
        workdir.resume_shape(tmp_path, one, writes=True)
    assert caplog.messages == ["resuming under DefaultStrategy (was MultiWorkerMirroredStrategy), "
                               "on 1 worker (was 2), with 1 replica (was 2)"]
    workdir.resume_shape(tmp_path, {**MWM, "strategy": "MirroredStrategy"}, writes=True)
    assert json.loads((tmp_path / workdir.SHAPE_FILE).read_text())["strategy"] == "MirroredStrategy"
