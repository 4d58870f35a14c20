"""``benchmarks.deployed_memory`` at its smallest size, as CI runs it: a real local ParaBlock deployment whose
worker and ServerApp are polled for their resident memory beside ``plan``'s figures. What a worker holds does
not grow with rounds (a reference cycle that kept each round's blocks for the collector's rare full pass made a
ParaBlock worker grow by more than a block a round). At this size the runtime dominates; the plan against a
model of operators' block sizes is in docs/results/deployed_memory.md. Weights in fp32: this CPU has no bf16
instructions, and bf16's computation made this test take 10 minutes of CI's (the page runs it in bf16)."""

from __future__ import annotations

import pytest

from benchmarks import deployed_memory

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HIDDEN = 1024
BLOCK_FP32 = deployed_memory.LAYERS_PER_BLOCK * 9 * HIDDEN * HIDDEN * 4  # attention 3h^2, MLP 6h^2 (fp32)


def test_a_deployed_parablock_worker_holds_what_its_round_needs_round_after_round(capsys):
    args = ["--hidden", str(HIDDEN), "--rounds", "6", "--algorithms", "parablock", "--weights", "fp32"]
    (result,) = deployed_memory.main(args)
    peaks = [r["node_peak_rss_bytes_max"] for r in result["records"] if "node_peak_rss_bytes_max" in r]
    assert len(peaks) == 6 and peaks == sorted(peaks), peaks  # the process's peak so far, as each reply said it
    assert peaks[-1] - peaks[-3] < BLOCK_FP32, peaks  # the last two rounds: not a block more (the cycle: 5)
    polled, planned = result["peak"], result["plan"]
    assert polled["worker"] >= peaks[-1] * 0.95, (polled, peaks)  # the poll sees what the worker reported
    for kind in ("worker", "serverapp"):  # plan's figures, within what the runtime's share allows at this size
        assert 0.6 < polled[kind] / planned[kind] < 1.5, (kind, polled, planned)
    assert "| parablock | int8 |" in capsys.readouterr().out
