"""End to end through `flwr run` on Flower's Ray simulation engine, tiny real Llama.

3 virtual clients on 2 Ray actors (1 CPU each on this 2-core machine), so a
node's messages land on different actors and each actor's copy of the global
model must catch up from the server's step log.
"""

import json
import logging
import os

import pytest
import torch

from parablock_flwr import core
from parablock_flwr.checkpoint import check_resumable
from parablock_flwr.model import load_model
from parablock_flwr.node.state import ResidualStore
from parablock_flwr.replica import StepLog
from parablock_flwr.report import report
from parablock_flwr.strategies.round_stats import SERVER_LEGS

from helpers import side_by_side, simulate, simulate_and_kill_server, simulate_in_process, succeeded

pytestmark = pytest.mark.e2e  # every test here runs `flwr run` (or reads a run's output)

ROUNDS = 4
SCHEDULE = dict(schedule="uniform-random", seed=1)  # over 2 blocks: [0, 0, 1, 0], a block repeats


@pytest.fixture(scope="module")
def module_runs(tmp_path_factory, tiny_model_dir) -> dict:
    """The runs several tests read, side by side (``side_by_side``): ParaBlock and FedBCD through Ray, and ParaBlock
    in int8 without Ray (the same ServerApp and ClientApp, the same bits). ParaBlock's correction is ``auto``:
    at-end, the run being deterministic."""
    same = dict(num_server_rounds=ROUNDS, save_final_model=True, **SCHEDULE)
    return side_by_side({
        "parablock": lambda: simulate(tmp_path_factory.mktemp("parablock"), tiny_model_dir, algorithm="parablock",
                                      verify_invariant=True, **same),
        "parablock-int8": lambda: simulate_in_process(tmp_path_factory.mktemp("parablock-int8"), tiny_model_dir,
                                                      algorithm="parablock", verify_invariant=True,
                                                      transfer_dtype="int8", **same),
        "fedbcd": lambda: simulate(tmp_path_factory.mktemp("fedbcd"), tiny_model_dir, algorithm="fedbcd", **same),
    })  # fmt: skip


@pytest.fixture(scope="module")
def parablock_run(module_runs):
    return module_runs["parablock"]


@pytest.fixture(scope="module")
def parablock_int8_run(module_runs):
    """`parablock_run` with `transfer-dtype = "int8"` (error feedback: each node's residuals). int8 rather than
    bf16: the same error feedback and residual store, and the one with scales (bf16: tests/test_wire.py)."""
    return module_runs["parablock-int8"]


@pytest.fixture(scope="module")
def fedbcd_run(module_runs):
    return module_runs["fedbcd"]


# The runs of the tests of a run's outcome, each with its own settings (``outcome_runs``).
OUTCOMES = {
    # 4 clients, half sampled each round (without Ray: Flower's in-memory grid samples the same way)
    "partial": (simulate_in_process, dict(num_supernodes=4, fraction_train=0.5, num_server_rounds=6,
                                          verify_invariant=True)),
    # every update breaks a tiny norm bound; one retry (without Ray)
    "too-few": (simulate_in_process, dict(num_supernodes=2, num_server_rounds=2, max_update_norm=1e-9,
                                          max_round_retries=1)),
    "invalid": (simulate, dict(num_supernodes=1, layers_per_block=9)),
    # every reply claims more examples than allowed, and no reply is needed
    "exclusions": (simulate, dict(num_supernodes=2, num_server_rounds=2, max_num_examples=1, min_accepted_replies=0)),
}  # fmt: skip


@pytest.fixture(scope="module")
def outcome_runs(tmp_path_factory, tiny_model_dir) -> dict:
    """``OUTCOMES``' runs side by side (``side_by_side``)."""

    def run(label):
        how, settings = OUTCOMES[label]
        return lambda: how(tmp_path_factory.mktemp(label), tiny_model_dir, **settings)

    return side_by_side({label: run(label) for label in OUTCOMES})


