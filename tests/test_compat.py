"""The compatibility matrix: each zoo case (tests/zoo.py), each way of training
(the MultiWorkerMirrored column: tests/test_compat_multi_worker.py).

Every combination must give the outcome `docs/results/compatibility.json` records; one
that trains must match Keras' one-process `evaluate` and export (tests/compat.py).
After a change of outcome, `make compat` runs these with COMPAT_RECORD=1, which
trains every case (`make test` leaves out Keras 2's copies of `compat.SAME_IN_BOTH`),
writes the new outcomes to the JSON, and renders docs/compatibility.md.
"""

from __future__ import annotations

import pathlib

import compat
import pytest
from conftest import one_device_reduction_mirrored

from tools import compatdoc

CASES = compat.CHECKED


@pytest.mark.parametrize("name", CASES)
def test_one_process(name, tmp_path):
    compat.check(name, "one_process", compat.run_case(name, "one_process", tmp_path))


@pytest.mark.parametrize("name", CASES)
def test_mirrored_on_two_logical_cpus(name, tmp_path):
    compat.check(name, "mirrored", compat.run_case(name, "mirrored", tmp_path,
                                                   strategy=one_device_reduction_mirrored()))


@pytest.mark.cluster
@pytest.mark.parametrize("way, name", [(way, name) for way in ("ps_async", "ps_sync")
                                       for name in compat.checked(way)])
def test_parameter_servers(way, name, ps_strategy, ps_cluster, tmp_path):
    compat.check(name, way, compat.run_case(name, way, tmp_path, strategy=ps_strategy,
                                            cluster=ps_cluster))


def test_the_matrix_covers_every_case_and_way_and_its_page_is_current():
    results = compatdoc.load()["results"]
    assert sorted(results) == sorted(compat.CASES), "run `make compat`"
    for name in compat.CASES:
        assert sorted(results[name]) == sorted(compat.WAYS), f"{name}: run `make compat`"
    page = pathlib.Path(compatdoc.PAGE).read_text()
    assert page == compatdoc.render(), "docs/compatibility.md is stale: run `make compat`"
