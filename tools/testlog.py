"""`python -m tools.testlog FILE`: where a `make test` run's time went, from its
`TEST_CPU_LOG=FILE` (tests/conftest.py: `cpu_s wall_s start runner nodeid` a test).

For each phase (`make test` runs two pytest commands one after the other; a new
phase begins where no test has run for `PHASE_GAP_S`), its wall time, the
CPU its tests used, how many of the two cores that kept busy on average, and when
each runner ran out of work. A runner that ends long after the others shows a
test file that started too late (tests/conftest.py, `LONGEST_FIRST`). Then the
tests that waited most: wall time less CPU time (docs/testing.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys


@dataclasses.dataclass(frozen=True)
class Test:
    cpu: float
    wall: float
    start: float
    runner: str
    nodeid: str

    @property
    def end(self) -> float:
        return self.start + self.wall


def read(path: pathlib.Path) -> list[Test]:
    tests = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split(None, 4)
        try:
            cpu, wall, start, runner, nodeid = fields
            tests.append(Test(float(cpu), float(wall), float(start), runner, nodeid))
        except ValueError:  # too few fields, or a number that is not one
            raise ValueError(f"{path}:{number}: not `cpu_s wall_s start runner nodeid` (an "
                             f"older TEST_CPU_LOG holds `cpu_s nodeid` only): {line!r}") from None
    return sorted(tests, key=lambda t: t.start)


# Between `make test`'s two pytest commands the second starts its runners, each of
# which imports TensorFlow: longer than any pause between two tests of one runner.
PHASE_GAP_S = 5.0


def phases(tests: list[Test]) -> list[list[Test]]:
    """The tests split where one starts `PHASE_GAP_S` after every test before it ended."""
    split: list[list[Test]] = []
    last_end = float("-inf")
    for test in tests:
        if test.start > last_end + PHASE_GAP_S:
            split.append([])
        split[-1].append(test)
        last_end = max(last_end, test.end)
    return split


def summary(tests: list[Test], waiting: int = 5) -> str:
    lines = []
    for number, phase in enumerate(phases(tests), 1):
        start = phase[0].start
        wall = max(t.end for t in phase) - start
        cpu = sum(t.cpu for t in phase)
        lines.append(f"phase {number}: {len(phase)} tests, {wall:.0f} s, {cpu:.0f} CPU s, "
                     f"{cpu / wall if wall else 0:.2f} cores busy")
        for runner in sorted({t.runner for t in phase}):
            own = [t for t in phase if t.runner == runner]
            lines.append(f"  {runner}: out of work at {max(t.end for t in own) - start:.0f} s, "
                         f"{sum(t.cpu for t in own):.0f} CPU s")
    lines.append("waited most (wall s, CPU s):")
    for test in sorted(tests, key=lambda t: t.cpu - t.wall)[:waiting]:
        lines.append(f"  {test.wall:.0f} {test.cpu:.0f} {test.nodeid}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.testlog", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", type=pathlib.Path, help="the file TEST_CPU_LOG named")
    parser.add_argument("--waiting", type=int, default=5, metavar="N",
                        help="how many of the tests that waited most to list (5)")
    args = parser.parse_args(argv)
    try:
        print(summary(read(args.log), args.waiting))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