def test_the_records_read_forwards_in_time_and_the_export_reads_like_its_folder(parablock_int8_run):
    """Round 0 (x^0) is stamped at the run's start, whenever its evaluation ended, and each round's stamp is
    after the one before: loss against wall-clock reads forwards. Every file of the exported model has the
    mode of the folder's other files (safetensors writes the weights 0600 on its own)."""
    records = succeeded(parablock_int8_run).records
    stamps = [r["elapsed_s"] for r in records]
    assert stamps[0] == 0.0 and stamps == sorted(stamps), stamps
    files = [p for p in (parablock_int8_run.run_dir / "final-model").iterdir() if p.is_file()]
    assert "model.safetensors" in {p.name for p in files}
    assert {p.stat().st_mode & 0o777 for p in files} == {(files[0].parent / "config.json").stat().st_mode & 0o777}


def test_schedule_repeats_a_block():
    schedule = core.block_schedule(SCHEDULE["schedule"], 2, ROUNDS, SCHEDULE["seed"])
    assert any(a == b for a, b in zip(schedule, schedule[1:])), schedule


def test_invariant_holds_bit_for_bit_on_every_client_every_round(parablock_run):
    records = succeeded(parablock_run).records
    assert [r["round"] for r in records] == list(range(ROUNDS + 1))
    for rec in records[1:]:
        assert rec["num_accepted"] == 3, rec
        assert rec["invariant_checked"] == 3, rec
        assert rec["invariant_failed"] == 0, rec
    # Every client computed from the stale x^{r-2} + its pending update (none had to resynchronise),
    # although 3 nodes share 2 actors whose copies of x are at x^{r-1} or behind.
    assert all(rec["num_resynchronised"] == 0 for rec in records[1:])


def test_each_round_is_logged_and_recorded(parablock_run):
    succeeded(parablock_run)
    lines = [line for line in parablock_run.stdout.splitlines() if "[parablock] round " in line]
    assert len(lines) == ROUNDS + 1
    rec = parablock_run.records[2]
    for key in (
        "block",
        "train_loss",
        "heldout_loss",
        "bytes_up_per_client",
        "bytes_down_per_client",
        "compute_s_max",
        "modeled_round_s",
        "modeled_round_s_sequential",
        "modeled_round_s_overlapped",
    ):
        assert key in rec, key
    assert rec["modeled_round_s_overlapped"] < rec["modeled_round_s_sequential"]
    assert rec["modeled_round_s"] == rec["modeled_round_s_overlapped"]


def test_both_algorithms_lower_the_heldout_loss(parablock_run, fedbcd_run):
    for run in (succeeded(parablock_run), succeeded(fedbcd_run)):
        losses = [r["heldout_loss"] for r in run.records]
        assert losses[-1] < losses[0] - 0.05, losses


def test_parablock_and_fedbcd_differ_from_round_2(parablock_run, fedbcd_run):
    succeeded(parablock_run), succeeded(fedbcd_run)
    block_p, step_p = parablock_run.step(1)
    block_f, step_f = fedbcd_run.step(1)
    assert block_p == block_f and all(torch.equal(step_p[n], step_f[n]) for n in step_p)
    _, step_p2 = parablock_run.step(2)
    _, step_f2 = fedbcd_run.step(2)
    assert any(not torch.equal(step_p2[n], step_f2[n]) for n in step_p2)


def test_the_correction_modes_change_the_run_only_where_the_correction_acts(tmp_path, tiny_model_dir, parablock_run):
    """Against ParaBlock at-end (``parablock_run``, through Ray: the same settings, its correction ``auto`` at-end in
    a deterministic run, and its invariant digests change no bit):
    ``on-receipt`` (in simulation, after the first local step) first differs in round 2, whose computation it
    corrects; the ablation ``none`` trains round 2 from the same x^0 + Δ_i^1 and first differs in round 3, the
    first computation that at-end's correction reaches. The two runs without Ray (``simulate_in_process``: the same
    ClientApp and node code, seconds to start), side by side."""

    def run(mode):
        return lambda: simulate_in_process(tmp_path / mode, tiny_model_dir, num_server_rounds=ROUNDS, correction=mode,
                                           **SCHEDULE)  # fmt: skip

    runs = {mode: succeeded(done) for mode, done in side_by_side({m: run(m) for m in ("on-receipt", "none")}).items()}
    at_end = succeeded(parablock_run)
    first_difference = {}
    for mode, run in runs.items():
        for version in range(1, ROUNDS + 1):
            (block, step), (block_at_end, step_at_end) = run.step(version), at_end.step(version)
            assert block == block_at_end
            if any(not torch.equal(step[n], step_at_end[n]) for n in step):
                first_difference[mode] = version
                break
    assert first_difference == {"on-receipt": 2, "none": 3}
    assert all(r["num_accepted"] == 3 for run in runs.values() for r in run.records[1:])


