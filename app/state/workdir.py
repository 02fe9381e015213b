"""The run's working directory: never overwrite a finished run, resume an interrupted one."""

from __future__ import annotations

import argparse
import datetime
import errno
import json
import logging
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from app import config as cfg

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.json"
BACKUP_DIR = "backup"
CHECKPOINT_DIR = "checkpoints"  # ckpt-<epoch>, read by the evaluator
HISTORY_FILE = "history.json"  # in BACKUP_DIR: the finished epochs' history rows
# Beside config.toml: the cluster that wrote the backup (strategy, workers, ps,
# replicas). Not in BACKUP_DIR, which any file there makes a backup to resume.
SHAPE_FILE = "shape.json"
# Every entry a run may write in its workdir, a folder's name ending in "/". docs/outputs.md
# says what each holds; tests/test_docs.py holds the pages to this list, and
# tests/test_trainer.py a trained run's workdir.
LAYOUT = ("config.toml", METRICS_FILE, SHAPE_FILE, f"{CHECKPOINT_DIR}/", "tensorboard/",
          "export/", "model.keras", f"{BACKUP_DIR}/", "eval/", "arrays/", "data_service/")

# Why a write fails that no retry will fix, by errno (an OSError's) or by the
# strerror text TensorFlow's file system puts in its errors' messages.
_STORAGE_FAULTS = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded",
                   errno.EROFS: "Read-only file system", errno.EACCES: "Permission denied"}


class StorageError(cfg.ConfigError):
    """The workdir cannot be written: full, read-only or not ours. Like a config
    mistake it ends the run with exit code 2, as restarting cannot fix it."""


class ExportFailed(RuntimeError):
    """The run trained and wrote its results, and its SavedModel (or .keras file)
    could not be written: `metrics` are the run's, written to metrics.json."""

    # Not retried by launchers: the same model fails to export again, and a relaunch
    # finds the finished run's metrics.json (exit 2). Below 128, so that Kubeflow's
    # ExitCode policy fails the job rather than restart it (docs/troubleshooting.md).
    exit_code = 6

    def __init__(self, message: str, metrics: dict[str, Any]):
        super().__init__(message)
        self.metrics = metrics


