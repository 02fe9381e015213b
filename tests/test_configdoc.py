"""docs/configuration.md is generated from the config dataclasses and stays in step."""

import dataclasses
import re

from app import config as cfg
from app.tasks.mnist import Mnist
from app.tasks.recommender import Recommender
from tools import configdoc


def documented_keys() -> set[str]:
    """Every `section.key` a user can set: each section's fields, and the built-in tasks'."""
    keys = set()
    for name, kind in configdoc.sections():
        keys |= {f"{name}.{f.name}" for f in dataclasses.fields(kind)}
    keys.discard("task.params")  # not a key: the rest of [task], the task's Params
    return keys | {f"task.{f.name}" for kind in (Mnist.Params, Recommender.Params)
                   for f in dataclasses.fields(kind)}


def test_the_file_is_up_to_date():
    text = configdoc.OUTPUT.read_text()
    assert text == configdoc.render(), (
        "docs/configuration.md is out of date: run `python -m tools.configdoc` (make docs)")


def test_every_field_of_every_section_has_a_row_with_its_meaning():
    rows = {}
    for line in configdoc.render().splitlines():
        match = re.match(r"^\| `([a-z_]+\.[a-z_0-9]+)` \| (.*) \|$", line)
        if match:
            rows[match[1]] = match[2].split(" | ")
    assert set(rows) == documented_keys()
    for key, (kind, default, allowed, meaning) in rows.items():
        assert kind in ("int", "float", "str", "bool"), key
        assert default and allowed, key
        assert meaning.strip(), f"{key} has no comment above it in its dataclass"


def test_every_section_has_a_heading_and_a_description():
    text = configdoc.render()
    for name, kind in configdoc.sections():
        assert f"## `[{name}]`" in text
        assert configdoc.comments(kind)[0], f"[{name}] ({kind.__name__}) has no docstring"


def test_rows_quote_the_defaults_and_rules():
    rows = {r.key: r for name, kind in configdoc.sections() for r in configdoc.rows(name, kind)}
    assert rows["train.epochs"].default == "`5`" and rows["train.epochs"].allowed == "> 0"
    assert rows["train.final_lr_fraction"].allowed == "in [0, 1]"
    assert rows["runtime.strategy"].allowed.startswith('`"auto"`, `"default"`')
    assert rows["train.jit_compile"].allowed == "`true`, `false`"
    assert rows["ps.shard_bytes"].default == f"`{cfg.PSConfig().shard_bytes}`"
    dropout = {r.key: r for r in configdoc.rows("task", Mnist.Params)}["task.dropout"]
    assert dropout.allowed == "in [0, 1)"


def test_comments_are_read_from_above_the_field_and_its_own_line():
    @dataclasses.dataclass(frozen=True)
    class Example:
        """An example section."""

        # First line,
        # second line.
        a: int = cfg.field(1, minimum=0)

        b: str = "x"  # trailing
        # Not b's: a blank line separates it from c.

        c: bool = True

    doc, notes = configdoc.comments(Example)
    assert doc == "An example section."
    assert notes == {"a": "First line, second line.", "b": "trailing", "c": ""}
    assert configdoc.markdown("a|b <c> `<d>`") == "a\\|b &lt;c> `<d>`"
