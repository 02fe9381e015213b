"""The pages checked against the code: every command, flag, config key, path, exit code and
code name that README.md and docs/*.md (and the commands in configs/, examples/ and
experiments/) state.

`check(root)` returns the problems, each `page:line: what is wrong`; tests/test_docs.py
runs it on this project and on small pages with one defect each. Run by hand,
`python -m tests.doccheck [ROOT]` prints them (ROOT: another checkout, with its own
code on PYTHONPATH, e.g. an older commit's pages against that commit's code).

What the pages are held to, all read from the code, never from a list kept here:
- `python -m M`: M is a module of the project (or an installed one); `make T`: a target of
  the Makefile; `tf-train`: a script of pyproject.toml; a script or manifest path exists.
- Flags: the real argparse parser of each command, captured when its `main()` calls
  `parse_args` / `parse_known_args` (which then raise before parsing anything). A
  command whose parser uses `parse_known_args` passes the rest on to `app.train`.
  Required flags and positionals must be there (a full command) and chosen values
  must be among the choices. A table headed `flag` lists exactly its command's flags.
- `--set section.key=value`, and `section.key` in code spans: a field of app/config.py's
  sections, or a parameter of the task the command trains (its `task.name`, else its
  `--config`'s, else mnist; a task of the user's own is read from the pages' code).
- Paths: in the repository (from the root or the page's folder), or an entry of a
  run's workdir as app/state/workdir.py declares them (`LAYOUT`); docs/outputs.md lists
  exactly those. Links' `#anchors` name a heading of their page.
- Exit codes: those the code sets (constants named *EXIT_CODE / exit_code, `return N`
  of a `main`, `sys.exit(N)`), 0, 1 (an uncaught exception), 2 (argparse), or a
  signal's (128+N, -N, 256-N). docs/troubleshooting.md's table lists every one.
- Code names: `app.x.y`, `module.name` (a module of the project by its last name),
  `Class.member`, "`name` in `path.py`", "`path.py`, `name`", and the first cells of a
  table under a heading that names a module or class.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import importlib
import importlib.util
import os
import re
import shlex
import signal
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

PACKAGES = ("app", "launch", "tools", "tests", "examples", "experiments")
EXTENSIONS = ("py", "toml", "json", "md", "yaml", "yml", "png", "sbatch", "txt", "keras", "conf",
              "log", "sh")
# Flags of other programs that the pages name (sbatch, srun, unshare, pytest, the classic
# TF1 example): not checked, since their parsers are not the project's.
EXTERNAL_FLAGS = {"--signal", "--requeue", "--no-requeue", "--nodes", "--ntasks",
                  "--ntasks-per-node", "--cpus-per-task", "--mem", "--mem-per-cpu", "--time",
                  "--open-mode", "--kill-on-bad-exit", "--distribution", "--net", "--durations",
                  "--job_name", "--task_index", "--format", "--dist", "--cov"}
IGNORED = {".git", ".venv", "runs", "__pycache__", ".pytest_cache", ".ruff_cache", "build"}
# Names of other libraries' objects in prose (`tf.keras`, `keras.Model`, a model's `fit`).
FOREIGN = ("tf.", "tf_keras.", "keras.", "np.", "tfds.")
# Last names of modules that prose uses for other things too (`model.fit`: a Keras model's).
AMBIGUOUS = {"model"}
PLACEHOLDER = re.compile(r"<|>|…|\.\.\.|\$|\{|\}|://|@|#|\*\*|^[A-Z][A-Z_]*$|^section\.key\b")
WORKDIR_PATH = re.compile(r"(?:<workdir>|\bWORKDIR|(?<![\w/])workdir)/([\w.-]+)")
PYTHON = re.compile(r"^(?:\S*/)?python3?(?:\.\d+)?$")


@dataclasses.dataclass
class Line:
    """A piece of a page: its text, where it is, and what kind of text it is."""

    page: str
    number: int
    text: str
    kind: str  # "prose", "code" (a fenced block's line), "python" (a Python block's)
    heading: str


def lines_of(page: str, text: str) -> list[Line]:
    """The page's lines; a fenced block's lines marked as code, continuations joined."""
    out, fence, heading, pending = [], None, "", ""
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.lstrip().startswith("```"):
            fence = None if fence is not None else (raw.strip()[3:] or "code")
            continue
        if fence is None:
            if raw.startswith("#"):
                heading = raw.lstrip("#").strip()
            out.append(Line(page, number, raw, "prose", heading))
            continue
        kind = "python" if fence == "python" else "code"
        if kind == "code" and raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        out.append(Line(page, number, pending + raw, kind, heading))
        pending = ""
    return out


def paragraphs(lines: list[Line]) -> Iterator[Line]:
    """Prose joined into paragraphs (a table row is one), so that a phrase broken over
    two lines is read whole; each at its first line."""
    block: list[Line] = []
    for line in lines + [Line("", 0, "", "prose", "")]:
        row = line.text.lstrip().startswith("|")
        if line.kind != "prose" or not line.text.strip() or row or line.text.startswith("#"):
            if block:
                yield dataclasses.replace(block[0], text=" ".join(b.text.strip() for b in block))
                block = []
            if line.kind == "prose" and (row or line.text.startswith("#")):
                yield line
            continue
        block.append(line)


def spans(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def tables(lines: list[Line]) -> Iterator[tuple[list[str], list[tuple[Line, list[str]]]]]:
    """(header cells, [(line, cells)]) of each table."""
    rows: list[tuple[Line, list[str]]] = []
    for line in lines + [Line("", 0, "", "prose", "")]:
        if line.kind == "prose" and line.text.lstrip().startswith("|"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.text.strip().strip("|"))]
            rows.append((line, cells))
            continue
        if len(rows) > 1:
            yield rows[0][1], [r for r in rows[2:]]
        rows = []


class Code:
    """What the pages may name, read from the project at `root`."""

    def __init__(self, root: Path):
        self.root = root
        self.files = {p.relative_to(root).as_posix() for p in root.rglob("*")
                      if not set(p.relative_to(root).parts) & IGNORED}
        self.modules = {}
        for package in PACKAGES:
            for path in sorted((root / package).rglob("*.py")):
                parts = path.relative_to(root).with_suffix("").parts
                self.modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
        self.by_last: dict[str, list[str]] = {}
        for name in self.modules:
            self.by_last.setdefault(name.rsplit(".", 1)[-1], []).append(name)
        self.classes: dict[str, list[tuple[str, ast.ClassDef]]] = {}
        for name in self.modules:
            if name.startswith("app."):
                for node in self.tree(name).body:
                    if isinstance(node, ast.ClassDef):
                        self.classes.setdefault(node.name, []).append((name, node))

    @functools.cache  # noqa: B019 - one Code per check
    def tree(self, module: str) -> ast.Module:
        path = self.modules[module]
        return ast.parse(path.read_text(), str(path))

    # --- commands -----------------------------------------------------------------------
    @functools.cached_property
    def make_targets(self) -> set[str]:
        text = (self.root / "Makefile").read_text()
        return set(re.findall(r"^([\w-]+):", text, re.M))

    @functools.cached_property
    def scripts(self) -> dict[str, str]:
        project = tomllib.loads((self.root / "pyproject.toml").read_text())["project"]
        return {name: target.split(":")[0] for name, target in project["scripts"].items()}

    @functools.cache  # noqa: B019
    def parser(self, module: str) -> tuple[argparse.ArgumentParser | None, bool]:
        """The argparse parser `module`'s main() builds, and whether it passes the
        arguments it does not know on (parse_known_args). (None, False): no parser."""
        if "ArgumentParser" not in self.modules[module].read_text():
            return None, False

        class Captured(Exception):
            pass

        def capture(known):
            def parse(parser, *args, **kwargs):
                raise Captured(parser, known)
            return parse

        # A script may set environment variables and sys.path as it is imported (the
        # recommender's turn oneDNN on before importing TensorFlow): put both back, and
        # import TensorFlow first, as the process's other tests would, so that no
        # setting of a script's outlives this look at its parser.
        environ, path = dict(os.environ), list(sys.path)
        try:
            if module.startswith(("examples.", "experiments.")):
                importlib.import_module("tensorflow")
            with mock.patch.object(argparse.ArgumentParser, "parse_args", capture(False)), \
                    mock.patch.object(argparse.ArgumentParser, "parse_known_args",
                                      capture(True)):
                importlib.import_module(module).main()
        except Captured as e:
            return e.args
        finally:
            os.environ.clear()
            os.environ.update(environ)
            sys.path[:] = path
        raise AssertionError(f"{module}.main() did not parse its arguments")

    # --- config ---------------------------------------------------------------------------
    @functools.cached_property
    def config(self):
        return importlib.import_module("app.config")

    @functools.cached_property
    def sections(self) -> dict[str, dict[str, dataclasses.Field]]:
        import typing

        hints = typing.get_type_hints(self.config.Config)
        return {f.name: {g.name: g for g in dataclasses.fields(hints[f.name]) if g.name != "params"}
                for f in dataclasses.fields(self.config.Config)}

    @functools.cached_property
    def builtin(self) -> dict[str, str]:
        """The built-in tasks, {name: module:Class} (app/config.py, read without TensorFlow)."""
        return next(ast.literal_eval(node.value) for node in self.tree("app.config").body
                    if isinstance(node, ast.Assign | ast.AnnAssign)
                    and getattr(getattr(node, "target", None) or node.targets[0], "id", "")
                    == "BUILTIN_TASKS")

    @functools.cached_property
    def not_retried(self) -> set[int]:
        return set(importlib.import_module("launch.processes").NOT_RETRIED)

    def value(self, dotted: str) -> int | None:
        """The int a constant of the code (`app.x.NAME`, `module.Class.name`) is set to."""
        parts = dotted.split(".")
        for start in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:start])
            candidates = [module] if module in self.modules else self.by_last.get(module, [])
            for found in candidates:
                node: ast.AST = self.tree(found)
                for name in parts[start:]:
                    node = top_level(node).get(name) if isinstance(
                        node, ast.Module | ast.ClassDef) else None
                if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                        and type(node.value.value) is int:
                    return node.value.value
        return None

    def task_params(self, name: str, pages: dict[str, str]) -> set[str] | None:
        """The parameters of task `name` (a built-in name or module:Class), read from its
        source (a class of a page's Python block for a module not in the project);
        None when it cannot be found."""
        module, _, cls = self.builtin.get(name, name).partition(":")
        if module in self.modules:
            return params_of(self.tree(module), cls)
        for text in pages.values():
            for block in re.findall(r"```python\n(.*?)```", text, re.S):
                tree = ast.parse(block)
                if any(isinstance(n, ast.ClassDef) and n.name == cls for n in tree.body):
                    return params_of(tree, cls)
        return None

    def all_task_params(self, pages: dict[str, str]) -> set[str]:
        names = {"app.tasks.mnist:Mnist", "app.tasks.recommender:Recommender"}
        for module in self.modules:
            for node in self.tree(module).body:
                if isinstance(node, ast.ClassDef) and params_of(self.tree(module), node.name):
                    names.add(f"{module}:{node.name}")
        return set().union(*(self.task_params(n, pages) or set() for n in names))

    # --- outputs, exit codes, code names ---------------------------------------------------
    @functools.cached_property
    def layout(self) -> set[str]:
        return set(importlib.import_module("app.state.workdir").LAYOUT)

    @functools.cached_property
    def exit_codes(self) -> set[int]:
        """The codes the code sets: 0, 1 (Python's, an uncaught exception), 2 (argparse's)
        and what app/, launch/ and tools/ write down."""
        found = {0, 1, 2}
        for module in self.modules:
            if module.split(".")[0] not in ("app", "launch", "tools"):
                continue
            for node in ast.walk(self.tree(module)):
                if isinstance(node, ast.Assign | ast.AnnAssign):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    names = [getattr(t, "id", getattr(t, "attr", "")) for t in targets]
                    if any(n.upper().endswith("EXIT_CODE") for n in names):
                        found |= ints(node.value)
                elif isinstance(node, ast.FunctionDef) and node.name == "main":
                    found |= {n.value.value for n in ast.walk(node) if isinstance(n, ast.Return)
                              and isinstance(n.value, ast.Constant) and type(n.value.value) is int}
                elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") in (
                        "exit", "_exit") and node.args:
                    found |= ints(node.args[0])
        return found

    def valid_exit(self, code: int) -> bool:
        signals = {s.value for s in signal.Signals}
        return (code in self.exit_codes or code - 128 in signals or -code in signals
                or 256 - code in signals)

    def resolve(self, dotted: str) -> bool | None:
        """Whether the code has `dotted` (True / False); None: not a name of the project."""
        parts = dotted.split(".")
        if parts[0] in PACKAGES:
            starts = [parts[0]]
        elif parts[0] in self.by_last and parts[0] not in AMBIGUOUS:
            starts = self.by_last[parts[0]]
        elif len(self.classes.get(parts[0], ())) == 1:
            module, node = self.classes[parts[0]][0]
            return self.member(module, node, parts[1:])
        else:
            return None
        return any(self.walk(start, parts[1:]) for start in starts)

    def walk(self, module: str, rest: list[str]) -> bool:
        if not rest:
            return True
        if f"{module}.{rest[0]}" in self.modules:
            return self.walk(f"{module}.{rest[0]}", rest[1:])
        if module not in self.modules:
            return False
        node = top_level(self.tree(module)).get(rest[0])
        if node is None:
            return False
        return self.member(module, node, rest[1:]) if isinstance(node, ast.ClassDef) else True

    def member(self, module: str, node: ast.ClassDef, rest: list[str]) -> bool:
        if not rest:
            return True
        names = top_level(node) | {t.attr: t for f in node.body if isinstance(f, ast.FunctionDef)
                                   for t in ast.walk(f) if isinstance(t, ast.Attribute)
                                   and isinstance(t.ctx, ast.Store)}
        if rest[0] in names:
            found = names[rest[0]]
            return self.member(module, found, rest[1:]) if isinstance(found, ast.ClassDef) else True
        for base in node.bases:  # inherited; a base outside the project may have it
            local = top_level(self.tree(module)).get(getattr(base, "id", ""))
            if not isinstance(local, ast.ClassDef) or self.member(module, local, rest):
                return True
        return False


def ints(node: ast.AST) -> set[int]:
    return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and type(n.value) is int}


def top_level(node: ast.Module | ast.ClassDef) -> dict[str, ast.AST]:
    """Names a module or class body defines (imports included)."""
    names = {}
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[item.name] = item
        elif isinstance(item, ast.Assign):
            names |= {t.id: item for t in item.targets if isinstance(t, ast.Name)}
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names[item.target.id] = item
        elif isinstance(item, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0]: item for a in item.names}
        elif isinstance(item, ast.If | ast.Try):
            names |= top_level(item)
    return names


def params_of(tree: ast.Module, cls: str) -> set[str] | None:
    """The fields of class `cls`'s `Params` in `tree` (inherited too); set() without."""
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    node = classes.get(cls)
    if node is None:
        return None
    params = top_level(node).get("Params")
    if isinstance(params, ast.Assign):
        params = classes.get(getattr(params.value, "id", ""))
    if isinstance(params, ast.ClassDef):
        return fields_of(classes, params)
    inherited = [params_of(tree, getattr(b, "id", "")) for b in node.bases]
    return next((p for p in inherited if p), set())


def fields_of(classes: dict[str, ast.ClassDef], node: ast.ClassDef,
              seen: frozenset[str] = frozenset()) -> set[str]:
    """The annotated fields of class `node` and of its bases among `classes` (a base of
    its own name, `class Params(Params)` after an import, is not among them)."""
    fields = {f.target.id for f in node.body if isinstance(f, ast.AnnAssign)}
    for base in node.bases:
        name = getattr(base, "id", "")
        if name in classes and name not in seen | {node.name}:
            fields |= fields_of(classes, classes[name], seen | {node.name})
    return fields


class Checker:
    """The rules, over the pages of one project."""

    def __init__(self, code: Code, pages: dict[str, str]):
        self.code, self.pages, self.problems = code, pages, []

    def say(self, line: Line, message: str) -> None:
        self.problems.append(f"{line.page}:{line.number}: {message}")

    def run(self) -> list[str]:
        for page, text in self.pages.items():
            lines = lines_of(page, text)
            for line in lines:
                if line.kind == "code":
                    self.commands(line, line.text, full=True)
                    self.code_tokens(line)
                elif line.kind == "prose":
                    self.prose_spans(line)
            for line in lines:
                if line.kind == "code":
                    self.exit_codes(line)
            for line in paragraphs(lines):
                self.exit_codes(line)
                self.not_retried(line)
                self.constants(line)
                self.builtin_tasks(line)
                self.named_in(line)
                self.workdir_paths(line)
                self.links(line)
            self.tables(page, lines)
        return self.problems

    def helps(self) -> None:
        """The commands' own help: what `--help` says of exit codes holds too."""
        for module in self.code.modules:
            if module.split(".")[0] in ("app", "launch", "tools") and self.cli(module):
                for action in self.code.parser(module)[0]._actions:
                    if action.help and action.help != argparse.SUPPRESS:
                        line = Line(f"{module} {'/'.join(action.option_strings)} (--help)", 0,
                                    action.help, "prose", "")
                        self.exit_codes(line)
                        self.not_retried(line)

    # --- commands -------------------------------------------------------------------------
    def commands(self, line: Line, text: str, full: bool) -> None:
        text = re.split(r"\s#\s|\s+<-", text)[0]  # a comment after a command
        inner = re.search(r"\(?(python3? -m \S.*)", text)
        if inner and not re.match(r"^\s*(\$ )?([A-Z_]+=\S+ )*\S*python", text):
            text = inner[1].split(")")[0]  # a command that an output line suggests
        for piece in re.split(r"&&|;|\|(?!\|)", text):
            try:
                tokens = shlex.split(piece)
            except ValueError:
                tokens = piece.split()
            tokens = [t.strip("[]") for t in tokens if t.strip("[]")]
            env = {}
            while tokens and re.match(r"^[A-Z_]+=", tokens[0]):
                key, _, value = tokens.pop(0).partition("=")
                env[key] = value
                self.path(line, value) if "/" in value else None
            if tokens and tokens[0] == "$":
                tokens.pop(0)
            if tokens:
                self.command(line, tokens, env, full)

    def command(self, line: Line, tokens: list[str], env: dict, full: bool) -> None:
        head = tokens[0]
        if PYTHON.match(head) and len(tokens) > 1:
            if tokens[1] == "-m" and len(tokens) > 2:
                self.module_command(line, tokens[2], tokens[3:], full)
            elif tokens[1].endswith(".py"):
                if self.path(line, tokens[1]):
                    module = tokens[1][:-3].replace("/", ".")
                    self.module_command(line, module, tokens[2:], full)
        elif head == "make":
            for target in tokens[1:]:
                if "=" not in target and not target.startswith("-"):
                    if target not in self.code.make_targets:
                        self.say(line, f"make {target}: no such target in the Makefile")
        elif head in self.code.scripts:
            self.module_command(line, self.code.scripts[head], tokens[1:], full)
        elif head == "sbatch":
            script = next((t for t in tokens[1:] if t.endswith(".sbatch")), None)
            if script and self.path(line, script):
                rest = tokens[tokens.index(script) + 1:]
                task = self.task_of(rest, env.get("CONFIG", "configs/mnist_ps.toml"))
                self.flags(line, "app.train", rest, task, full=False)
        elif head == "kubectl":
            for i, token in enumerate(tokens[:-1]):
                if token == "-f":
                    self.path(line, tokens[i + 1])
        elif head in ("launch.local", "app.train", "launch.slurm", "launch.inprocess") or (
                head.startswith("tools.") and f"{head}" in self.code.modules):
            if len(tokens) > 1:  # a command named in prose by its module, and flags
                self.module_command(line, head, tokens[1:], full=False)

    def module_command(self, line: Line, module: str, args: list[str], full: bool) -> None:
        module = module.rstrip(":,;.")
        if PLACEHOLDER.search(module):
            return
        if module not in self.code.modules:
            if module.split(".")[0] in PACKAGES or importlib.util.find_spec(module) is None:
                self.say(line, f"python -m {module}: no such module")
            return
        self.flags(line, module, args, self.task_of(args, None), full)

    def task_of(self, args: list[str], config: str | None) -> str:
        """The task a command trains: its --set task.name, else its config's, else mnist."""
        for i, token in enumerate(args[:-1]):
            if token == "--set" and args[i + 1].startswith("task.name="):
                return args[i + 1].partition("=")[2]
            if token == "--config":
                config = args[i + 1]
        path = self.code.root / config if config else None
        if path and path.is_file():
            return tomllib.loads(path.read_text()).get("task", {}).get("name", "mnist")
        return "mnist"

    def flags(self, line: Line, module: str, args: list[str], task: str, full: bool) -> None:
        parser, passes_on = self.code.parser(module)
        if parser is None:
            if any(a.startswith("--") for a in args):
                self.say(line, f"{module} takes no flags, but the page gives it {args}")
            return
        self.parsed(line, module, parser, passes_on, args, task, full)

    def parsed(self, line: Line, command: str, parser, passes_on: bool, args: list[str],
               task: str, full: bool) -> None:
        """`args` read as `parser` reads them: each flag its own, each chosen value one of
        its choices, a subcommand's flags its own; with `full`, nothing required missing."""
        options, positionals = options_of(parser)
        given, free, i = set(), [], 0
        while i < len(args):
            token = args[i]
            name, eq, value = token.partition("=")
            i += 1
            if not token.startswith("-") or token == "-":
                action = positionals[len(free)] if len(free) < len(positionals) else None
                free.append(token)
                if isinstance(action, argparse._SubParsersAction):
                    sub = action.choices.get(token)
                    if sub is None:
                        self.say(line, f"{command} {token}: not one of {list(action.choices)}")
                    else:
                        self.parsed(line, f"{command} {token}", sub, False, args[i:], task, full)
                    return
                if action is not None and action.choices and not PLACEHOLDER.search(token) \
                        and token not in action.choices:
                    self.say(line, f"{command} {token}: not one of {list(action.choices)}")
                continue
            action = options.get(name)
            if action is None and passes_on:  # app.train's, or no one's
                self.flags(line, "app.train", args[i - 1:], task, full=False)
                break
            if action is None:
                self.say(line, f"{command} has no flag {name} (its flags: "
                               f"{', '.join(sorted(set(options) - {'-h', '--help'}))})")
                continue
            given.add(action.dest)
            if action.nargs != 0 and not eq and i < len(args):
                value, i = args[i], i + 1
            if action.choices and value and not PLACEHOLDER.search(value) \
                    and value not in action.choices:
                self.say(line, f"{command} {name} {value}: not one of {list(action.choices)}")
            if name == "--set":
                self.set_key(line, value, task)
            elif name == "--config" and value:
                self.path(line, value)
        if full:
            missing = [a.option_strings[0] for a in options.values()
                       if a.required and a.dest not in given]
            missing += [a.dest for a in positionals[len(free):] if a.nargs not in ("?", "*")]
            for name in dict.fromkeys(missing):
                self.say(line, f"{command} needs {name}, which this command does not give")

    def set_key(self, line: Line, assignment: str, task: str | None) -> None:
        key, eq, value = assignment.partition("=")
        if PLACEHOLDER.search(key) or "." not in key:
            return
        section, _, name = key.partition(".")
        if section == "task" and name != "name":
            known = (self.code.all_task_params(self.pages) if task is None
                     else self.code.task_params(task, self.pages))
            if known is not None and name not in known:
                self.say(line, f"{key}: task {task or '(any)'} has no such parameter "
                               f"(its parameters: {', '.join(sorted(known)) or 'none'})")
            return
        fields = self.code.sections.get(section)
        if fields is None or name not in fields:
            self.say(line, f"{key}: not a config key (app/config.py)")
            return
        choices = fields[name].metadata.get("choices")
        value = value.strip().strip("\"'")
        if eq and choices and value and not PLACEHOLDER.search(value) and value not in choices:
            self.say(line, f"{key} = {value}: not one of {list(choices)}")

    # --- code spans -------------------------------------------------------------------------
    def prose_spans(self, line: Line) -> None:
        text = line.text
        if self.message_table(line):  # quoted errors: only the commands they suggest
            cells = re.split(r"(?<!\\)\|", text.strip().strip("|"))
            for span in spans(cells[0]):
                for found in re.finditer(r"python3? -m [\w.]+(?![\w.:])[^;()`]*", span):
                    self.commands(line, found[0], full=True)
            text = "|".join(cells[1:])
        for span in spans(text):
            words = span.split()
            if not words:
                continue
            if span.startswith(FOREIGN):
                continue
            if PYTHON.match(words[0]) or words[0] in ("make", "sbatch", "kubectl") \
                    or words[0] in self.code.scripts or re.match(r"^[A-Z_]+=", words[0]):
                self.commands(line, span, full=True)
            elif words[0] in ("launch.local", "app.train", "launch.slurm", "launch.inprocess") \
                    or words[0].startswith("tools."):
                self.commands(line, span, full=False)
            elif words[0].startswith("--"):
                self.loose_flag(line, words)
            elif re.match(r"^[a-z]+\.[a-z_0-9]+\s*(=\s*\S+)?$", span) and \
                    span.split(".")[0] in self.code.sections:
                self.key_or_name(line, span)
            elif re.match(r"^[A-Za-z_]\w*(\.\w+)+(\(.*\))?$", span) and not is_file(span):
                if self.code.resolve(span.split("(")[0]) is False:
                    self.say(line, f"`{span}`: no such name in the code")
            elif is_pathlike(span) and span not in self.user_files:
                self.path(line, span)

    @functools.cached_property
    def user_files(self) -> set[str]:
        """The modules of the user's own tasks whose code a page gives (`my_task.py`)."""
        text = "\n".join(self.pages.values())
        blocks = "\n".join(re.findall(r"```python\n(.*?)```", text, re.S))
        return {f"{module}.py" for module, cls in re.findall(r"task\.name=(\w+):(\w+)", text)
                if module not in self.code.modules and re.search(rf"^class {cls}\b", blocks, re.M)}

    def message_table(self, line: Line) -> bool:
        """Whether `line` is a row of a table whose first column quotes error messages."""
        return (line.page, line.number) in self.message_rows

    @functools.cached_property
    def message_rows(self) -> set[tuple[str, int]]:
        return {(line.page, line.number) for page, text in self.pages.items()
                for header, rows in tables(lines_of(page, text))
                if header[0].lower() == "message" for line, _ in rows}

    def key_or_name(self, line: Line, span: str) -> None:
        """`section.key` (`= value`): a config key, else a file or a name of the code."""
        key = span.replace(" ", "")
        section, _, name = key.partition("=")[0].partition(".")
        if section == "task" and name in self.code.all_task_params(self.pages) | {"name"}:
            return
        if name in self.code.sections[section]:
            self.set_key(line, key, None)
        elif is_file(key):
            self.path(line, key)
        elif not self.code.resolve(key.partition("=")[0]):
            self.say(line, f"`{span}`: neither a config key (app/config.py) nor a name in "
                           "the code")

    def loose_flag(self, line: Line, words: list[str]) -> None:
        flag = words[0].partition("=")[0]
        known = set(EXTERNAL_FLAGS)
        for module in self.code.modules:
            if module.split(".")[0] in ("app", "launch", "tools", "examples", "experiments") \
                    and self.cli(module):
                known |= every_option(self.code.parser(module)[0])
        if flag not in known:
            self.say(line, f"{flag}: no command of the project has this flag")
        elif flag == "--set" and len(words) > 1:
            self.set_key(line, words[1], None)

    @functools.cache  # noqa: B019
    def cli(self, module: str) -> bool:
        body = self.code.tree(module).body
        return "ArgumentParser" in self.code.modules[module].read_text() and any(
            isinstance(n, ast.FunctionDef) and n.name == "main" for n in body)

    def code_tokens(self, line: Line) -> None:
        """A diagram's or an output's paths (a command's are its arguments)."""
        if re.match(r"^\s*(\$ )?([A-Z_]+=\S+ )*(\S*python3?|make|sbatch|kubectl|tf-train|docker)\b",
                    line.text):
            return
        for token in re.findall(r"[\w./<>-]+", line.text):
            token = token.rstrip(".:")
            if token.endswith("/") or is_file(token):
                if not token.startswith("/") and not PLACEHOLDER.search(token):
                    self.path(line, token)

    def path(self, line: Line, path: str) -> bool:
        """Whether `path` is the repository's, a run's output, or outside the project."""
        path = path.split("#")[0].rstrip(",;:)")
        if (not path or path.startswith(("/", "~", "runs/")) or PLACEHOLDER.search(path)
                or path in ("workdir/", ".")):
            return True
        page_dir = Path(line.page).parent
        for candidate in (Path(path), page_dir / path):
            resolved = (self.code.root / candidate).resolve()
            if not resolved.is_relative_to(self.code.root.resolve()):
                return True  # beside the project: not the pages' to vouch for
            relative = resolved.relative_to(self.code.root.resolve()).as_posix()
            if "*" in path or "[" in path:
                if list(self.code.root.glob(relative)):
                    return True
            elif relative in self.code.files or relative == ".":
                return True
        if "*" not in path and "/" in path.rstrip("/") and any(
                f.endswith("/" + path.rstrip("/")) for f in self.code.files):
            return True  # named from its package, e.g. `ps/server.py`
        if "*" not in path and any(f.endswith("/" + path.rstrip("/")) or f == path.rstrip("/")
                                   for f in self.code.files) and "/" not in path.rstrip("/"):
            return True  # a file named alone, e.g. `numbered.py`
        first = path.split("/")[0] + ("/" if "/" in path else "")
        if first in self.code.layout:
            return True
        self.say(line, f"{path}: no such path in the repository, nor an entry of a run's "
                       "workdir (app/state/workdir.py, LAYOUT)")
        return False

    def workdir_paths(self, line: Line) -> None:
        for name in WORKDIR_PATH.findall(line.text):
            entry = name + ("/" if f"{name}/" in self.code.layout else "")
            if entry not in self.code.layout:
                self.say(line, f"<workdir>/{name}: not an entry of a run's workdir "
                               "(app/state/workdir.py, LAYOUT)")

    def links(self, line: Line) -> None:
        for target in re.findall(r"\]\(([^)\s]+)\)", line.text):
            if "://" in target:
                continue
            path, _, anchor = target.partition("#")
            page = (Path(line.page).parent / path).as_posix() if path else line.page
            if path and not self.path(line, path):
                continue
            if anchor:
                resolved = (self.code.root / page).resolve()
                text = self.pages.get(page) or (resolved.read_text() if resolved.is_file()
                                                else "")
                anchors = {slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}
                if anchor not in anchors:
                    self.say(line, f"{target}: {page} has no heading #{anchor}")

    # --- exit codes and code names ------------------------------------------------------
    def exit_codes(self, line: Line) -> None:
        text = re.sub(r"[`*]", "", line.text)
        end = r"(?![\d+–x%]|[.:]\d| ?(?:s|ms|min|GiB|MiB|steps?)\b)"  # not 4.5, 1–127, 30 s
        phrase = (r"\b(?:exit(?:s|ed|ing)?|stops?|leaves?|ends?)(?: with)?(?: (?:the |its )?"
                  rf"(?:exit |same |preempted )?codes?)? ?\(?(-?\d+){end}"
                  rf"((?:(?:,| and| or) (?:exit )?-?\d+{end})*)")
        for match in re.finditer(phrase, text, re.I):
            if not re.search(r"exit|code", match[0], re.I):
                continue
            for code in [match[1], *re.findall(r"-?\d+", match[2])]:
                if not self.code.valid_exit(int(code)):
                    self.say(line, f"exit code {code}: the code uses no such exit code "
                                   f"(it uses {sorted(self.code.exit_codes)} and signals')")

    def not_retried(self, line: Line) -> None:
        """"any exit code but 2, 5 and 6": the codes launchers do not retry, all of them."""
        text = re.sub(r"\s+", " ", re.sub(r"[`*]", "", line.text))
        for match in re.finditer(r"(?:any (?:exit )?code|any failure) (?:but|except)([^.;:]*)",
                                 text):
            listed = re.sub(r"\([^()]*\)", "", match[1]).split(")")[0]  # its own asides out
            said = {int(c) for c in re.findall(r"\b\d+\b", listed)} | {0}
            if said != self.code.not_retried:
                self.say(line, f"'{match[0].strip()}': launchers retry every exit code but "
                               f"{sorted(self.code.not_retried - {0})} (launch/processes.py)")

    def constants(self, line: Line) -> None:
        """"`X.EXIT_CODE`, 4" or "`NAME` (4)": the value the code gives the constant."""
        for match in re.finditer(r"`([\w.]+)`(?:,| =| \()\s*(-?\d+)\b", line.text):
            value = self.code.value(match[1])
            if value is not None and value != int(match[2]):
                self.say(line, f"`{match[1]}` is {value} in the code, not {match[2]}")

    def builtin_tasks(self, line: Line) -> None:
        """"a built-in task (mnist, recommender)": every built-in task, by name."""
        for match in re.finditer(r"built-in (?:task|name)s?\W{0,2}\((?!e\.g\.)([^)]*)\)",
                                 line.text):
            named = set(re.findall(r"\w+", match[1])) & set(self.code.builtin) | {
                w for w in re.findall(r"[\"`']?(\w+)[\"`']?", match[1]) if w.islower()
                and w not in ("or", "and", "e", "g", "the")}
            if named != set(self.code.builtin):
                self.say(line, f"'{match[0]}': the built-in tasks are "
                               f"{', '.join(self.code.builtin)} (app/task.py, BUILTIN)")

    def named_in(self, line: Line) -> None:
        """"`NAME` in `path.py`" and "`path.py`, `NAME`": NAME is that module's."""
        pairs = [(m[2], m[1]) for m in re.finditer(r"`([\w/]+\.py)`[,:] `([\w.]+)`", line.text)]
        pairs += [(m[1], m[2]) for m in re.finditer(r"`([\w.]+)` in `([\w/]+\.py)`", line.text)]
        for name, path in pairs:
            module = path[:-3].replace("/", ".").removesuffix(".__init__")
            if module in self.code.modules and not self.code.walk(module, name.split(".")):
                self.say(line, f"`{name}`: {path} has no such name")

    def tables(self, page: str, lines: list[Line]) -> None:
        for header, rows in tables(lines):
            first = header[0].strip("`").lower()
            owner = self.heading_owner(rows[0][0].heading) if rows else None
            if owner:
                for line, cells in rows:
                    for span in spans(cells[0]):
                        name = re.match(r"^(\w+)(\(.*\))?$", span)
                        if name and not self.code.resolve(f"{owner}.{name[1]}"):
                            self.say(line, f"`{span}`: {owner} has no {name[1]}")
            if first == "flag":
                self.flag_table(page, lines, rows)
            elif first == "path" and page == "docs/outputs.md":
                listed = {s for _, cells in rows for s in spans(cells[0])[:1]}
                for missing in sorted(self.code.layout - listed):
                    self.say(rows[0][0], f"{missing}: a run writes it (LAYOUT), and the table "
                                         "does not list it")
            elif first == "code" and page == "docs/troubleshooting.md":
                listed = {int(c) for _, cells in rows for c in re.findall(r"^-?\d+$", cells[0])}
                for missing in sorted(self.code.exit_codes - listed):
                    self.say(rows[0][0], f"exit code {missing}: the code uses it, and the "
                                         "table does not list it")

    def heading_owner(self, heading: str) -> str | None:
        """The module or class a heading names (`app/data.py`, `app.task.Task`), if any."""
        for span in spans(heading):
            dotted = span[:-3].replace("/", ".") if span.endswith(".py") else span
            if re.match(r"^[\w.]+$", dotted) and self.code.resolve(dotted):
                return dotted
        return None

    def flag_table(self, page: str, lines: list[Line], rows) -> None:
        """A table of a command's flags lists each of them, and no other."""
        first = rows[0][0].number
        commands = [re.search(r"python -m ([\w.]+)", line.text) for line in lines
                    if line.kind == "code" and line.number < first]
        module = next((m[1] for m in reversed(commands) if m), None)
        if module is None or module not in self.code.modules:
            return
        options = options_of(self.code.parser(module)[0])[0]
        listed = {s.split()[0] for _, cells in rows for s in spans(cells[0]) if s.startswith("--")}
        for flag in sorted(listed - set(options)):
            self.say(rows[0][0], f"{flag}: {module} has no such flag")
        wanted = {a.option_strings[-1] for a in options.values()
                  if a.help != argparse.SUPPRESS and a.dest != "help"}
        for flag in sorted(wanted - listed):
            self.say(rows[0][0], f"{flag}: a flag of {module} that the table leaves out")


def options_of(parser) -> tuple[dict[str, argparse.Action], list[argparse.Action]]:
    """{option string: action} and the positional actions of `parser` (argparse keeps
    them in `_actions`; it has no public way to list them)."""
    options = {s: a for a in parser._actions for s in a.option_strings}
    return options, [a for a in parser._actions if not a.option_strings]


def every_option(parser) -> set[str]:
    """The option strings of `parser` and of its subcommands."""
    options, positionals = options_of(parser)
    found = set(options)
    for action in positionals:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= every_option(sub)
    return found


def is_file(text: str) -> bool:
    return bool(re.search(r"[\w*]\.(" + "|".join(EXTENSIONS) + r")$", text))


def is_pathlike(span: str) -> bool:
    return " " not in span and (is_file(span) or ("/" in span and re.match(r"^[\w.*/-]+$", span)
                                                  is not None))


def pages_of(root: Path) -> dict[str, str]:
    """README.md, docs/*.md, and the comments of configs/, examples/ and experiments/ as
    code lines."""
    pages = {"README.md": (root / "README.md").read_text()}
    pages |= {p.relative_to(root).as_posix(): p.read_text()
              for p in sorted((root / "docs").glob("*.md"))}
    for path in sorted((root / "configs").glob("*.toml")) + sorted(
            (root / "examples").glob("*.toml")) + sorted((root / "examples").glob("*.py")) + sorted(
            (root / "experiments").glob("*.py")):
        commands, text = [], path.read_text().splitlines()
        for number, line in enumerate(text):
            found = re.search(
                r"(python3? (-m [\w.]+|(?:examples|experiments)/\S+\.py)|\bmake [\w-]+)[^`]*", line)
            if found:
                command = re.split(r"\(or\b", found[0])[0].rstrip().rstrip(")")
                rest = iter(text[number + 1:])
                while command.endswith("\\"):  # a command continued on the next line
                    command = command[:-1] + " " + next(rest).strip().lstrip("#").strip()
                commands.append(command)
        pages[path.relative_to(root).as_posix()] = "```\n" + "\n".join(commands) + "\n```\n"
    return pages


@functools.cache
def code_of(root: Path) -> Code:
    """The code at `root`, read once per process (it does not change under a test run)."""
    return Code(root)


def check(root: Path, pages: dict[str, str] | None = None) -> list[str]:
    """The problems of `pages` (by default the project's own) against the code at `root`."""
    checker = Checker(code_of(root), pages_of(root) if pages is None else pages)
    if pages is None:
        checker.helps()
    return checker.run()


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    sys.path.insert(0, str(root))
    problems = check(root)
    print("\n".join(problems) or "no problems")
    sys.exit(1 if problems else 0)
