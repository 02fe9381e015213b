"""experiments/staleness.py: what it refuses before any run (the runs are an experiment)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "experiments"))
import staleness  # noqa: E402


def test_delays_are_read_as_whole_numbers_of_updates():
    assert staleness.parse_args(["--delays", "0,1,4"]).delays == [0, 1, 4]


@pytest.mark.parametrize("delays", ["0,x", "-1", "0,,1"])
def test_a_bad_delay_names_the_flag_and_the_fix(delays, capsys):
    with pytest.raises(SystemExit) as exited:
        staleness.parse_args(["--delays", delays])
    assert exited.value.code == 2
    assert (f"argument --delays: {delays!r}: give whole numbers of updates from 0, e.g. 0,1"
            in capsys.readouterr().err)


@pytest.mark.parametrize("flag", ["--steps", "--epochs", "--seeds"])
def test_no_run_without_a_step_an_epoch_and_a_seed(flag, capsys):
    assert staleness.main([flag, "0"]) == 2
    assert "error: --steps, --epochs and --seeds must each be at least 1" in capsys.readouterr().err
