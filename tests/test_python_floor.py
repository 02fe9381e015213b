"""The Python the README promises is the one pyproject.toml declares, ruff checks the
code for, and the code needs: the syntax and the standard library of that version."""

from __future__ import annotations

import ast
import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("app", "launch", "tools", "tests", "examples")
# Standard-library modules new in Python 3.10 to 3.13 (their "What's New"), which an
# older Python cannot import; ast.parse(feature_version=) checks the syntax.
NEWER_STDLIB = {"tomllib": (3, 11), "wsgiref.types": (3, 11)}


def stated_floor(readme: str) -> tuple[int, int]:
    found = re.search(r"Python (3)\.(\d+)[–-]3\.\d+", readme)
    assert found, "README.md no longer says which Pythons it runs on (Python 3.X–3.Y)"
    return int(found[1]), int(found[2])


def needs_newer(path: pathlib.Path, floor: tuple[int, int]) -> list[str]:
    """What `path` uses that Python `floor` does not have."""
    tree = ast.parse(path.read_text(), str(path), feature_version=floor)  # SyntaxError: syntax
    found = []
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        found += [f"{path.name} imports {name}, new in Python "
                  f"{'.'.join(map(str, NEWER_STDLIB[name]))}"
                  for name in names if NEWER_STDLIB.get(name, floor) > floor]
    return found


def test_the_readme_pyproject_and_ruff_state_one_floor_and_the_code_runs_on_it():
    floor = stated_floor((ROOT / "README.md").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    requires = project["project"]["requires-python"]
    assert re.match(rf">=\s*{floor[0]}\.{floor[1]}\b", requires), (requires, floor)
    assert project["tool"]["ruff"]["target-version"] == f"py{floor[0]}{floor[1]}"
    newer = [problem for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
             for problem in needs_newer(path, floor)]
    assert not newer, f"README.md promises Python {floor[0]}.{floor[1]}: " + "; ".join(newer)


def test_a_module_newer_than_the_floor_is_named(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import tomllib\n")
    assert needs_newer(module, (3, 10)) == ["m.py imports tomllib, new in Python 3.11"]
    assert needs_newer(module, (3, 11)) == []
