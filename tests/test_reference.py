"""The app held to the reference (parablock_flwr/reference.py): the same global model after every round.

One run per algorithm (ParaBlock ``at-end``, sequential BCD, ParaBlock without the correction;
without Ray, ``simulate_in_process``: the app's ServerApp and ClientApp over Flower's in-memory
federation, the code the simulation runs) with partial participation, non-IID data, a run-wide
learning-rate schedule and a schedule that repeats blocks, then the reference on the same tiny
model, data and seeds.

The app's server samples its clients over their partition ids (Flower's node ids are random in
every run), so a seed picks the same clients in the app and in the reference: the test checks
that the partitions the app aggregated (its records' ``client_weights``) are the reference's
seeded draw, and the reference then trains exactly those.
"""

from __future__ import annotations

import json

import pytest
import torch

from parablock_flwr import reference
from parablock_flwr.config import RunConfig

from helpers import side_by_side, simulate_in_process

ROUNDS = 5
SETTINGS = dict(
    num_supernodes=4,
    fraction_train=0.5,
    num_server_rounds=ROUNDS,
    dataset="reasoning-gym:instruction-mix",  # six task families: Dirichlet over them is non-IID
    partitioning="dirichlet",
    dirichlet_alpha=0.3,
    num_examples=96,
    heldout_examples=8,
    non_layer_params="block",  # 3 blocks: layers 0-1, 2-3, the rest
    schedule="uniform-random",  # with this seed: b_r == b_{r-1} happens
    lr_schedule="linear",
    lr_schedule_scope="run",
    warmup_steps=2,
    generate_examples=0,
    seed=2,  # the seeded draw makes both returning (resynchronised) and stale clients
)
DP = dict(weighting="uniform", dp_clip_norm=0.05)  # a clip norm that binds; DP needs uniform weights
ALGORITHMS = {
    "parablock": dict(algorithm="parablock", correction="at-end"),
    "fedbcd": dict(algorithm="fedbcd"),
    "none": dict(algorithm="parablock", correction="none"),
    # Differential privacy (docs/privacy.md), with clip norms that bind and known noise seeds: central noise on
    # ParaBlock's mean (the correction replays the noisy step), local noise on each BCD client's update.
    "parablock-dp": dict(algorithm="parablock", correction="at-end", dp_noise_multiplier=0.3, dp_noise_seed=7, **DP),
    "fedbcd-dp-local": dict(algorithm="fedbcd", dp_mode="local", dp_noise_multiplier=0.05, dp_noise_seed=9, **DP),
}
# correction = "none": the app keeps a client's own model as an offset on a recent global version
# and rewrites it by subtracting the global steps it skipped (docs/algorithm.md); the reference keeps
# the model itself. Same math, other float sums: the two differ by rounding (fp32, about 1e-7 of a
# weight per operation), which training then carries on; 1e-4 is far above that over five rounds and
# far below what training moves (the test checks both sides).
UNCORRECTED_ATOL = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    """The three app runs, side by side (separate Flower homes and ports), then the reference of each
    on the partitions the app trained: {label: (app run, config, partitions by round, reference rounds,
    the app's x^1..x^R)}."""

    def one(label):
        return lambda: simulate_in_process(tmp_path_factory.mktemp(label), tiny_model_dir, **SETTINGS,
                                           **ALGORITHMS[label])  # fmt: skip

    apps = side_by_side({label: one(label) for label in ALGORITHMS})
    out, threads, deterministic = {}, torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    for label, app in apps.items():
        assert app.returncode == 0, (app.stdout[-2000:], app.stderr[-2000:])
        cfg = RunConfig.from_flower(json.loads((app.run_dir / "config.json").read_text()))
        trained = reference.app_participants(app.records)
        rounds = reference.run(cfg, SETTINGS["num_supernodes"], participants=trained.get)
        out[label] = (app, cfg, trained, rounds, reference.app_models(app.run_dir, cfg))
    torch.set_num_threads(threads)  # the reference set the run's torch-threads and deterministic mode
    torch.use_deterministic_algorithms(deterministic)
    return out


