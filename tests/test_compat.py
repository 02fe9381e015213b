"""The compatibility matrix: each zoo case (tests/zoo.py), each way of training.

Every combination must give the outcome `docs/compatibility.json` records; one
that trains must match Keras' one-process `evaluate` and export (tests/compat.py).
After a change of outcome, `make compat` runs these with COMPAT_RECORD=1, which
writes the new outcomes to the JSON, and renders docs/compatibility.md.
"""

from __future__ import annotations

import json
import os
import pathlib

import compat
import pytest
import zoo
from conftest import one_device_reduction_mirrored

from app import compatdoc
from tests.launching import run_workers

CASES = list(compat.CASES)


def check(name: str, way: str, result: dict) -> None:
    """`result` is right in itself and is the outcome the matrix records."""
    assert result["outcome"] in ("works", "refused"), result
    if result["outcome"] == "works" and "headline" in result:
        assert result["headline_error"] <= compat.TOLERANCE, result
        assert result["test_examples"] == zoo.TEST
        assert result["export_error"] <= 1e-3, result  # float16 outputs under mixed precision
    if result["outcome"] == "refused":
        assert "\n" not in result["reason"] and "Traceback" not in result["reason"]
    if os.environ.get("COMPAT_RECORD"):
        compatdoc.record(name, way, result, compat.CASES[name].__doc__)
        return
    want = compatdoc.load()["results"].get(name, {}).get(way)
    assert want is not None, (f"{name} under {way} is not in {compatdoc.RESULTS}: run "
                              "`make compat` to record it")
    assert result["outcome"] == want["outcome"], (result, want)
    if want["outcome"] == "refused":
        assert result["reason"] == want["reason"]


@pytest.mark.parametrize("name", CASES)
def test_one_process(name, tmp_path):
    check(name, "one_process", compat.run_case(name, "one_process", tmp_path))


@pytest.mark.parametrize("name", CASES)
def test_mirrored_on_two_logical_cpus(name, tmp_path):
    check(name, "mirrored", compat.run_case(name, "mirrored", tmp_path,
                                            strategy=one_device_reduction_mirrored()))


@pytest.mark.slow
def test_multi_worker_mirrored_pair(tmp_path):
    # One pair of processes runs every case in turn: one cluster start-up for all.
    outputs = run_workers(str(pathlib.Path(compat.__file__)), str(tmp_path), timeout=1500)
    results = json.loads(outputs[0].split("RESULTS ", 1)[1].splitlines()[0])
    assert list(results) == CASES
    for name, result in results.items():
        check(name, "multi_worker_mirrored", result)


@pytest.mark.cluster
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("way", ["ps_async", "ps_sync"])
def test_parameter_servers(way, name, ps_strategy, ps_cluster, tmp_path):
    check(name, way, compat.run_case(name, way, tmp_path, strategy=ps_strategy,
                                     cluster=ps_cluster))


def test_the_matrix_covers_every_case_and_way_and_its_page_is_current():
    results = compatdoc.load()["results"]
    assert sorted(results) == sorted(CASES), "run `make compat`"
    for name in CASES:
        assert sorted(results[name]) == sorted(compat.WAYS), f"{name}: run `make compat`"
    page = pathlib.Path(compatdoc.PAGE).read_text()
    assert page == compatdoc.render(), "docs/compatibility.md is stale: run `make compat`"
