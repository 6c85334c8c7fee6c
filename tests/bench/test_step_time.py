"""bench.step_time: the interpolation between measured batch sizes, and a run of the benchmark on
the tiny model (its table: one row per batch size, a strict row and a sharing row per smaller size)."""

import pytest

from bench.step_time import interpolate, main


def test_interpolate_is_linear_between_measured_sizes_and_flat_outside():
    points = {1: 2.0, 8: 4.0, 64: 18.0}
    assert interpolate(points, 1) == 2.0
    assert interpolate(points, 4) == pytest.approx(2.0 + 2.0 * 3 / 7)
    assert interpolate(points, 36) == pytest.approx(11.0)
    assert interpolate(points, 100) == 18.0


def test_the_benchmark_prints_a_row_per_batch_size_and_per_mode(capsys):
    assert main(["--batch-sizes", "1,2,4", "--tokens", "3", "--repeat", "1", "--probes", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines[2:5]]
    assert [row[0] for row in rows] == ["1", "2", "4"]
    assert all(float(row[1]) == float(row[1]) for row in rows)  # a number each; a difference of two timings may be negative
    modes = [line.split()[0] + (" " + line.split()[1] if line.split()[0] == "sharing" else "") for line in lines[8:]]
    assert modes == ["strict", "sharing 1", "sharing 2"]


@pytest.mark.parametrize("argv", [["--batch-sizes", "2,4"], ["--batch-sizes", "0,1"], ["--batch-sizes", "1,x"],
                                  ["--tokens", "1"], ["--repeat", "0"]])
def test_bad_arguments_are_usage_errors_before_any_model_loads(argv, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2 and "error:" in capsys.readouterr().err
