"""Backups, resume and SIGTERM in one process (the default strategy): a run stopped
mid-epoch goes on from its last backup, step for step, and its metrics.json
covers every epoch. The same on a parameter-server cluster: test_resume_ps.py."""

import json
import logging
import signal
import threading
import types

import pytest
import tensorflow as tf

from app import config as cfg
from app import strategy, trainer
from app.cluster import preemption
from app.run import callbacks
from app.state import workdir
from tests.conftest import tiny_task
from tests.probing import Interrupted, Probe, attach

STEPS = 512 // 32  # per epoch: conftest's tiny_datasets at the default batch


# Each Keras's own fit(), the same assertions: Keras 2's tiny CNN, Keras 3's MLP (the
# CNN's kernel makes a Keras 3 run several times slower here).
KERASES = {"keras2": [], "keras3": ["task.keras=keras", "task.model=mlp"]}


def _config(*overrides: str) -> cfg.Config:
    return cfg.load(None, ["train.epochs=3", "train.verbose=0", "eval.batch_size=64",
                           *overrides])


def _run(config, path, datasets):
    return trainer.run(config, path, strategy=strategy.create("default"), task=tiny_task(config))


@pytest.mark.parametrize("keras", KERASES)
def test_sigterm_saves_at_the_next_step_and_the_rerun_goes_on_from_there(
        keras, tmp_path, tiny_datasets, monkeypatch):
    config = _config(*KERASES[keras])  # checkpoint.every_steps = 0: only SIGTERM saves mid-epoch
    attach(monkeypatch, Probe(stop_at=(1, 4), how="sigterm"))
    with pytest.raises(preemption.Preempted) as stopped:
        _run(config, tmp_path, tiny_datasets)
    assert stopped.value.exit_code == preemption.EXIT_CODE == 204  # retried by Kubeflow
    assert f"backup saved in {tmp_path / 'backup'}" in str(stopped.value)
    assert workdir.has_backup(tmp_path)
    # On its way out with exit code 204: a second SIGTERM must not kill it first.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    (epoch_1,) = json.loads((tmp_path / "backup" / "history.json").read_text())

    # The signal came during step 4's callbacks: the backup is of the step after.
    probe = attach(monkeypatch, Probe())
    metrics = _run(config, tmp_path, tiny_datasets)
    assert probe.seen[0] == (1, 6)
    assert metrics["steps"] == 3 * STEPS  # as a clean run: no step lost or done twice
    assert [row["epoch"] for row in metrics["history"]] == [1, 2, 3]
    assert metrics["history"][0] == epoch_1  # the first run's epoch, as it was
    assert not workdir.has_backup(tmp_path)  # emptied once training ended


@pytest.mark.parametrize("keras", KERASES)
def test_a_run_preempted_again_in_the_epoch_it_resumed_goes_on_from_its_second_backup(
        keras, tmp_path, tiny_datasets, monkeypatch):
    # The second backup is saved by a run that has ended no epoch of its own: it must
    # still record the epoch it resumed in, not the first.
    config = _config(*KERASES[keras])
    for stop_at in ((1, 4), (1, 10)):
        attach(monkeypatch, Probe(stop_at=stop_at, how="sigterm"))
        with pytest.raises(preemption.Preempted):
            _run(config, tmp_path, tiny_datasets)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    probe = attach(monkeypatch, Probe())
    metrics = _run(config, tmp_path, tiny_datasets)
    assert probe.seen[0] == (1, 12)
    assert metrics["steps"] == 3 * STEPS
    assert [row["epoch"] for row in metrics["history"]] == [1, 2, 3]


@pytest.mark.parametrize("keras", KERASES)
@pytest.mark.parametrize("every_steps, resumed_at", [(4, (1, 8)), (0, (1, 0))])
def test_a_crashed_run_loses_at_most_every_steps(keras, every_steps, resumed_at, tmp_path,
                                                 tiny_datasets, monkeypatch):
    config = _config(f"checkpoint.every_steps={every_steps}", *KERASES[keras])
    attach(monkeypatch, Probe(stop_at=(1, 10)))
    with pytest.raises(Interrupted):
        _run(config, tmp_path, tiny_datasets)
    probe = attach(monkeypatch, Probe())
    metrics = _run(config, tmp_path, tiny_datasets)
    # every_steps=4: backups after steps 4 and 8 of the epoch, so steps 9-11 are redone;
    # 0: the epoch is redone from its start.
    assert probe.seen[0] == resumed_at
    assert metrics["steps"] == 3 * STEPS
    assert [row["epoch"] for row in metrics["history"]] == [1, 2, 3]


def _model_on(strategy_):
    return types.SimpleNamespace(distribute_strategy=strategy_)


# The last step of each call in epoch 2 after a resume at step 5, 3 steps a call.
RESUMED_AT_THREE = {"keras2": (7, 10, 13, 15), "keras3": (5, 8, 11, 14, 15)}