def test_frozen_parameters_are_untouched_and_only_scheduled_blocks_move(parablock_run, tiny_model_dir):
    base = dict(load_model(str(tiny_model_dir)).named_parameters())
    final = succeeded(parablock_run).final_model()
    part = core.partition_blocks(load_model(str(tiny_model_dir)), layers_per_block=2)
    scheduled = set(core.block_schedule(SCHEDULE["schedule"], 2, ROUNDS, SCHEDULE["seed"]))
    trained = {n for b in scheduled for n in part.names(b)}
    for name, value in final.items():
        if name not in base:
            continue  # the tied lm_head is stored once
        if name in trained:
            continue
        assert torch.equal(value, base[name].detach()), f"{name} moved"
    assert any(not torch.equal(final[n], base[n].detach()) for n in trained)


def test_single_client_parablock_equals_fedbcd_bit_for_bit(tmp_path, tiny_model_dir):
    """With one client Δ̄ = Δ, so the correction is zero and there is no staleness. (Without Ray:
    ``simulate_in_process``, the same ClientApp and node code; the two side by side.)"""

    def run(algo):
        return lambda: simulate_in_process(tmp_path / algo, tiny_model_dir, algorithm=algo, num_supernodes=1,
                                           num_server_rounds=3, deterministic=True, server_lr=1.0)  # fmt: skip

    runs = [succeeded(done) for done in side_by_side({a: run(a) for a in ("parablock", "fedbcd")}).values()]
    for version in (1, 2, 3):
        (bp, sp), (bf, sf) = runs[0].step(version), runs[1].step(version)
        assert bp == bf
        assert all(torch.equal(sp[n], sf[n]) for n in sp), f"step {version} differs"


def test_invalid_config_stops_before_training_with_one_line(outcome_runs):
    run = outcome_runs["invalid"]
    assert "Invalid configuration: layers-per-block=9: expected 1..4" in run.stdout + run.stderr
    # Nothing was trained or written but the status record, and the exit code says why.
    assert run.returncode == 2 and [p.name for p in run.run_dir.iterdir()] == ["status.json"]
    assert run.status["kind"] == "invalid-config" and "layers-per-block=9" in run.status["reason"]


