"""``benchmarks.stand_in`` at its smallest size, as CI runs it: a real local deployment per algorithm whose
workers' computation waits C seconds off the CPU; the round's legs are measured, and ParaBlock's computation
overlaps its exchange where BCD's does not."""

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
    # Causal, not a race of durations: ParaBlock's worker starts round r+1 before its round-r reply leaves, so
    # its computation covers part of the window; BCD's starts only once round r+1's message is in.
    assert parablock["measured_overlap_share"] > 0 and bcd["measured_overlap_share"] == 0, (parablock, bcd)
    ratio, ideal = stand_in.against_ideal(bcd, parablock)
    assert 0 < ideal <= 1 and ratio > 0
    assert "ParaBlock / BCD" in capsys.readouterr().out