@pytest.mark.parametrize("keras", KERASES)
def test_a_run_resumed_at_three_steps_per_execution_runs_each_step_once(
        keras, tmp_path, tiny_datasets, monkeypatch):
    # Stopped at one step a call, after step 5 of epoch 2; resumed at 3 a call. Keras 2
    # starts its calls at the step it resumes at; Keras 3's first call takes the one step
    # left before one of its calls' edges. Either's last call in an epoch (16 steps)
    # takes the steps left in it, and the next epoch starts at a call's start.
    attach(monkeypatch, Probe(stop_at=(1, 3), how="sigterm"))
    with pytest.raises(preemption.Preempted):
        _run(_config(*KERASES[keras]), tmp_path, tiny_datasets)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    probe = attach(monkeypatch, Probe())
    metrics = _run(_config("train.steps_per_execution=3", *KERASES[keras]), tmp_path,
                   tiny_datasets)
    resumed = RESUMED_AT_THREE[keras]
    assert probe.seen[:len(resumed)] == [(1, end) for end in resumed]
    assert probe.seen[len(resumed):len(resumed) + 6] == [
        (2, end) for end in (2, 5, 8, 11, 14, 15)]
    assert metrics["steps"] == 3 * STEPS
    assert [row["epoch"] for row in metrics["history"]] == [1, 2, 3]


def test_history_rows_of_epochs_a_resumed_run_redoes_are_dropped(tmp_path):
    # A run killed after epoch 2's row was written but before epoch 2's backup.
    path = tmp_path / "backup" / "history.json"
    path.parent.mkdir()
    path.write_text(json.dumps([{"epoch": 1, "loss": 0.5}, {"epoch": 2, "loss": 0.4}]))
    record = callbacks.HistoryRecord(path)
    record.set_model(_model_on(tf.distribute.get_strategy()))
    record.on_train_begin()
    record.on_epoch_begin(1)  # resumes in epoch 2
    record.on_epoch_end(1, {"loss": 0.3, "accuracy": 0.9})
    assert record.earlier == [{"epoch": 1, "loss": 0.5}]
    assert json.loads(path.read_text()) == [
        {"epoch": 1, "loss": 0.5}, {"epoch": 2, "accuracy": 0.9, "loss": 0.3}]
    record.on_train_end()
    assert not path.exists()


def test_a_run_resumed_after_its_last_epoch_reports_every_earlier_row(tmp_path):
    # Preempted as the last epoch ended: its backup holds every epoch, the rerun trains none.
    path = tmp_path / "backup" / "history.json"
    path.parent.mkdir()
    rows = [{"epoch": 1, "loss": 0.5}, {"epoch": 2, "loss": 0.4}]
    path.write_text(json.dumps(rows))
    record = callbacks.HistoryRecord(path)
    record.set_model(_model_on(tf.distribute.get_strategy()))
    record.on_train_begin()
    record.on_train_end()
    assert record.earlier == rows


def test_step_log_counts_from_the_runs_start_across_epochs(caplog):
    log = callbacks.StepLog(every=5)
    log.set_params({"steps": 8})
    with caplog.at_level(logging.INFO, logger="app.run.callbacks"):
        log.on_epoch_begin(1)  # a run resumed in epoch 2, at its step 1
        for begin, end in [(1, 2), (3, 4), (5, 6), (7, 7)]:  # steps_per_execution=2
            log.on_train_batch_begin(begin)
            log.on_train_batch_end(end)
    # Steps 10 to 16 were run; a call that passes a multiple of 5 logs the count it reached.
    assert [r.getMessage() for r in caplog.records] == ["step 11", "step 15"]


def test_step_log_holds_past_its_step_until_the_file_exists(tmp_path):
    release = tmp_path / "release"
    log = callbacks.StepLog(every=1, hold_at=3, hold_file=str(release))
    log.set_params({"steps": 10})
    messages, holding = [], threading.Event()

    class Record(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())
            if record.getMessage().startswith("holding"):
                holding.set()

    logger = logging.getLogger("app.run.callbacks")
    handler, level = Record(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

    def train():
        log.on_epoch_begin(0)
        for batch in range(5):
            log.on_train_batch_begin(batch)
            log.on_train_batch_end(batch)

    try:
        steps = threading.Thread(target=train)
        steps.start()
        assert holding.wait(timeout=60)
        assert steps.is_alive() and messages[-2:] == [
            "step 3", f"holding at step 3 until {release} exists (debug.hold_file)"]
        release.touch()
        steps.join(timeout=60)
        assert not steps.is_alive()
        assert messages[-3:] == ["hold released", "step 4", "step 5"]
    finally:
        release.touch()
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_sigterm_is_a_flag_only_while_installed():
    previous = signal.getsignal(signal.SIGTERM)
    sigterm = preemption.Sigterm()
    sigterm.install()
    try:
        signal.raise_signal(signal.SIGTERM)
        assert sigterm.requested()
    finally:
        sigterm.uninstall()
    assert signal.getsignal(signal.SIGTERM) is previous


def test_the_multi_worker_watcher_says_once_that_it_saw_sigterm(caplog):
    sigterm = preemption.Sigterm()
    noticed = preemption.watcher(sigterm)
    sigterm.install()
    try:
        with caplog.at_level(logging.INFO, logger=preemption.log.name):
            assert not noticed() and not caplog.messages
            signal.raise_signal(signal.SIGTERM)
            assert noticed()
    finally:
        sigterm.uninstall()
    assert caplog.messages == [preemption.AGREEING]
