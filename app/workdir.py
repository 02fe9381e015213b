"""The run's working directory: never overwrite a finished run, resume an interrupted one."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import tempfile
from typing import Any

from app import config as cfg

METRICS_FILE = "metrics.json"
BACKUP_DIR = "backup"
CHECKPOINT_DIR = "checkpoints"  # ckpt-<epoch>, read by the evaluator


def default_path() -> pathlib.Path:
    return pathlib.Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


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
                   if before.get(k) != v]
        if changed:
            raise cfg.ConfigError(
                f"--workdir {path} holds an interrupted run with a different config "
                f"({'; '.join(changed)}); resume it with the same config, or choose a new "
                "--workdir")
    path.mkdir(parents=True, exist_ok=True)
    # Every task of a cluster writes it, while a relaunched peer may be reading it.
    write_text(path / "config.toml", cfg.to_toml(config))
    return path


def has_backup(path: pathlib.Path) -> bool:
    """Whether BackupAndRestore left training state to resume in `path`."""
    backup = path / BACKUP_DIR
    return backup.is_dir() and any(p.is_file() for p in backup.rglob("*"))


def write_text(path: pathlib.Path, text: str) -> None:
    """Write `text` to `path` atomically: a reader sees the old file or the new one, never a
    truncated one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(path: pathlib.Path, value: Any) -> None:
    write_text(path, json.dumps(value, indent=2) + "\n")
