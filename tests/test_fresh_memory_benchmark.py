"""``benchmarks.fresh_memory`` at a small size: each case measured in a process of its own, with and without the
launch's huge pages, and printed as a row."""

import pytest

from benchmarks import fresh_memory


@pytest.mark.slow
def test_the_fresh_memory_benchmark_measures_each_case_with_and_without_huge_pages(capsys):
    results = fresh_memory.main(["--mb", "8", "--repeats", "1", "--pauses", "0", "0.2"])
    out = capsys.readouterr().out
    assert results["results"][True]["huge_pages"] and not results["results"][False]["huge_pages"]
    cases = ["never used", "resident", "freed 0 s before", "freed 0.2 s before"]
    for huge in (True, False):
        seconds = results["results"][huge]["seconds"]
        assert list(seconds) == cases and all(s > 0 for s in seconds.values()), seconds
    for case in cases:
        assert f"| {case} |" in out
    assert "free pages reported to a host: " in out and results["reporting"] in out


@pytest.mark.parametrize("argv", [["--mb", "0"], ["--repeats", "0"], ["--pauses", "-1"]])
def test_a_bad_argument_is_said_in_one_line(argv, capsys):
    with pytest.raises(SystemExit):
        fresh_memory.main(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "expected at least 1, 1 and 0" in err and argv[1] in err
