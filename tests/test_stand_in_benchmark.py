"""``benchmarks.stand_in`` at its smallest size, as CI runs it: a real local deployment per algorithm whose
workers' computation waits C seconds off the CPU; the round's legs are measured and ParaBlock hides C."""

from __future__ import annotations

import pytest

from benchmarks import stand_in

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_the_stand_in_benchmark_measures_both_algorithms_and_parablock_hides_the_compute(capsys):
    results = stand_in.main(["--hidden", "256", "--rounds", "4", "--compute-s", "1.5"])
    bcd, parablock = results[256]["fedbcd"], results[256]["parablock"]
    for measured in (bcd, parablock):
        assert 1.5 <= measured["measured_compute_s"] < 1.8  # the stand-in's wait, as the worker timed it
        assert measured["critical_path_aggregate_s"] >= 0 and measured["server_critical_path_s"] >= 0
    assert bcd["round_wall_s"] > 1.5  # BCD pays its compute and its exchange one after the other
    ratio, ideal = stand_in.against_ideal(bcd, parablock)
    assert ratio < 1.0 and ratio < 1.5 * ideal, (ratio, ideal)  # ParaBlock hides its exchange behind C
    assert "ParaBlock / BCD" in capsys.readouterr().out
