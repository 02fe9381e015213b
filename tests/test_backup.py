"""The base of every backup (app.state.backup): when a save is due, the tracked
checkpoint and its position, and SIGTERM's save-then-stop."""

import logging
import os
import signal

import pytest
import tensorflow as tf

from app.cluster import preemption
from app.state import backup


@pytest.fixture
def sigterm_restored():
    """Backup.stop ignores SIGTERM from then on (the process is on its way out)."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_a_save_is_due_every_every_steps_steps_counted_from_the_last_save(tmp_path):
    weights = tf.Variable([1.0, 2.0])
    saved = backup.Backup(tmp_path / "chief", every_steps=3)
    saved.track(weights=weights)
    dues = []
    for _ in range(4):
        saved.steps_run()
        dues.append(saved.due())
    assert dues == [False, False, True, True]
    saved.save()
    assert not saved.due() and saved.since_save == 0
    assert not backup.Backup(tmp_path, every_steps=0).due()  # epoch ends only


def test_a_tracked_backup_restores_its_objects_and_position(tmp_path, caplog,
                                                            sigterm_restored):
    weights = tf.Variable([1.0, 2.0])
    first = backup.Backup(tmp_path / "chief")
    first.track(weights=weights)
    first.write(1, 5)
    weights.assign([0.0, 0.0])
    second = backup.Backup(tmp_path / "chief")
    second.track(weights=weights)
    with caplog.at_level(logging.INFO, logger="app.state.backup"):
        assert second.restore() == (1, 5)
    assert weights.numpy().tolist() == [1.0, 2.0]
    assert (second.epoch, second.step) == (1, 5)
    assert caplog.messages == [f"resumed from {first.manager.latest_checkpoint}: epoch 2, step 5"]
    second.delete()
    assert not (tmp_path / "chief").exists()
    assert signal.getsignal(signal.SIGTERM) is not second.sigterm._handle  # uninstalled


def test_without_a_backup_a_run_starts_at_the_first_step(tmp_path, sigterm_restored):
    fresh = backup.Backup(tmp_path / "chief")
    fresh.track(weights=tf.Variable(0.0))
    assert fresh.restore() == (0, 0)
    fresh.close()


def test_sigterm_saves_at_the_position_then_stops_with_preempted(tmp_path, caplog,
                                                                 sigterm_restored):
    weights = tf.Variable(3.0)
    run = backup.Backup(tmp_path / "chief", every_steps=100)
    run.track(weights=weights)
    run.restore()
    run.at(0, 4)
    run.stop_if_asked()  # no SIGTERM yet: goes on
    assert run.manager.latest_checkpoint is None
    os.kill(os.getpid(), signal.SIGTERM)  # handled: the process lives on
    run.at(0, 7)
    with caplog.at_level(logging.WARNING, logger="app.state.backup"), \
            pytest.raises(preemption.Preempted) as stopped:
        run.stop_if_asked()
    assert f"backup saved in {tmp_path / 'chief'}" in str(stopped.value)
    assert stopped.value.exit_code == preemption.EXIT_CODE
    assert caplog.messages == ["SIGTERM: backup of epoch 1, step 7 saved; stopping"]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # a second one is ignored
    again = backup.Backup(tmp_path / "chief")
    again.track(weights=tf.Variable(0.0))
    assert again.restore() == (0, 7)
    again.close()


def test_after_a_save_a_sigterm_stops_without_saving_again(tmp_path, sigterm_restored):
    run = backup.Backup(tmp_path / "chief")
    run.track(weights=tf.Variable(0.0))
    run.restore()
    run.write(2, 0)
    run.stop_if_saved_and_asked()  # no SIGTERM: goes on
    os.kill(os.getpid(), signal.SIGTERM)
    run.at(1, 16)
    latest = run.manager.latest_checkpoint
    with pytest.raises(preemption.Preempted):
        run.stop_if_saved_and_asked()
    assert run.manager.latest_checkpoint == latest
