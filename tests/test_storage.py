"""A workdir that cannot be written: a read-only or full file system (a small tmpfs
mounted for the test; it needs root) ends the run with exit code 2 and one line
that names the workdir, before training where it can be known then."""

import os
import pathlib
import subprocess
import sys

import pytest

from app import config as cfg
from app.state import workdir


@pytest.fixture
def mount_tmpfs(tmp_path):
    """mount(size, read_only=False): a fresh tmpfs under tmp_path, unmounted afterwards."""
    mounted = []

    def mount(size: str, read_only: bool = False) -> pathlib.Path:
        path = tmp_path / f"fs{len(mounted)}"
        path.mkdir()
        options = f"size={size}" + (",ro" if read_only else "")
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                                capture_output=True, text=True)
        if result.returncode:
            pytest.skip(f"cannot mount a tmpfs here (root only): {result.stderr.strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", str(path)], check=False)


def _fill(path: pathlib.Path) -> None:
    with open(path / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass


def test_a_read_only_workdir_is_refused_before_training(mount_tmpfs):
    run = mount_tmpfs("1m", read_only=True) / "run"
    with pytest.raises(workdir.StorageError) as e:
        workdir.prepare(run, cfg.Config())
    assert str(e.value) == (f"cannot write to --workdir {run}: Read-only file system; "
                            "choose a --workdir this process can write")


def test_a_full_workdir_is_refused_before_training(mount_tmpfs):
    disk = mount_tmpfs("64k")
    _fill(disk)
    with pytest.raises(workdir.StorageError) as e:
        workdir.prepare(disk / "run", cfg.Config())
    assert str(e.value).startswith(
        f"cannot write to --workdir {disk / 'run'}: No space left on device; free some space")
    assert not [p for p in (disk / "run").iterdir()]  # no half-written config.toml


def _train(workdir_: pathlib.Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    return subprocess.run(
        [sys.executable, "-m", "app.train", "--set", "task.train_examples=256",
         "--set", "task.validation_examples=0", "--set", "task.test_examples=64",
         "--set", "train.epochs=1", "--set", "train.verbose=0", "--set", "task.model=mlp",
         "--workdir", str(workdir_)], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_disk_that_fills_up_mid_run_ends_it_with_one_line_and_exit_code_2(mount_tmpfs):
    # 1 MiB takes the config, not the first backup (the MLP and its Adam slots: 6 MiB).
    run = mount_tmpfs("1m") / "run"
    result = _train(run)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: cannot write to --workdir {run}: No space left on device; free some space "
        "there or choose a --workdir on another disk")
    assert not (run / "metrics.json").exists() and not (run / "export").exists()


def test_the_command_line_refuses_a_read_only_workdir_with_exit_code_2(mount_tmpfs):
    run = mount_tmpfs("1m", read_only=True) / "run"
    result = _train(run)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: cannot write to --workdir {run}: Read-only file system; "
        "choose a --workdir this process can write")
