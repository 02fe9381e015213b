"""Every config field's bad values, generated from the config dataclasses (and the
MNIST task's Params): a wrong type for each field and an out-of-range value for each
bounded one, through --set and through a TOML file. Each is refused by the command
line with exit code 2 and one line that names the field, before anything is written."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from app import config as cfg
from app import train
from app.tasks.mnist import Mnist


def fields():
    """(section, field) for every field the user can set."""
    for section in dataclasses.fields(cfg.Config):
        if section.name != "task":  # its name is free text; its parameters are below
            for f in dataclasses.fields(getattr(cfg.Config(), section.name)):
                yield section.name, f
    for f in dataclasses.fields(Mnist.Params):
        yield "task", f


def wrong_type(f: dataclasses.Field) -> str:
    """A TOML value of another type than the field's (ints widen to floats, numbers
    to strings: neither counts as wrong)."""
    return {bool: "3", int: '"three"', float: '"x"', str: "true"}[type(f.default)]


def out_of_range(f: dataclasses.Field) -> list[str]:
    rules = f.metadata
    values = []
    if "choices" in rules:
        values.append('"not-a-choice"')
    for key, step in (("minimum", -1), ("above", 0), ("maximum", 1), ("below", 0)):
        if key in rules:
            values.append(json.dumps(rules[key] + step))
    return values


CASES = [(f"{section}.{f.name}", value) for section, f in fields()
         for value in (wrong_type(f), *out_of_range(f))]


def test_the_generated_cases_cover_every_field_and_bound():
    assert {key for key, _ in CASES} == {f"{s}.{f.name}" for s, f in fields()}
    assert len(CASES) >= 60


@pytest.mark.parametrize("key, value", CASES)
@pytest.mark.parametrize("via", ["--set", "toml"])
def test_a_bad_value_exits_2_naming_the_field(key, value, via, tmp_path, capsys):
    if via == "--set":
        args = ["--set", f"{key}={value}"]
    else:
        section, name = key.split(".")
        (tmp_path / "bad.toml").write_text(f"[{section}]\n{name} = {value}\n")
        args = ["--config", str(tmp_path / "bad.toml")]
    assert train.main([*args, "--workdir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and key in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key, value", [("train.epochs", "0"), ("task.dropout", "1.5"),
                                        ("ps.mode", "semi")])
def test_the_command_line_process_exits_2_without_a_traceback(key, value, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    result = subprocess.run([sys.executable, "-m", "app.train", "--set", f"{key}={value}",
                             "--workdir", str(tmp_path / "run")],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(f"error: {key} = ")
    assert not (tmp_path / "run").exists()
