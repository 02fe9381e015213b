"""Every example of an epoch trained on once across failures, resumes and a change of
cluster shape, when a task gives its examples by index (app/indexed.py), end to end
under `launch.local`: the numbered task (tests/numbered.py) counts each example's
visits where its update was applied. Its examples are read from TFRecord files at
their offsets (`data.indexed_records`), every task under a memory limit."""

import json
import signal

import pytest

from tests import launching

pytestmark = pytest.mark.slow

EXAMPLES, BATCH = 4096, 16  # 256 steps
CLOSURE = 4  # steps per closure under parameter servers


def numbered(workdir, *args: str) -> tuple[str, ...]:
    # Shards of 64 examples in windows of 3: 22 windows an epoch, some read while a
    # task was down; the files under the workdir's parent, shared by its runs.
    return (*args, "--workdir", str(workdir), "--set", "task.name=tests.numbered:RecordsNumbered",
            "--set", f"task.records_dir={workdir.parent / 'records'}", "--set", "task.files=5",
            "--set", "data.shard_examples=64", "--set", "data.window_shards=3",
            "--set", "runtime.memory_limit_gib=1.5",
            "--set", f"task.examples={EXAMPLES}", "--set", "train.epochs=1",
            "--set", f"train.global_batch_size={BATCH}", "--set", "train.verbose=0",
            "--set", "eval.test_every_epoch=false", "--set", "debug.log_every_steps=10",
            "--set", "checkpoint.every_steps=20")


def visits(workdir, window: int = 0) -> dict:
    """The visit counts of the run in `workdir`, which took every step once, or up to
    `window` steps twice."""
    metrics = json.loads((workdir / "metrics.json").read_text())
    assert metrics["input"] == "by_index", metrics
    assert EXAMPLES // BATCH <= metrics["steps"] <= EXAMPLES // BATCH + window, metrics
    return {k: v for k, v in metrics.items() if k.startswith("visits_")}


def test_parameter_servers_lose_and_repeat_nothing_when_a_worker_and_the_chief_die(tmp_path):
    # 4 steps a closure (train.steps_per_execution): a closure run again runs its 4.
    release = tmp_path / "release"  # the chief holds at 150 until both are dead
    launcher = launching.launch(*numbered(tmp_path / "run", "--workers", "2", "--ps", "1",
                                          "--restart", "task"),
                                "--set", f"train.steps_per_execution={CLOSURE}",
                                *launching.hold(150, release))
    output, killed = launching.signal_at_steps(launcher, "chief:0",
                                               {60: "worker:1", 150: "chief:0"},
                                               release=release)
    launcher.wait(timeout=120)
    assert killed == 2 and launcher.returncode == 0, output[-4000:]
    assert "[launch] restart 1 of 3: chief:0 alone" in output
    assert "resumed from" in output  # the chief went on from its backup
    # The one window: a worker that died after (part of) its closure's updates reached
    # the ps, before the chief saw the closure end, has that closure's steps run again.
    # The updates of one step are not ordered among themselves: the step counter may
    # have counted one when the visit counter had not (seen once at one step a closure:
    # 257 steps, every example once).
    counts = visits(tmp_path / "run", window=CLOSURE)
    assert counts["visits_0"] == 0 and counts["visits_2plus"] <= CLOSURE * BATCH, counts
    assert counts["visits_1"] + counts["visits_2plus"] == EXAMPLES


def test_multi_worker_mirrored_resumed_on_one_worker_trains_each_example_once(tmp_path):
    workdir, release = tmp_path / "run", tmp_path / "release"
    held = launching.hold(64, release)  # until worker 1 has seen SIGTERM; no hold on resuming
    launcher = launching.launch(*numbered(workdir, "--workers", "2", "--ps", "0"), *held)
    output, sent = launching.signal_at_step(launcher, "worker:0", 60, "worker:1",
                                            signal.SIGTERM, release=release,
                                            released_by=launching.sigterm_seen("worker:1"))
    assert sent and launcher.wait(timeout=120) == 204, output[-4000:]
    again = launching.launch(*numbered(workdir, "--workers", "1", "--ps", "0"), *held)
    rerun, _ = again.communicate(timeout=600)
    assert again.returncode == 0, rerun[-4000:]
    assert ("resuming under DefaultStrategy (was MultiWorkerMirroredStrategy), on 1 worker "
            "(was 2), with 1 replica (was 2)") in rerun
    assert visits(workdir)["visits_1"] == EXAMPLES


def mnist(workdir) -> tuple[str, ...]:
    return ("--workers", "2", "--ps", "0", "--workdir", str(workdir),
            "--set", "train.deterministic=true", "--set", "task.model=cnn",
            "--set", "task.train_examples=640", "--set", "task.validation_examples=0",
            "--set", "task.test_examples=64", "--set", "train.epochs=1",
            "--set", "train.verbose=0", "--set", "debug.log_every_steps=1")


def test_multi_worker_mirrored_stopped_and_resumed_ends_bit_for_bit_with_determinism(tmp_path):
    clean = launching.launch(*mnist(tmp_path / "clean"))
    output, _ = clean.communicate(timeout=600)
    assert clean.returncode == 0, output[-4000:]
    # The 20-step run holds at step 12 until worker 1 says it has seen SIGTERM (sent at
    # step 8 as read from the output, which may lag the run by seconds on a busy
    # machine): it cannot end before the workers agree on a step to save at.
    release = tmp_path / "release"  # there when the run resumes: no hold then
    stopped = (*mnist(tmp_path / "stopped"), *launching.hold(12, release))
    launcher = launching.launch(*stopped)
    output, sent = launching.signal_at_step(
        launcher, "worker:0", 8, "worker:1", signal.SIGTERM, release=release,
        released_by=launching.sigterm_seen("worker:1"))
    assert sent and launcher.wait(timeout=120) == 204, output[-4000:]
    again = launching.launch(*stopped)
    rerun, _ = again.communicate(timeout=600)
    assert again.returncode == 0, rerun[-4000:]
    assert launching.steps_reported(rerun, "worker:0")[0] > 8  # resumed mid-epoch
    digests = [json.loads((tmp_path / run / "metrics.json").read_text())["weights_sha256"]
               for run in ("clean", "stopped")]
    assert digests[0] == digests[1]
