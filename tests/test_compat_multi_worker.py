"""The compatibility matrix's MultiWorkerMirrored column (tests/test_compat.py has the
others): a pair of worker processes trains one part of the cases in turn, one
cluster start-up for all of them. The pairs wait on each other's all-reduces more
than they compute: `make test`'s two runners each take one (tests/conftest.py
spreads this file's tests)."""

from __future__ import annotations

import json
import pathlib

import compat
import pytest

from tests.launching import run_workers

PARTS = 2


@pytest.mark.slow
@pytest.mark.parametrize("index", range(PARTS))
def test_multi_worker_mirrored_pair(index, tmp_path):
    outputs = run_workers(str(pathlib.Path(compat.__file__)), str(tmp_path), str(index),
                          str(PARTS), timeout=1500)
    results = json.loads(outputs[0].split("RESULTS ", 1)[1].splitlines()[0])
    assert list(results) == compat.part(index, PARTS)
    for name, result in results.items():
        compat.check(name, "multi_worker_mirrored", result)