@pytest.mark.e2e  # starts Flower processes
@pytest.mark.parametrize("label", ["parablock", "fedbcd", "parablock-dp", "fedbcd-dp-local"])
def test_the_app_equals_the_reference_bit_for_bit(runs, label):
    app, _, _, rounds, models = runs[label]
    for r, (theirs, ours) in enumerate(zip(models, rounds), start=1):
        assert app.records[r]["block"] == ours.block, f"round {r}"
        different = [n for n in theirs if not torch.equal(theirs[n], ours.x[n])]
        assert not different, f"{label}, round {r}: x^{r} differs in {different[:3]}"


@pytest.mark.e2e  # starts Flower processes
def test_without_the_correction_the_app_equals_the_reference_up_to_rounding(runs):
    _, _, _, rounds, models = runs["none"]
    for r, (theirs, ours) in enumerate(zip(models, rounds), start=1):
        worst = reference.largest_difference(theirs, ours.x)
        assert worst <= UNCORRECTED_ATOL, f"round {r}: x^{r} differs by {worst:.2e}"
    assert reference.largest_difference(rounds[-1].x, rounds[0].x) > 100 * UNCORRECTED_ATOL  # training moved x


@pytest.mark.e2e  # starts Flower processes
def test_the_runs_cover_stale_and_returning_clients_and_repeated_blocks(runs):
    """The equality means something: ParaBlock's clients started from their own previous update and
    from x^{r-1} after sitting a round out; some block was trained two rounds in a row."""
    rounds = runs["parablock"][3]
    stale = sum(r.stale_start for r in rounds)
    returning = sum(len(r.participants) - r.stale_start for r in rounds[1:])
    assert stale > 0 and returning > 0
    assert any(a.block == b.block for a, b in zip(rounds, rounds[1:]))


@pytest.mark.e2e  # starts Flower processes
def test_the_dp_runs_clipped_noised_and_accounted(runs):
    """The DP runs' equality means something: central mode clipped updates (the nodes said so) and charged
    every sampled site; the noise moved x away from the run without it (the same draw, ``parablock``). Each round
    ran in the server's one pass, its clipping and noise in it (``server_privacy_s``), no step apart."""
    app, cfg = runs["parablock-dp"][:2]
    trained = [r for r in app.records if r.get("dp_epsilon") is not None]
    assert len(trained) == ROUNDS and sum(r["dp_clipped"] for r in trained) > 0
    for r in [*trained, *runs["fedbcd-dp-local"][0].records[1:]]:
        assert r["server_one_pass_s"] > 0 and r["server_privacy_s"] > 0 and "server_combine_s" not in r, r
    assert [r["dp_releases"] for r in trained] == sorted(r["dp_releases"] for r in trained)
    assert "differential privacy: epsilon" in app.stdout
    local = [r for r in runs["fedbcd-dp-local"][0].records if r.get("dp_epsilon") is not None]
    assert len(local) == ROUNDS and not any("dp_clipped" in r for r in local)
    plain, noisy = runs["parablock"][4][-1], runs["parablock-dp"][4][-1]
    assert reference.largest_difference(plain, noisy) > 1e-3


@pytest.mark.e2e  # starts Flower processes
def test_the_app_samples_the_reference_s_draw_over_partition_ids(runs):
    """Each run's clients are the reference's seeded draw over partition ids, whatever node ids
    Flower gave them (before: the same positions over random node ids, other clients each run)."""
    n = SETTINGS["num_supernodes"]
    for label, (_, cfg, trained, _, _) in runs.items():
        assert trained == {r: reference.sample(cfg, n, r) for r in trained}, label


@pytest.mark.e2e  # starts Flower processes
def test_both_algorithms_train_the_same_steps_and_examples_per_client(runs):
    """Counted on the reference: every sampled client takes K steps over K x B examples, and its batches
    are the same for BCD and ParaBlock when both train it in the same round."""
    for label in ALGORITHMS:
        cfg, rounds = runs[label][1], runs[label][3]
        for r in rounds:
            assert set(r.steps.values()) == {cfg.local_steps}
            assert set(r.examples.values()) == {cfg.local_steps * cfg.batch_size}
    bcd, parablock = runs["fedbcd"][3], runs["parablock"][3]
    shared = [(a.batches[i], b.batches[i]) for a, b in zip(bcd, parablock) for i in set(a.batches) & set(b.batches)]
    assert shared and all(x == y for x, y in shared)