def test_report_and_evaluate_commands_on_the_run(parablock_run, capsys):
    from parablock_flwr.cli import main

    run = succeeded(parablock_run)
    assert main(["report", str(run.run_dir)]) == 0
    out = capsys.readouterr().out
    assert "held-out loss" in out and len(out.splitlines()) >= ROUNDS + 2
    for png in ("loss_and_bytes.png", "time_per_round.png"):
        assert (run.run_dir / "plots" / png).stat().st_size > 10_000
    # The saved final model, evaluated by the command, scores what the server measured last round.
    assert main(["evaluate", str(run.run_dir / "final-model"), "--config", str(run.run_dir / "config.json")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["heldout_loss"] == pytest.approx(run.records[-1]["heldout_loss"], rel=1e-5)


def test_partial_participation_resynchronises_returning_clients(outcome_runs):
    """4 clients, half sampled each round: a client back from a skipped round trains from x^{r-1}. Without Ray
    (Flower's in-memory grid samples the same way)."""
    run = succeeded(outcome_runs["partial"])
    records = run.records[1:]
    assert all(r["num_replies"] == 2 and r["num_accepted"] == 2 for r in records)
    # Every participating client's local model is exactly x^{r-1} + its own update, resynchronised or not.
    assert all(r["invariant_checked"] == 2 and r["invariant_failed"] == 0 for r in records)
    assert sum(r["num_resynchronised"] for r in records) > 0
    assert records[-1]["heldout_loss"] < run.records[0]["heldout_loss"]


def test_too_few_valid_replies_are_retried_then_stop_the_run(outcome_runs):
    """Every update breaks a tiny norm bound: the round is re-sent once, then the run stops with one line.
    Without Ray."""
    run = outcome_runs["too-few"]
    out = run.stdout + run.stderr
    assert out.count("fewer than min-accepted-replies=1: re-sending to 2 nodes (retry 1 of 1)") == 1, out[-3000:]
    assert "Stopping the run: round 1: 0 valid replies, expected at least min-accepted-replies=1" in out
    assert "above max-update-norm=1e-09" in out
    assert not (run.run_dir / "global-steps").exists()  # x never moved


def test_a_run_that_left_nodes_out_says_so_and_exits_5(outcome_runs):
    """Every reply claims more examples than `max-num-examples = 1` allows: each round is rejected
    (and, with `min-accepted-replies = 0`, left empty). The run does not end as `completed`: its
    status, exit code and last line name each node left out and why (before: exit 0, "completed")."""
    run = outcome_runs["exclusions"]
    assert run.returncode == 5 and run.status["kind"] == "completed-with-exclusions", run.stdout[-3000:]
    excluded = run.status["excluded_nodes"]
    assert len(excluded) == 2 and all("not aggregated in 2 of 2 rounds" in line for line in excluded), excluded
    assert all("expected a number in (0, 1]" in line for line in excluded)
    last = [line for line in run.stdout.splitlines() if "[parablock]" in line][-1]
    assert "Run completed with exclusions (exit code 5)" in last and excluded[0] in last


def test_a_server_killed_at_every_stage_of_a_round_resumes_to_the_same_final_model(
    tmp_path, tiny_model_dir, parablock_run, caplog
):
    """The server SIGKILLs itself (``PARABLOCK_CRASH_AT``) at each stage of a round, one stage per
    run, each run resumed from the one before: in the middle of round 1's record (a torn last line
    of metrics.jsonl), in round 3's step-log write, in round 3's evaluation (its checkpoint is
    durable already), in round 4's checkpoint (the old one stays). The last run ends with the
    uninterrupted run's model (`parablock_run`, through Ray), bit for bit, every round recorded once.

    The runs go without Ray (``simulate_in_process``: the ServerApp and the real ClientApp of 3
    nodes in one process over Flower's in-memory LinkState and Grid), which the kill takes down
    whole, nodes included; a killed Ray simulation and its fresh actors: the int8 test below."""
    same = dict(algorithm="parablock", num_server_rounds=ROUNDS, verify_invariant=True, **SCHEDULE)
    chain = [("record@1", 1), ("step-log@3", 2), ("evaluation@3", 3), ("checkpoint@4", 3)]
    resume_from, runs = {}, []
    for crash_at, checkpointed in chain:
        run = simulate_in_process(tmp_path / crash_at, tiny_model_dir, crash_at=crash_at, **same, **resume_from)
        assert run.returncode == -9 and run.run_dir is not None and run.status is None, (crash_at, run.stdout[-3000:])
        checkpoints = sorted(p.name for p in (run.run_dir / "checkpoint").glob("round-*"))
        assert checkpoints[0] == f"round-{checkpointed:05d}", (crash_at, checkpoints)
        runs.append(run)
        resume_from = {"resume_from": str(run.run_dir)}

    metrics = runs[0].run_dir / "metrics.jsonl"
    assert not metrics.read_bytes().endswith(b"\n")  # round 1's record was cut mid-line
    assert (runs[1].run_dir / "global-steps" / "v00003.safetensors.tmp").exists()
    assert checkpoints == ["round-00003", "round-00004.tmp"]  # the crash left the new one unfinished
    with pytest.raises(ValueError, match=r"learning-rate=0.5 differs from the checkpointed run's 0.003"):
        check_resumable(runs[-1].run_dir, {**json.loads((runs[-1].run_dir / "config.json").read_text()),
                                           "learning-rate": 0.5})  # fmt: skip

    resumed = succeeded(simulate_in_process(tmp_path / "resumed", tiny_model_dir, save_final_model=True, **same,
                                      **resume_from))  # fmt: skip
    assert "after round 3 (3 pending client updates" in resumed.stdout
    assert f"{metrics}: line 3 is torn" in runs[1].stdout + runs[1].stderr  # the resume skipped it, said so
    with caplog.at_level(logging.WARNING):
        assert "status: unknown" in report(runs[0].run_dir)  # so does `report`
    assert f"{metrics}: line 3 is torn" in caplog.text
    records = resumed.records
    assert [r["round"] for r in records] == list(range(ROUNDS + 1))
    assert all(r["heldout_loss"] is not None and "evaluate_s" in r for r in records)  # x^1, x^3 evaluated again
    # Round 4 ran from each client's own x^2 + Δ_i^3 (handed back), no client resynchronised.
    assert records[4]["num_resynchronised"] == 0 and records[4]["invariant_checked"] == 3
    assert all(r["invariant_failed"] == 0 for r in records[1:])
    uninterrupted, final = parablock_run.final_model(), resumed.final_model()
    assert final.keys() == uninterrupted.keys()
    assert all(torch.equal(final[n], uninterrupted[n]) for n in final)
    for version in range(1, ROUNDS + 1):
        assert all(
            torch.equal(a, b)
            for a, b in zip(resumed.step(version)[1].values(), parablock_run.step(version)[1].values())
        )


def test_with_int8_transfer_a_killed_server_resumes_to_the_same_final_model(
    tmp_path, tiny_model_dir, parablock_int8_run
):
    """The server process dies in round 3 of 4 (the launcher exits 1 and no status record is written);
    `resume-from` continues from round 2's checkpoint and ends with the uninterrupted int8 run's model, bit for
    bit. Each node's error-feedback residuals come back too: as of round 2, from the killed run's `node-state/`
    (the new Ray actors' `context.state` starts empty), although nodes may have answered round 3 before the kill
    (fp32 at every stage of a round: the test above)."""
    uninterrupted_run = parablock_int8_run
    same = dict(algorithm="parablock", num_server_rounds=ROUNDS, verify_invariant=True, transfer_dtype="int8",
                **SCHEDULE)  # fmt: skip
    killed = simulate_and_kill_server(tmp_path / "killed", tiny_model_dir, after_round=2, **same)
    assert killed.run_dir is not None and not (killed.run_dir / "final-model").exists()
    # The launcher says the server died: exit code 1, and no status record (nothing recorded its end).
    assert killed.returncode == 1 and killed.status is None and not (killed.run_dir / "status.json").exists()
    assert [p.name for p in (killed.run_dir / "checkpoint").glob("round-*")] == ["round-00002"]

    # the residuals of round 2 were written durably, one file per block
    assert sorted(p.name for p in (killed.run_dir / "node-state" / "partition-0").glob("r00002-*"))
    with pytest.raises(ValueError, match=r"learning-rate=0.5 differs from the checkpointed run's 0.003"):
        check_resumable(
            killed.run_dir, {**json.loads((killed.run_dir / "config.json").read_text()), "learning-rate": 0.5}
        )

    # Relative to the resumed run's output-dir: the server resolves it, never the Ray actors (their cwd is another).
    relative = os.path.relpath(killed.run_dir, tmp_path / "resumed" / "out")
    resumed = succeeded(
        simulate(tmp_path / "resumed", tiny_model_dir, resume_from=relative, save_final_model=True, **same)
    )
    assert "Resumed from" in resumed.stdout and "after round 2 (3 pending client updates" in resumed.stdout
    records = resumed.records
    assert [r["round"] for r in records] == list(range(ROUNDS + 1))
    # Round 3 ran from each client's own x^1 + Δ_i^2 (handed back), no client resynchronised.
    assert records[3]["num_resynchronised"] == 0 and records[3]["invariant_failed"] == 0
    assert records[3]["invariant_checked"] == 3
    uninterrupted = uninterrupted_run.final_model()
    final = resumed.final_model()
    assert final.keys() == uninterrupted.keys()
    assert all(torch.equal(final[n], uninterrupted[n]) for n in final)
    for version in (3, 4):
        assert all(
            torch.equal(a, b)
            for a, b in zip(resumed.step(version)[1].values(), uninterrupted_run.step(version)[1].values())
        )


def test_int8_transfer_quarters_the_bytes_and_keeps_the_invariant_exact(parablock_int8_run, parablock_run):
    """transfer-dtype=int8: Δ_i and g travel as int8 with one fp32 scale per 256 values (a quarter of the
    bytes, plus 1/256 for the scales), each client keeps exactly the dequantised update it sent, so its
    local model is still x^{r-1} + Δ_i^r to the bit; the server's steps are int8-representable (it applies
    what it sends); the loss still falls."""
    run = succeeded(parablock_int8_run)
    fp32 = {r["round"]: r for r in succeeded(parablock_run).records}
    for rec in run.records[1:]:
        assert rec["num_accepted"] == 3 and rec["invariant_checked"] == 3 and rec["invariant_failed"] == 0, rec
        # The same block's values, a quarter of the bytes; the scales add 1/256, each record's layout a little.
        ratio = rec["wire_bytes_up"] / fp32[rec["round"]]["wire_bytes_up"]
        assert 0.25 + 1 / 256 <= ratio < 0.27, (rec["round"], ratio)
        # The record's bytes and the time model count what int8 sends, not the decoded fp32 values.
        modeled = rec["bytes_up_per_client"] / fp32[rec["round"]]["bytes_up_per_client"]
        assert 0.25 + 1 / 256 <= modeled < 0.26, (rec["round"], modeled)  # short last blocks add scales
        step = run.step(rec["round"])[1]
        rounded = core.round_for_transfer(step, "int8")
        assert all(torch.equal(t, rounded[n]) for n, t in step.items())
    assert run.records[-1]["heldout_loss"] < run.records[0]["heldout_loss"]


def test_a_bounded_step_log_resumes_from_its_snapshot_bit_for_bit(tmp_path, tiny_model_dir, parablock_run):
    """`snapshot-every = 2`: the server is killed in round 4 of 4 (in its step-log write); the steps
    the log would drop at its next snapshot (v1, v2: up to the older snapshot) are removed, so the
    resumed run can only rebuild x^3 from snapshot v2 plus step 3, and its fresh nodes start from that
    snapshot too. It ends with the uninterrupted run's model (`parablock_run`, every step kept), bit
    for bit. Without Ray, as the test above."""
    same = dict(algorithm="parablock", num_server_rounds=ROUNDS, verify_invariant=True, snapshot_every=2, **SCHEDULE)
    killed = simulate_in_process(tmp_path / "killed", tiny_model_dir, crash_at="step-log@4", **same)
    assert killed.returncode == -9 and killed.run_dir is not None, killed.stdout[-3000:]
    log = StepLog(killed.run_dir)
    assert 2 in log.snapshots()
    for version in (1, 2):
        (log.dir / f"v{version:05d}.safetensors").unlink(missing_ok=True)
    resumed = succeeded(
        simulate_in_process(
            tmp_path / "resumed", tiny_model_dir, resume_from=str(killed.run_dir), save_final_model=True, **same
        )
    )
    assert "after round 3" in resumed.stdout
    assert all(r["invariant_failed"] == 0 for r in resumed.records[1:])
    final, uninterrupted = resumed.final_model(), parablock_run.final_model()
    assert final.keys() == uninterrupted.keys() and all(torch.equal(final[n], uninterrupted[n]) for n in final)
    new_log = StepLog(resumed.run_dir)
    assert new_log.snapshots() == [2, 4] and new_log.steps() == [3, 4]


def test_only_aggregation_lies_between_a_rounds_last_reply_and_the_next_messages(parablock_run):
    """The server pushes round r+1's messages as soon as g^r exists; round r is evaluated beside the
    loop (``ServerEvaluator``), on a replica of its own; replies are checked as they arrive (the first
    one before the last has come)."""
    records = succeeded(parablock_run).records
    for rec in records[1:-1]:
        assert rec["evaluation_waited_s"] >= 0, rec["round"]
        assert rec["heldout_loss"] is not None and rec["evaluate_s"] > 0
        times = rec["server_times"]
        assert times["pushed"] <= times["first_reply_checked"] <= times["last_reply"] <= times["aggregated"]
    # Between the last reply and the next messages: aggregation and the next messages. The step log is
    # written after them (what round r's checkpoint counts on), each round's write recorded.
    assert max(rec["server_critical_path_s"] for rec in records[1:-1]) < 5.0
    assert all(rec["step_log_write_s"] > 0 for rec in records[1:])
    # The server's own legs (``SERVER_LEGS``): after the last reply, the mean, the step's rounding and x's new
    # values (in one pass: a few replies, the default mean) fit between it and the aggregate (the checks ran as
    # the replies came, the first ones before it).
    for rec in records[1:]:
        legs = {leg: rec.get(f"server_{leg}", 0.0) for leg in SERVER_LEGS}
        assert legs["check_s"] > 0 and legs["one_pass_s"] > 0 and legs["combine_s"] == legs["x_apply_s"] == 0, legs
        after = sum(seconds for leg, seconds in legs.items() if leg != "check_s")
        assert after <= rec["server_times"]["aggregated"] - rec["server_times"]["last_reply"], (legs, rec["round"])


# Each rounding transfer dtype once, FedBCD's resume in one of them (fp32 keeps no residuals: its resumes are the
# kill at every stage above, by a run folder's path, and the deployment's).
RESUMED_BY_NAME = [("parablock", "int8"), ("parablock", "fp16"), ("fedbcd", "bf16")]


@pytest.fixture(scope="module")
def resumed_by_name(tmp_path_factory, tiny_model_dir) -> dict:
    """Each case of ``RESUMED_BY_NAME`` killed in round 4's checkpoint, then resumed from its run folder's name:
    {case: (killed, resumed)}, the cases side by side (``side_by_side``). Node 1's reply of round 3 is rejected."""
    folders = {case: tmp_path_factory.mktemp("-".join(case)) for case in RESUMED_BY_NAME}

    def run(case, **more):
        same = dict(algorithm=case[0], num_server_rounds=ROUNDS, transfer_dtype=case[1], reject="1@3", **SCHEDULE)
        return lambda: simulate_in_process(folders[case], tiny_model_dir, **same, **more)

    killed = side_by_side({case: run(case, crash_at="checkpoint@4") for case in RESUMED_BY_NAME})
    left = [case for case in RESUMED_BY_NAME if killed[case].run_dir is not None]  # (each test says why not)
    resumed = side_by_side({case: run(case, resume_from=killed[case].run_dir.name) for case in left})
    return {case: (killed[case], resumed.get(case)) for case in RESUMED_BY_NAME}


@pytest.mark.parametrize(("algorithm", "transfer_dtype"), RESUMED_BY_NAME)
def test_a_resume_from_a_run_folders_name_goes_on_with_each_nodes_residuals_in_every_transfer_dtype(
    resumed_by_name, algorithm, transfer_dtype
):
    """`resume-from` as docs/usage.md shows it, the run folder's name inside `output-dir`: the server
    resolves it once and tells the nodes where their residuals are, so a node whose working
    directory is elsewhere (a Ray actor's; here the test's) does not start its error feedback from
    zero. Node 1's reply of round 3 is rejected, the last round before the stop. The server dies in
    round 4's checkpoint, after g^4, round 4's record and the nodes' round-4 residuals are on disk; the
    resumed run computes round 4 again from round 3's checkpoint, syncing each node as the killed run
    did (node 1 synced afresh, dropping its own state and residuals as it did), and its g^4 and each
    node's round-4 residuals equal the killed run's bit for bit. ParaBlock hands each accepted node its
    pending update back; FedBCD keeps none, and its nodes take x's values with their residuals. Without Ray
    (``simulate_in_process``)."""
    killed, resumed = resumed_by_name[algorithm, transfer_dtype]
    assert killed.returncode == -9 and killed.run_dir is not None, killed.stdout[-3000:] + killed.stderr[-3000:]
    # By round, not by position: killed at once, the run may not have written round 0's evaluation yet.
    killed_rounds = {record["round"]: record for record in killed.records}
    assert killed_rounds[3]["num_accepted"] == 2 and killed_rounds[4]["full_syncs_sent"] == 1
    succeeded(resumed)
    assert [r["round"] for r in resumed.records] == list(range(ROUNDS + 1))  # each round recorded once
    pending = 2 if algorithm == "parablock" else 0  # round 3's accepted nodes' updates (node 1's was rejected)
    assert resumed.run_dir != killed.run_dir and f"after round 3 ({pending} pending client updates" in resumed.stdout
    # ParaBlock's hand-backs each come with x^2, and node 1's sync; FedBCD's nodes catch up as they would have.
    assert resumed.records[4]["full_syncs_sent"] == (3 if algorithm == "parablock" else 1)
    assert resumed.records[4]["num_accepted"] == 3
    if algorithm == "parablock":  # (FedBCD's nodes always train from x^{r-1}: none counts as resynchronised)
        assert resumed.records[4]["num_resynchronised"] == 1
    (block, step), (killed_block, killed_step) = resumed.step(4), killed.step(4)
    assert block == killed_block and step.keys() == killed_step.keys() and step
    assert all(torch.equal(step[n], killed_step[n]) for n in step)
    for partition in range(3):
        old, new = (ResidualStore(run.run_dir / "node-state" / f"partition-{partition}").as_of(4)
                    for run in (killed, resumed))  # fmt: skip
        assert old and old.keys() == new.keys(), (partition, sorted(old), sorted(new))
        for block in old:
            assert all(torch.equal(old[block][n], new[block][n]) for n in old[block]), (partition, block)
