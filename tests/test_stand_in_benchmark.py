"""``benchmarks.stand_in`` at its smallest size, as CI runs it: a real local deployment per algorithm whose
workers' computation waits C seconds off the CPU; the round's legs are measured, and ParaBlock's computation
overlaps its exchange where BCD's does not. The targets it reports (``benchmarks.round_compare``, which the GPU
check's comparison runs too) are judged from the figures, met or not."""

from __future__ import annotations

import math
import os
import shutil

import pytest

from benchmarks import round_compare, stand_in
from parablock_flwr.messages import WORKER_LEGS


@pytest.mark.e2e
@pytest.mark.slow
def test_the_stand_in_benchmark_measures_both_algorithms_and_parablock_hides_the_compute(capsys):
    own_cpus = os.sched_getaffinity(0)
    pinnable = len(own_cpus) >= 2 and shutil.which("taskset") is not None
    pin = ["--pin"] if pinnable else []  # workers on CPUs of their own, as the A/Bs run it
    results = stand_in.main(["--hidden", "256", "--rounds", "4", "--compute-s", "1.5", *pin])
    assert os.sched_getaffinity(0) == own_cpus  # the benchmark gives its own CPUs back
    bcd, parablock = results[256]["fedbcd"], results[256]["parablock"]
    for measured in (bcd, parablock):
        assert 1.5 <= measured["measured_compute_s"] < 1.8  # the stand-in's wait, as the worker timed it
        assert measured["server_cpu_s"] > 0 and measured["worker_round_cpu_s"] > 0  # a round's CPU, each side
        assert measured["critical_path_aggregate_s"] >= 0 and measured["server_critical_path_s"] >= 0
        assert all(measured[f"measured_{leg}"] >= 0 for leg in WORKER_LEGS), measured  # the worker's own legs
        assert measured["server_one_pass_s"] > 0 and "server_combine_s" not in measured, measured  # the server's
    # BCD's worker applies g^{r-1} before it computes, rounds its update and uploads it once its message is in.
    assert min(bcd["measured_step_apply_s"], bcd["measured_rounding_s"], bcd["measured_upload_s"]) > 0, bcd
    # Causal, not a race of durations: ParaBlock's worker starts round r+1 before its round-r reply leaves, so
    # its computation covers part of the window; BCD's starts only once round r+1's message is in.
    assert parablock["measured_overlap_share"] > 0 and bcd["measured_overlap_share"] == 0, (parablock, bcd)
    ratio, ideal = round_compare.against_ideal(bcd, parablock)
    assert 0 < ideal <= 1 and ratio > 0
    out = capsys.readouterr().out
    assert (
        "ParaBlock / BCD" in out and "step apply " in out and "| 256 (2 MB): BCD's round ≤ C + link + 1 s (s) |" in out
    )


@pytest.mark.skipif(len(getattr(os, "sched_getaffinity", lambda _: ())(0)) < 2, reason="--pin needs 2 CPUs (Linux)")
def test_pinned_workers_run_under_taskset_on_the_upper_half_of_the_cpus():
    rest, workers = stand_in.pinned_halves()
    assert rest and workers and not set(rest) & set(workers) and set(rest) | set(workers) == os.sched_getaffinity(0)
    real = ["/venv/python", "-m", "parablock_flwr.worker", "--socket", "s"]
    command = stand_in.stand_in_worker(2.5, [3, 4])(real)
    assert command == ["taskset", "-c", "3,4", "/venv/python", "-m", "benchmarks.stand_in_worker", "--compute-s", "2.5",
                       "--socket", "s"]  # fmt: skip
    assert stand_in.stand_in_worker(2.5)(real)[:3] == ["/venv/python", "-m", "benchmarks.stand_in_worker"]


def test_a_workers_cpu_a_round_is_what_its_running_total_grew_by_from_round_3_on():
    def record(r, *cpu):
        return {"round": r, "timeline": [{"node": n, "worker_cpu_s": c} for n, c in enumerate(cpu)]}

    records = [{"round": 0}, record(1, 1.0, 2.0), record(2, 3.0, 4.0), record(3, 6.0, 8.0), record(4, 10.0, 9.0)]
    assert round_compare.worker_cpu(records) == pytest.approx((3 + 4 + 4 + 1) / 4)  # rounds 3 and 4, both nodes
    assert round_compare.worker_cpu(records[:3]) is None  # no round 3: nothing measured
    restarted = [*records[:4], record(4, 10.0, 0.5)]  # node 1's worker counts from 0 again: not a round's figure
    assert round_compare.worker_cpu(restarted) == pytest.approx((3 + 4 + 4) / 3)
    missing = [*records[:3], record(3, 6.0), record(4, 10.0, 9.0)]  # node 1 absent from round 3: rounds 3, 4 lack it
    assert round_compare.worker_cpu(missing) == pytest.approx((3 + 4) / 2)


