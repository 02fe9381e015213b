"""The layering docs/architecture.md states, held against every import of the code.

The table there places each file of app/, launch/ and tools/ on a floor; a file
may import its own floor and those below. Imports inside functions count: they
run too, only later.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("app", "launch", "tools")


def layers(page: str) -> list[tuple[int, str, list[str]]]:
    """(floor, layer, paths) of each row of the page's table of layers."""
    rows = []
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isdigit():
            rows.append((int(cells[0]), cells[1], re.findall(r"`([\w/.]+(?:/|\.py))`", cells[2])))
    return rows


def floor_of(path: str, rows) -> int | None:
    """The floor of the row whose path holds `path` most closely (a file beats its folder)."""
    found = [(len(p), floor) for floor, _, paths in rows for p in paths
             if path == p or (p.endswith("/") and path.startswith(p))]
    return max(found)[1] if found else None


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Every module of the packages under `root`, by dotted name (a package by its own)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The modules of `known` that `path` imports: `from P import n` is module P.n when
    there is one, else P."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in known:
                    found.add(full)
                elif node.module in known:
                    found.add(node.module)
    return found


def graph(root: pathlib.Path) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports(path, known) for name, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return groups


def path_of(name: str, root: pathlib.Path) -> str:
    return str(modules(root)[name].relative_to(root))


def violations(root: pathlib.Path, page: str) -> list[str]:
    """Each import against the page's layers, each file it does not place, each circle."""
    rows = layers(page)
    edges = graph(root)
    paths = {name: path_of(name, root) for name in edges}
    problems = [f"{path}: on no floor of docs/architecture.md's table"
                for path in paths.values()
                if floor_of(path, rows) is None and not path.endswith("__init__.py")]
    for name, targets in sorted(edges.items()):
        here = floor_of(paths[name], rows)
        for target in sorted(targets):
            there = floor_of(paths[target], rows)
            if here is not None and there is not None and there > here:
                problems.append(f"{paths[name]} (floor {here}) imports {paths[target]} "
                                f"(floor {there}): an import that points back up")
    problems += [f"import circle: {' -> '.join(group)}" for group in circles(edges)]
    return problems


def test_the_code_keeps_the_layers_that_docs_architecture_states():
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert len(layers(page)) >= 10, "docs/architecture.md lost its table of layers"
    problems = violations(ROOT, page)
    assert not problems, "\n".join(problems)


def test_nothing_in_the_library_imports_a_launcher_or_a_tool():
    edges = graph(ROOT)
    assert [(name, target) for name, targets in edges.items() if name.startswith("app")
            for target in targets if not target.startswith("app")] == []


PAGE = """
| floor | layer | packages and modules | what |
|---|---|---|---|
| 2 | top | `app/top.py`, `app/sub/` | |
| 1 | base | `app/base.py` | |
"""


@pytest.mark.parametrize("files, problem", [
    ({"app/base.py": "from app import top\n", "app/top.py": ""},
     "app/base.py (floor 1) imports app/top.py (floor 2): an import that points back up"),
    ({"app/base.py": "def f():\n    import app.sub.deep\n", "app/sub/deep.py": ""},
     "app/base.py (floor 1) imports app/sub/deep.py (floor 2): an import that points back up"),
    ({"app/top.py": "from app.sub import deep\n", "app/sub/deep.py": "from app import top\n"},
     "import circle: app.sub.deep -> app.top"),
    ({"app/stray.py": ""}, "app/stray.py: on no floor of docs/architecture.md's table"),
])
def test_the_check_finds_what_breaks_the_layers(tmp_path, files, problem):
    for name, text in {"app/__init__.py": "", "app/sub/__init__.py": "", **files}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert violations(tmp_path, PAGE) == [problem]


def test_a_layered_tree_passes(tmp_path):
    for name, text in {"app/__init__.py": "", "app/sub/__init__.py": "",
                       "app/base.py": "import os\n", "app/top.py": "from app import base\n",
                       "app/sub/deep.py": "from app.top import x\n"}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert violations(tmp_path, PAGE) == []
