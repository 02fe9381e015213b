"""The run's working directory: never overwrite a finished run, resume an interrupted one."""

from __future__ import annotations

import argparse
import datetime
import errno
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from app import config as cfg

METRICS_FILE = "metrics.json"
BACKUP_DIR = "backup"
CHECKPOINT_DIR = "checkpoints"  # ckpt-<epoch>, read by the evaluator
HISTORY_FILE = "history.json"  # in BACKUP_DIR: the finished epochs' history rows

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


# Settings that say where a run's parts are, not what it trains: a resumed run may
# change them (a relaunched tf.data service listens on a new port).
WHERE_NOT_WHAT = frozenset({"data.service"})


def prepare(path: pathlib.Path, config: cfg.Config) -> pathlib.Path:
    """Create `path` and write the config there, or explain why this run cannot use it.

    A workdir with metrics.json holds a finished run: training into it again
    would overwrite its results. One with a backup holds an interrupted run,
    which BackupAndRestore resumes, but only under the same config: a resumed
    run under another would mix two experiments. A workdir with neither (a run
    that stopped on an error before its first epoch ended) is simply reused.
    """
    if (path / METRICS_FILE).exists():
        raise cfg.ConfigError(
            f"--workdir {path} already holds a finished run ({METRICS_FILE}); "
            "choose a new --workdir")
    saved = path / "config.toml"
    if saved.exists() and has_backup(path):
        before = cfg.flatten(cfg.load(str(saved)))
        changed = [f"{k}: {before.get(k)!r} -> {v!r}" for k, v in cfg.flatten(config).items()
                   if before.get(k) != v and k not in WHERE_NOT_WHAT]
        if changed:
            raise cfg.ConfigError(
                f"--workdir {path} holds an interrupted run with a different config "
                f"({'; '.join(changed)}); resume it with the same config, or choose a new "
                "--workdir")
    try:
        path.mkdir(parents=True, exist_ok=True)
        # Every task of a cluster writes it, while a relaunched peer may be reading
        # it. Also the probe of the storage: a workdir that cannot take this file
        # (read-only, full) is found before training, not at the first backup.
        write_text(path / "config.toml", cfg.to_toml(config))
    except OSError as e:
        raise storage_error(e, path) or e from None
    return path


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