def default_path() -> pathlib.Path:
    return pathlib.Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def given(train_args: list[str]) -> str | None:
    """The `--workdir` in a trainer's arguments as `app.train` reads them
    (`--workdir DIR` or `--workdir=DIR`, the last one if several), or None."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--workdir")
    return parser.parse_known_args(train_args)[0].workdir


# Settings that say how or where a run's parts run, not what it trains: a resumed
# run may change them, and logs what changed. A relaunched tf.data service listens
# on a new port; a launcher sets the thread counts per host (launch.local: cores /
# workers, workers + 1), so a run resumed on fewer workers gets other ones; the
# memory limit, the CPU allocator and a logical GPU's memory bound what a process
# may hold, not what it computes; spinning threads change how soon an op starts; a
# closure's steps unrolled (ps.unroll) or looped are the same steps in the same order.
# Not runtime.onednn (other kernels, other rounding) nor cpu_devices / gpu_devices
# (the number of replicas of a Mirrored run).
HOW_NOT_WHAT = frozenset({
    "data.service", "runtime.intra_op_threads", "runtime.inter_op_threads",
    "runtime.memory_limit_gib", "runtime.cpu_allocator", "runtime.gpu_device_memory_mib",
    "runtime.thread_spinning", "ps.unroll"})


def finished(path: pathlib.Path) -> bool:
    """Whether `path` holds a finished run: its metrics.json, written once training
    has ended (by the chief of a parameter-server cluster before it lets its ps
    and worker tasks go)."""
    return (path / METRICS_FILE).exists()


def refuse_finished(path: pathlib.Path) -> None:
    """ConfigError when `path` holds a finished run: training into it again would
    overwrite its results. Reads one name, so that a chief says so before
    TensorFlow starts, and its ps and worker tasks hear it (chief_failure)."""
    if finished(path):
        raise cfg.ConfigError(
            f"--workdir {path} already holds a finished run ({METRICS_FILE}); "
            "choose a new --workdir")


def check(path: pathlib.Path, config: cfg.Config) -> None:
    """Explain why this run cannot use `path`, writing nothing.

    A workdir with metrics.json holds a finished run (`refuse_finished`). One
    with a backup holds an interrupted run, which BackupAndRestore resumes, but
    only under the same config: a resumed run under another would mix two
    experiments. A workdir with neither (a run that stopped on an error before
    its first epoch ended) is simply reused.
    """
    refuse_finished(path)
    saved = path / "config.toml"
    if saved.exists() and has_backup(path):
        _check_resumed_config(path, cfg.flatten(cfg.load(str(saved))), cfg.flatten(config))


def prepare(path: pathlib.Path, config: cfg.Config) -> pathlib.Path:
    """Create `path` and write the config there, or explain why this run cannot use it
    (`check`)."""
    check(path, config)
    try:
        path.mkdir(parents=True, exist_ok=True)
        # Every task of a cluster writes it, while a relaunched peer may be reading
        # it. Also the probe of the storage: a workdir that cannot take this file
        # (read-only, full) is found before training, not at the first backup.
        write_text(path / "config.toml", cfg.to_toml(config))
    except OSError as e:
        raise storage_error(e, path) or e from None
    return path


def _check_resumed_config(path: pathlib.Path, before: dict[str, Any],
                          now: dict[str, Any]) -> None:
    """Refuse a resume under another experiment; log the host settings that changed."""
    changed = {k: (before.get(k), v) for k, v in now.items() if before.get(k) != v}
    refused = [f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items() if k not in HOW_NOT_WHAT]
    if refused:
        raise cfg.ConfigError(
            f"--workdir {path} holds an interrupted run with a different config "
            f"({'; '.join(refused)}); resume it with the same config, or choose a new "
            "--workdir")
    if changed:
        log.info("resuming with %s", ", ".join(f"{k} {a!r} -> {b!r}"
                                              for k, (a, b) in changed.items()))


# Kinds of run whose backups the project does not resume into each other: their
# checkpoints differ (a ps run's variables are sharded over ps tasks, its steps
# counted by a coordinator) and no test shows such a resume to train correctly.
# Every other strategy (default, Mirrored) is one process. The fix per earlier kind.
# A run resumes under its kind of strategy: its backup's layout and how its steps
# update the variables are the kind's. The synchronous strategies (one process,
# Mirrored, MultiWorkerMirrored) resume into each other on any number of workers.
_KINDS = {"ParameterServerStrategy": "a TF_CONFIG that has ps tasks"}
_SYNCHRONOUS = "one process or a TF_CONFIG of worker tasks, without ps tasks"


def resume_shape(path: pathlib.Path, shape: dict[str, Any], writes: bool) -> None:
    """Check that an interrupted run in `path` resumes under its kind of strategy, log
    how its cluster `shape` changed, and (if this task `writes`) record the new one.

    `shape`: strategy (a class name), workers, ps, replicas. Every task checks, so
    that all of a cluster's tasks refuse alike; the refusal leaves the backup and
    SHAPE_FILE as they were, for a resume under the right cluster."""
    saved = path / SHAPE_FILE
    if has_backup(path) and saved.exists():
        before = json.loads(saved.read_text())
        if _KINDS.get(before["strategy"]) != _KINDS.get(shape["strategy"]):
            raise cfg.ConfigError(
                f"--workdir {path} holds an interrupted {before['strategy']} run; resuming "
                f"it under {shape['strategy']} is not supported: resume it with "
                f"{_KINDS.get(before['strategy'], _SYNCHRONOUS)}, or start a new --workdir")
        changes = _shape_changes(before, shape)
        if changes and writes:
            log.info("resuming %s", ", ".join(changes))
    if writes:
        path.mkdir(parents=True, exist_ok=True)  # tests call trainer.run without prepare
        write_json(saved, shape)


def _shape_changes(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """How the cluster `now` differs from the one `before`, as parts of one log line."""
    def was(key: str, what: str) -> str:
        return f"{now[key]} {what}{'' if now[key] == 1 else 's'} (was {before.get(key)})"

    changes = []
    if before.get("strategy") != now["strategy"]:
        changes.append(f"under {now['strategy']} (was {before.get('strategy')})")
    if before.get("workers") != now["workers"]:
        changes.append(f"on {was('workers', 'worker')}")
    if before.get("ps") != now["ps"]:
        # The partitioner places the variables anew. Every backup of a ps run saves a
        # sharded variable, and each of its optimizer slots, whole (one slice per shard)
        # and restores it into any number of shards; tests/test_resume_shards.py
        # compares them after 2 -> 3 -> 1 -> 2 shards (ParameterServerStrategy's own
        # docstring still says the number must not change).
        changes.append(f"with {was('ps', 'ps task')}: sharded variables and their "
                       "optimizer slots are restored into the new number of shards")
    if before.get("replicas") != now["replicas"]:
        changes.append(f"with {was('replicas', 'replica')}")
    return changes


def has_backup(path: pathlib.Path) -> bool:
    """Whether BackupAndRestore left training state to resume in `path`."""
    backup = path / BACKUP_DIR
    return backup.is_dir() and any(p.is_file() for p in backup.rglob("*"))


def storage_error(error: BaseException, workdir: pathlib.Path) -> StorageError | None:
    """A full, read-only or forbidden workdir behind `error` (an OSError, or a
    TensorFlow error that wraps one), as one line that names the path; else None."""
    code = getattr(error, "errno", None)
    text = str(getattr(error, "message", "") or error)
    reason = _STORAGE_FAULTS.get(code) or next(
        (r for r in _STORAGE_FAULTS.values() if r.lower() in text.lower()), None)
    if reason is None:
        return None
    full = reason in (_STORAGE_FAULTS[errno.ENOSPC], _STORAGE_FAULTS[errno.EDQUOT])
    filename = getattr(error, "filename", None)
    if filename and not pathlib.Path(filename).is_relative_to(workdir):
        # E.g. a MultiWorkerMirrored worker's outputs, in the temporary directory.
        fix = "free some space there" if full else "make it writable"
        return StorageError(f"cannot write {filename}: {reason}; {fix}")
    fix = ("free some space there or choose a --workdir on another disk" if full
           else "choose a --workdir this process can write")
    return StorageError(f"cannot write to --workdir {workdir}: {reason}; {fix}")


def write_text(path: pathlib.Path, text: str) -> None:
    """Write `text` to `path` atomically: a reader sees the old file or the new one, never a
    truncated one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)  # a full disk keeps no half-written file
        raise


def save_dir(path: pathlib.Path, save: Callable[[pathlib.Path], None]) -> None:
    """Run `save(directory)` into a temporary sibling of `path`, then rename it to
    `path`: `path` holds a whole save or none (a directory cannot be replaced in
    one rename, so an earlier one is moved aside first and removed after)."""
    tmp = pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-"))
    try:
        save(tmp)
        if path.exists():
            old = pathlib.Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}-old-"))
            os.replace(path, old / path.name)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already, unless the save failed


def write_json(path: pathlib.Path, value: Any) -> None:
    write_text(path, json.dumps(value, indent=2) + "\n")
