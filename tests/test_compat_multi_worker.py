"""The compatibility matrix's MultiWorkerMirrored column (tests/test_compat.py has the
others): one pair of worker processes trains every case in turn, one cluster start-up
for all. A file of its own, so that `make test`'s parallel runners can take it beside
the other columns."""

from __future__ import annotations

import json
import pathlib

import compat
import pytest

from tests.launching import run_workers


@pytest.mark.slow
def test_multi_worker_mirrored_pair(tmp_path):
    # One pair of processes runs every case in turn: one cluster start-up for all.
    outputs = run_workers(str(pathlib.Path(compat.__file__)), str(tmp_path), timeout=1500)
    results = json.loads(outputs[0].split("RESULTS ", 1)[1].splitlines()[0])
    assert list(results) == compat.CHECKED
    for name, result in results.items():
        compat.check(name, "multi_worker_mirrored", result)
