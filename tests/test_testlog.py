"""tools.testlog: where a `make test` run's time went, from its TEST_CPU_LOG."""

from __future__ import annotations

import pytest

from tools import testlog

# Two phases 20 s apart. In the first, gw0 runs out of work at 10 s while gw1
# runs a test that waits 90 s for 5 CPU s, alone, until 100 s: it starts half a
# second after every test before it ended, in the same phase.
LOG = """\
4.00 5.00 1000.00 gw0 tests/test_a.py::test_one
4.50 5.00 1005.00 gw0 tests/test_a.py::test_two
2.00 10.00 1000.00 gw1 tests/test_b.py::test_short
5.00 90.00 1010.50 gw1 tests/test_b.py::test_waits
3.00 4.00 1120.00 gw0 tests/test_c.py::test_cluster
3.00 4.00 1120.00 gw1 tests/test_c.py::test_cluster_too
"""


def test_a_phase_its_runners_and_the_tests_that_waited_are_told_apart(tmp_path):
    log = tmp_path / "cpu.log"
    log.write_text(LOG)
    tests = testlog.read(log)
    assert [len(phase) for phase in testlog.phases(tests)] == [4, 2]
    lines = testlog.summary(tests, waiting=1).splitlines()
    assert lines == [
        "phase 1: 4 tests, 100 s, 16 CPU s, 0.15 cores busy",
        "  gw0: out of work at 10 s, 8 CPU s",
        "  gw1: out of work at 100 s, 7 CPU s",
        "phase 2: 2 tests, 4 s, 6 CPU s, 1.50 cores busy",
        "  gw0: out of work at 4 s, 3 CPU s",
        "  gw1: out of work at 4 s, 3 CPU s",
        "waited most (wall s, CPU s):",
        "  90 5 tests/test_b.py::test_waits",
    ]


@pytest.mark.parametrize("line", ["4.00 tests/test_a.py::test_one",  # an older log
                                  "4.00 5.00 soon gw0 tests/test_a.py::test_one"])
def test_a_line_that_is_not_a_test_is_refused_with_what_it_holds(line, tmp_path, capsys):
    log = tmp_path / "cpu.log"
    log.write_text(f"4.00 5.00 1000.00 gw0 tests/test_a.py::test_zero\n{line}\n")
    assert testlog.main([str(log)]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {log}:2: not `cpu_s wall_s start runner nodeid` (an older "
                   f"TEST_CPU_LOG holds `cpu_s nodeid` only): {line!r}\n")
