"""The pages say what the code does: tests/doccheck.py holds README.md, docs/*.md and the
commands of configs/ and examples/ to the code; its rules are tested here on pages with one
defect each."""

from __future__ import annotations

import ast
import pathlib

import pytest

from tests import doccheck

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_command_flag_key_path_and_exit_code_of_the_pages_is_the_codes():
    problems = doccheck.check(ROOT)
    assert not problems, "the pages disagree with the code:\n" + "\n".join(problems)


# A page with one defect of each kind the checker looks for, and what it must say.
DEFECTS = {
    "python -m app.trian --config configs/mnist.toml": "python -m app.trian: no such module",
    "make tset": "make tset: no such target",
    "python -m launch.local --workers 2 --max-retries 2": "app.train has no flag --max-retries",
    "python -m app.train --epochs 3": "app.train has no flag --epochs",
    "python -m tools.bench --rows baseline --step 10": "tools.bench has no flag --step",
    "python -m launch.local --restart pod": "--restart pod: not one of ['job', 'task']",
    "python -m launch.slurm.local_cluster begin": "begin: not one of",
    "python -m app.distribute.data_service dispatcher": "needs --port",
    "python -m app.train --set train.epoch=3": "train.epoch: not a config key",
    "python -m app.train --set ps.mode=semi": "ps.mode = semi: not one of ['async', 'sync']",
    "python -m app.train --set task.name=mnist --set task.hidden=128":
        "task.hidden: task mnist has no such parameter",
    "python -m app.train --config configs/recommender.toml --set task.dropout=0.1":
        "task.dropout: task recommender has no such parameter",
    "python -m app.train --set task.name=tests.numbered:RecordsNumbered --set task.exampels=64":
        "task.exampels: task tests.numbered:RecordsNumbered has no such parameter",
    "python -m app.train --config configs/mnist_async.toml": "mnist_async.toml: no such path",
    "kubectl apply -f launch/k8s/tfjob-mirrored.yaml": "tfjob-mirrored.yaml: no such path",
}
PROSE_DEFECTS = {
    "Set `runtime.memory_limit` to bound a task.": "`runtime.memory_limit`: neither a config key",
    "The run writes `saved_model/` beside `metrics.json`.": "saved_model/: no such path",
    "It resumes from `<workdir>/backups`.": "<workdir>/backups: not an entry",
    "Records are `docs/bench*.json`.": "docs/bench*.json: no such path",
    "On SIGTERM it exits with code 4.": "exit code 4: the code uses no such exit code",
    "Preempted tasks exit 4; lost ones exit 203.": "exit code 4",
    "Launchers retry any exit code but 2 and 5.": "launchers retry every exit code but [2, 5, 6]",
    "(`app.cluster.preemption.EXIT_CODE`, 4 in these runs)": "is 204 in the code, not 4",
    "`task.name` is a built-in task (`mnist`) or a path.": "built-in tasks are mnist, recommender",
    "Give `--max-restart N` to relaunch.": "--max-restart: no command of the project has this flag",
    "See [the limits](launching.md#memory-limit).": "launching.md has no heading #memory-limit",
    "See [the page](launch.md).": "launch.md: no such path",
    "The helper `app.data.count` counts a dataset.": "`app.data.count`: no such name in the code",
    "The runner (`app/run/runners.py`, `per_workers`) does it.": "`per_workers`: app/run/",
    "The list (`HOW_NOT_WHAT_EVER` in `app/state/workdir.py`).": "`HOW_NOT_WHAT_EVER`: app/state",
}


@pytest.mark.parametrize("command, said", DEFECTS.items(), ids=list(DEFECTS))
def test_a_command_that_would_fail_is_named(command, said):
    for page in (f"```\n{command}\n```\n", f"Run `{command}`.\n"):
        problems = doccheck.check(ROOT, {"docs/page.md": page})
        assert any(said in p for p in problems), (page, problems)


@pytest.mark.parametrize("text, said", PROSE_DEFECTS.items(), ids=list(PROSE_DEFECTS))
def test_a_wrong_statement_of_prose_is_named(text, said):
    problems = doccheck.check(ROOT, {"docs/page.md": f"# A page\n\n{text}\n"})
    assert any(said in p for p in problems), problems
    assert all(p.startswith("docs/page.md:3: ") for p in problems), problems


def test_tables_list_every_flag_output_and_exit_code():
    flags = ("```\npython -m launch.local --workers 2\n```\n\n| flag | meaning |\n|---|---|\n"
             "| `--workers N` | workers |\n| `--pss N` | ps tasks |\n")
    outputs = "| path | what |\n|---|---|\n| `config.toml` | the config |\n"
    codes = "| code | meaning |\n|---|---|\n| 0 | success |\n| 2 | a mistake |\n"
    problems = doccheck.check(ROOT, {"docs/launching.md": flags, "docs/outputs.md": outputs,
                                     "docs/troubleshooting.md": codes})
    said = "\n".join(problems)
    assert "--pss: launch.local has no such flag" in said
    assert "--max-restarts: a flag of launch.local that the table leaves out" in said
    assert "metrics.json: a run writes it (LAYOUT), and the table does not list it" in said
    assert "exit code 204: the code uses it, and the table does not list it" in said


def test_a_page_that_agrees_with_the_code_passes():
    page = """# Launching

```
python -m launch.local --workers 2 --ps 1 --config configs/mnist_ps.toml --set ps.mode=sync
python -m tools.plan --config configs/recommender_large.toml --ps 4 --set task.table_scale=0.5
python -m app.distribute.data_service dispatcher --port 5050 --work-dir SHARED/data_service
make test ARGS='-k docs'
python -m app.train --set task.name=tests.numbered:RecordsNumbered --set task.examples=64
```

`launch.local --restart task` relaunches the failed task; a preempted one exits 204
and a lost one exit code 203, both retried: launchers retry any exit code but 2, 5 and 6.
`runtime.memory_limit_gib = 2` bounds each task (`app.cluster.memory.EXIT_CODE`, 5).
The run writes `<workdir>/backup` and `export/`; `train.deterministic` is read by
`app.run.determinism`, and `HOW_NOT_WHAT` in `app/state/workdir.py` lists the rest.
See [memory limits](#launching) and [tasks](tasks.md#keras-3-or-keras-2).
"""
    tasks = "## Keras 3 or Keras 2\n"
    assert doccheck.check(ROOT, {"docs/page.md": page, "docs/tasks.md": tasks}) == []


def test_task_parameters_are_read_through_the_bases_of_params():
    tree = ast.parse("from elsewhere import Params\n\n\nclass Base:\n    width: int = 1\n\n\n"
                     "class Params(Params, Base):  # named after the class it extends\n"
                     "    depth: int = 2\n\n\nclass MyTask(Task):\n    Params = Params\n")
    assert doccheck.params_of(tree, "MyTask") == {"depth", "width"}