def test_the_means_start_after_each_blocks_first_round_and_first_step():
    """A block's first round makes its buffers afresh and its first step is the first write to its ``x`` (on the CPU,
    pages copied from the model's file): seconds once per block, not a round's cost. Two blocks in turn: round 3 steps
    block 1 for the first time, round 4 is the first steady one; four blocks: round 6; one block: round 3; a random
    schedule that trains block 1 first in round 4: round 6; too few rounds (the last one alone has no next message to
    time): none, and the means run from round 3."""

    def run(blocks, rounds=None):
        rounds = rounds or len(blocks)
        return [{"round": 0}] + [{"round": r, "block": blocks[(r - 1) % len(blocks)], "round_wall_s": float(r)}
                                 for r in range(1, rounds + 1)]  # fmt: skip

    assert round_compare.first_steady_round(run([0, 1], 6)) == 4
    assert round_compare.first_steady_round(run([0, 1, 2, 3], 8)) == 6
    assert round_compare.first_steady_round(run([0], 4)) == 3
    assert round_compare.first_steady_round(run([0, 0, 0, 1, 0, 1, 1])) == 6
    assert round_compare.first_steady_round(run([0, 1, 2, 3], 5)) is None
    assert round_compare.first_steady_round(run([0, 1], 4)) is None  # round 4 alone: the last, no next message
    steady, short = round_compare.means(run([0, 1], 6)), round_compare.means(run([0, 1, 2, 3], 5))
    assert (steady["steady_from"], steady["steady"], steady["round_wall_s"]) == (4, True, (4 + 5 + 6) / 3)
    assert (short["steady_from"], short["steady"], short["round_wall_s"]) == (3, False, (3 + 4 + 5) / 3)
    assert round_compare.window([{"fedbcd": steady, "parablock": steady}]).startswith("means of rounds 4..R (from")
    assert "too short" in round_compare.window([{"fedbcd": steady, "parablock": short}])


def test_the_workers_own_work_is_the_mean_over_every_round_from_the_first_steady_one():
    """Round r's message in to its reply out (round r+1's ``prev_reply_sent``), less the computation in it, per node;
    rounds from ``start`` to the one before the last (whose reply no later record carries)."""
    records = [{"round": 0}]
    for r in range(1, 6):  # the computation takes 2 s in odd rounds, 1 s in even ones; the reply leaves 5 s in
        row = {"node": 0, "request_received": 10.0 * r, "compute_start": 10.0 * r + 1,
               "compute_end": 10.0 * r + 2 + r % 2, "prev_reply_sent": 10.0 * (r - 1) + 5}  # fmt: skip
        records.append({"round": r, "timeline": [row]})
    assert round_compare.worker_non_compute(records, start=3) == pytest.approx((3 + 4) / 2)  # rounds 3 and 4
    assert round_compare.worker_non_compute(records, start=1) == pytest.approx((3 + 4 + 3 + 4) / 4)


def test_each_target_is_judged_from_its_figures_and_one_not_measured_is_said():
    """At 247 MB: the per-byte bound is 0.3 s + 0.247 s; BCD's round against C + 1 s; ParaBlock/BCD against 1.1 times
    the ideal; verify-invariant's cost against a tenth of ParaBlock's round. A figure a run lacks is not met."""
    bcd = {"round_wall_s": 4.0, "measured_compute_s": 2.5, "server_critical_path_s": 0.5, "worker_non_compute_s": 0.6}
    parablock = {"round_wall_s": 2.7, "measured_compute_s": 2.5, "server_critical_path_s": 0.6}
    verified = {"round_wall_s": 3.1, "measured_compute_s": 2.5}
    found = round_compare.targets("s", 247e6, {"fedbcd": bcd, "parablock": parablock, round_compare.VERIFIED: verified})
    judged = {what: (value, bound) for what, value, bound in found}
    assert judged["s, fedbcd: server, last reply to next messages out (s)"] == (0.5, pytest.approx(0.547))
    assert judged["s: BCD's round ≤ C + link + 1 s (s)"] == (4.0, 3.5)
    assert judged["s: ParaBlock / BCD, within 10 % of the ideal"] == (pytest.approx(0.675), pytest.approx(0.6875))
    assert judged["s: verify-invariant's cost, share of ParaBlock's round"][0] == pytest.approx(0.4 / 2.7)
    assert math.isnan(judged["s, parablock: worker, message to reply less compute (s)"][0])
    table = round_compare.targets_table(found).splitlines()
    met = {row.split(" | ")[0].lstrip("| "): row.rsplit(" | ", 1)[1].rstrip(" |") for row in table[2:]}
    assert met["s, fedbcd: server, last reply to next messages out (s)"] == "yes"
    assert met["s: BCD's round ≤ C + link + 1 s (s)"] == "**no**"
    assert met["s: ParaBlock / BCD, within 10 % of the ideal"] == "yes"
    assert met["s: verify-invariant's cost, share of ParaBlock's round"] == "**no**"
    assert met["s, parablock: worker, message to reply less compute (s)"] == "not measured"
    # On a link of 4 s a round (a block each way): the rounds and the worker's own work get its time, not the server.
    on_link = round_compare.targets("s", 247e6, {"fedbcd": bcd, "parablock": parablock}, link_s=4.0)
    linked = {what: bound for what, _, bound in on_link}
    assert linked["s: BCD's round ≤ C + link + 1 s (s)"] == 7.5
    assert linked["s: ParaBlock's round ≤ max(C, link) + 1 s, beyond (s)"] == 5.0
    assert linked["s, fedbcd: worker, message to reply less compute (s)"] == pytest.approx(4.547)
    assert linked["s, fedbcd: server, last reply to next messages out (s)"] == pytest.approx(0.547)
