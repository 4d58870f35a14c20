"""Differential privacy end to end (docs/privacy.md), without Ray (``simulate_in_process``: the app's
ServerApp and ClientApp over Flower's in-memory federation): ParaBlock's invariant under DP in int8, a resume
that draws the same secret noise and goes on with the accountant, and the budget's documented stop."""

from __future__ import annotations

import pytest
import torch

from parablock_flwr import privacy, report
from parablock_flwr.run_status import EXIT_CODES

from helpers import side_by_side, simulate_in_process

DP = dict(weighting="uniform", dp_clip_norm=0.05, dp_noise_multiplier=0.3)
RESUMED = dict(algorithm="parablock", num_server_rounds=4, transfer_dtype="int8", verify_invariant=True, **DP)
# Between the epsilon of 2 and 3 rounds at noise multiplier 1.
TARGET = (privacy.epsilon(1.0, 2, 1e-5) + privacy.epsilon(1.0, 3, 1e-5)) / 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir) -> dict:
    """Both tests' runs side by side (``side_by_side``): the DP run killed in round 4's checkpoint and the one that
    stops at its budget; then the killed one resumed from its run folder's name."""
    killed_in, budget_in = tmp_path_factory.mktemp("dp-killed"), tmp_path_factory.mktemp("dp-budget")
    out = side_by_side({
        "killed": lambda: simulate_in_process(killed_in, tiny_model_dir, crash_at="checkpoint@4", **RESUMED),
        "budget": lambda: simulate_in_process(budget_in, tiny_model_dir, algorithm="fedbcd", num_server_rounds=3,
                                              **DP | dict(dp_noise_multiplier=1.0, dp_target_epsilon=TARGET)),
    })  # fmt: skip
    if out["killed"].run_dir is not None:
        resume_from = out["killed"].run_dir.name
        out["resumed"] = simulate_in_process(killed_in, tiny_model_dir, resume_from=resume_from, **RESUMED)
    return out


@pytest.mark.e2e  # starts Flower processes
def test_a_dp_run_keeps_the_invariant_in_int8_and_a_resume_draws_the_same_secret_noise(runs):
    """ParaBlock, int8 with error feedback, central DP with the server's secret seed (``dp-noise-seed = -1``),
    ``verify-invariant``: every node's model is ``x^{r-1} + Δ_i^r`` to the bit in every round, the noisy step
    included. The server dies in round 4's checkpoint; the resumed run reads the secret from round 3's and
    computes g^4 again: the same bits as the killed run's, and the same epsilon."""
    killed = runs["killed"]
    assert killed.returncode == -9 and killed.run_dir is not None, killed.stdout[-3000:] + killed.stderr[-3000:]
    trained = [r for r in killed.records if r.get("dp_epsilon") is not None]
    assert [r["round"] for r in trained] == [1, 2, 3, 4]
    assert all(r["invariant_failed"] == 0 and r["num_rejected"] == 0 for r in trained)
    assert sum(r["dp_clipped"] for r in trained) > 0
    assert [r["dp_epsilon"] for r in trained] == [privacy.epsilon(0.3, k, 1e-5) for k in (1, 2, 3, 4)]
    resumed = runs["resumed"]
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert resumed.run_dir != killed.run_dir and "after round 3" in resumed.stdout
    assert all(torch.equal(a, b) for a, b in zip(resumed.step(4)[1].values(), killed.step(4)[1].values()))
    last = resumed.records[-1] if "dp_epsilon" in resumed.records[-1] else resumed.records[4]
    assert last["dp_epsilon"] == trained[-1]["dp_epsilon"] and last["invariant_failed"] == 0
    assert f"differential privacy: epsilon {trained[-1]['dp_epsilon']:.3f} at delta 1e-05" in resumed.stdout
    header, *_, last_row = report.table(resumed.records).splitlines()
    assert header.endswith("epsilon") and last_row.endswith(f"{trained[-1]['dp_epsilon']:.2f}")


@pytest.mark.e2e  # starts Flower processes
def test_the_run_stops_before_the_round_that_would_pass_dp_target_epsilon(runs):
    """``dp-target-epsilon`` between the epsilon of 2 and 3 rounds: rounds 1 and 2 run and are checkpointed,
    round 3 is not started, and the run ends as a documented stop (exit code 6), not as a plain success."""
    target, run = TARGET, runs["budget"]
    assert run.returncode == EXIT_CODES["privacy-budget"] == 6, run.stdout[-3000:] + run.stderr[-3000:]
    assert (run.status["status"], run.status["kind"], run.status["rounds_completed"]) == (
        "stopped",
        "privacy-budget",
        2,
    )
    assert run.status["reason"].startswith(f"2 of 3 rounds: dp-target-epsilon={target:g} reached: round 3")
    assert max(r["round"] for r in run.records if "train_loss" in r) == 2
    assert (run.run_dir / "checkpoint" / "round-00002").exists()
    assert "Run stopped at its privacy budget (exit code 6)" in run.stdout
