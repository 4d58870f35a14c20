"""Differential privacy (docs/privacy.md): clipping, noise, the accountant, the ledger and their settings.

The app held to the reference under DP is in tests/test_reference.py; a DP run's invariant, resume and budget
stop end to end in tests/test_privacy_runs.py."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from dp_accounting import dp_event, pld, rdp

from parablock_flwr import core, privacy
from parablock_flwr.config import ConfigError, RunConfig
from parablock_flwr.node.compute import private_update

DP = dict(dp_clip_norm=1.0, dp_noise_multiplier=0.8, weighting="uniform")


def block(seed: int, scale: float = 1.0, shapes=((64, 32), (32,))) -> core.Tensors:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": scale * torch.randn(s, generator=g) for i, s in enumerate(shapes)}


def reply(partition_id: int, clipped: int) -> SimpleNamespace:
    """What the server's privacy reads of an accepted reply: its site and whether its node clipped."""
    return SimpleNamespace(partition_id=partition_id, metrics=SimpleNamespace(dp_clipped=clipped))


# ------------------------------------------------------------------ the accountant
@pytest.mark.slow
@pytest.mark.parametrize("sigma, rounds, delta", [(0.8, 1, 1e-5), (1.1, 50, 1e-5), (4.0, 500, 1e-6)])
def test_the_accountant_is_dp_accountings_rdp_and_lies_between_the_tight_and_the_classic_bound(sigma, rounds, delta):
    ours = privacy.epsilon(sigma, rounds, delta)
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_event.GaussianDpEvent(sigma), rounds)
    assert ours == accountant.get_epsilon(delta)
    # Privacy loss distributions are tighter than RDP; RDP's classic conversion, min over orders a of
    # rounds a / (2 sigma^2) + log(1/delta) / (a - 1), is looser than dp-accounting's.
    tight = pld.PLDAccountant(value_discretization_interval=1e-4)
    tight.compose(dp_event.GaussianDpEvent(sigma), rounds)
    orders = [1 + x / 10 for x in range(1, 2000)]
    classic = min(rounds * a / (2 * sigma**2) + math.log(1 / delta) / (a - 1) for a in orders)
    assert tight.get_epsilon(delta) * 0.999 <= ours <= classic


def test_the_accountant_subsamples_as_dp_accounting_does_and_counts_nothing_for_no_round():
    accountant = rdp.RdpAccountant()
    accountant.compose(dp_event.PoissonSampledDpEvent(0.1, dp_event.GaussianDpEvent(1.0)), 100)
    assert privacy.epsilon(1.0, 100, 1e-5, sampling_rate=0.1) == accountant.get_epsilon(1e-5)
    assert privacy.epsilon(1.0, 100, 1e-5, sampling_rate=0.1) < privacy.epsilon(1.0, 100, 1e-5)
    assert privacy.epsilon(1.0, 0, 1e-5) == 0.0 and privacy.epsilon(0.0, 3, 1e-5) == math.inf


def test_the_ledger_charges_the_site_released_most_and_survives_a_checkpoint():
    ledger = privacy.PrivacyLedger(1.0, 1e-5)
    ledger.released([0, 1])
    ledger.released([1, 1, 2])  # a site counts once per round
    assert ledger.releases == {0: 1, 1: 2, 2: 1} and ledger.rounds == 2
    assert ledger.epsilon() == privacy.epsilon(1.0, 2, 1e-5) < ledger.epsilon(more_rounds=1)
    again = privacy.PrivacyLedger(1.0, 1e-5)
    again.load(ledger.state())
    assert again.releases == ledger.releases


def test_the_server_stops_before_the_round_that_would_pass_the_target():
    target = (privacy.epsilon(1.0, 2, 1e-5) + privacy.epsilon(1.0, 3, 1e-5)) / 2
    server = privacy.ServerPrivacy(RunConfig(**DP | dict(dp_noise_multiplier=1.0, dp_target_epsilon=target)))
    for r in (1, 2):
        assert server.stop_reason(r) is None
        server.released([reply(0, 0), reply(1, 0)])
    why = server.stop_reason(3)
    assert why.startswith(f"dp-target-epsilon={target:g} reached: round 3 would bring epsilon from ")


# ------------------------------------------------------------------ clipping and noise
def test_an_update_above_the_clip_norm_is_scaled_onto_it_and_one_inside_is_left_as_it_is():
    big = block(0, scale=3.0)
    clipped, was = core.clip(big, 2.0)
    assert was and core.l2_norm(clipped) == pytest.approx(2.0, rel=1e-6)
    assert all(torch.allclose(clipped[n], big[n] * (2.0 / core.l2_norm(big))) for n in big)
    small = block(1, scale=1e-3)
    same, was = core.clip(small, 2.0)
    assert not was and all(same[n] is small[n] for n in small)
    infinite = {"w": torch.tensor([math.inf, 1.0])}
    assert core.clip(infinite, 1.0) == (infinite, False)  # the reply's checks refuse it


def test_the_norm_does_not_depend_on_the_order_a_copy_holds_the_tensors_in():
    update = block(2, shapes=[(37, 11)] * 5 + [(1000,)])
    backwards = dict(reversed(list(update.items())))
    assert core.l2_norm(update) == core.l2_norm(backwards)


def test_the_central_noise_has_std_sigma_c_over_n_and_the_same_bits_for_the_same_seed():
    cfg = RunConfig(**DP | dict(dp_noise_seed=11))
    server = privacy.ServerPrivacy(cfg)
    zeros = {"w": torch.zeros(400_000)}
    noised = server.noised(3, {"w": zeros["w"].clone()}, num_updates=4)
    expected = cfg.dp_noise_multiplier * cfg.dp_clip_norm / 4
    assert float(noised["w"].std()) == pytest.approx(expected, rel=0.01)
    assert abs(float(noised["w"].mean())) < 5 * expected / math.sqrt(400_000)
    again = server.noised(3, {"w": zeros["w"].clone()}, num_updates=4)
    other_round = server.noised(4, {"w": zeros["w"].clone()}, num_updates=4)
    assert torch.equal(noised["w"], again["w"]) and not torch.equal(noised["w"], other_round["w"])


def test_the_noise_drawn_ahead_is_the_noise_drawn_at_aggregation_and_is_let_go_once_released():
    """The server draws round r's noise on a thread once the round's messages are built: the same bits as drawn
    between the last reply and the next message (one seeded generator), for the round and block it was drawn
    for; a block of other shapes gets its own, drawn then; the round's release lets it go."""
    server = privacy.ServerPrivacy(RunConfig(**DP | dict(dp_noise_seed=11)))
    x = block(8, shapes=((700, 300), (300,)))
    server.draw_noise_ahead(5, x)
    drawn = server.noise(5, x)
    now = core.gaussian(x, core.noise_seed(11, 5))
    assert list(drawn) == sorted(x) and all(torch.equal(drawn[n], now[n]) for n in x)
    assert server.noise(5, x)["w0"] is drawn["w0"]  # a retried aggregation of the round takes it again
    other = block(9, shapes=((20,),))
    assert torch.equal(server.noise(5, other)["w0"], core.gaussian(other, core.noise_seed(11, 5))["w0"])
    server.released([reply(0, 0)])
    assert server.noise(5, x)["w0"] is not drawn["w0"]
    local = privacy.ServerPrivacy(RunConfig(**DP | dict(dp_mode="local")))
    local.draw_noise_ahead(5, x)  # local mode: the server adds no noise, so draws none
    assert not local.adds_noise and local.clip_scale(x) is None  # local mode: no update scaled on the server


def test_a_noise_draw_that_failed_ahead_is_drawn_again_when_the_round_needs_it(monkeypatch):
    """A fault that cannot be made real here (the server out of memory while it draws ahead): the round's
    aggregation draws the noise itself, the same bits."""
    real, seeds = core.gaussian, []

    def failing_once(like, seed):
        seeds.append(seed)
        if len(seeds) == 1:
            raise MemoryError("the draw ahead found no memory")
        return real(like, seed)

    monkeypatch.setattr(core, "gaussian", failing_once)
    server, x = privacy.ServerPrivacy(RunConfig(**DP | dict(dp_noise_seed=11))), block(8)
    server.draw_noise_ahead(5, x)
    noise = server.noise(5, x)
    assert len(seeds) == 2 and torch.equal(noise["w0"], real(x, core.noise_seed(11, 5))["w0"])


def test_the_server_clips_again_in_central_mode_and_counts_what_it_or_the_nodes_clipped():
    server = privacy.ServerPrivacy(RunConfig(**DP))
    updates = [block(3, scale=0.001), block(4, scale=5.0)]
    out = list(server.clip_updates(iter(updates)))
    assert out[0]["w0"] is updates[0]["w0"] and core.l2_norm(out[1]) == pytest.approx(1.0, rel=1e-6)
    record = server.released([reply(0, 1), reply(1, 0)])  # node 0 clipped, the server scaled node 1's
    assert record["dp_clipped"] == 2 and record["dp_epsilon"] == privacy.epsilon(0.8, 1, 1e-5)
    # The one pass's factors, found as each reply was checked, counted as clip_updates counts what it scaled
    scales = [server.clip_scale(u) for u in updates]
    assert scales == [None, core.clip_scale(updates[1], 1.0)] and scales[1] == pytest.approx(1.0 / core.l2_norm(
        updates[1]))  # fmt: skip
    assert server.clip_scales([SimpleNamespace(clip_scale=s, clip_scale_found=True) for s in scales]) == scales
    # A reply whose factor was not found as it was checked: no factors, so the server clips it in its steps apart
    assert server.clip_scales([SimpleNamespace(clip_scale=None, clip_scale_found=False)]) is None
    assert server.released([reply(0, 0), reply(1, 0)])["dp_clipped"] == 1


def test_local_mode_noises_on_the_node_with_std_sigma_c_and_the_server_adds_none():
    cfg = RunConfig(**DP | dict(dp_mode="local", dp_noise_seed=5))
    update = block(6, scale=10.0, shapes=[(300_000,)])
    sent, clipped = private_update(cfg, {n: t.clone() for n, t in update.items()}, 2, 1)
    assert clipped is None  # local mode says nothing of its clipping
    scaled = core.clip(update, 1.0)[0]
    noise = sent["w0"] - scaled["w0"]
    assert float(noise.std()) == pytest.approx(0.8, rel=0.01)
    server = privacy.ServerPrivacy(cfg)
    mean = {"w": torch.zeros(10)}
    assert torch.equal(server.noised(2, mean, 3)["w"], torch.zeros(10))
    assert list(server.clip_updates(iter([sent])))[0] is sent  # noised: clipping it would cut the noise


def test_central_mode_clips_on_the_node_and_says_so():
    cfg = RunConfig(**DP)
    update = block(7, scale=10.0)
    sent, clipped = private_update(cfg, update, 1, 0)
    assert clipped == 1 and core.l2_norm(sent) == pytest.approx(1.0, rel=1e-6)
    assert private_update(RunConfig(), update, 1, 0) == (update, None)  # DP off: untouched


def test_a_secret_seed_is_drawn_per_run_and_comes_back_from_the_checkpoint():
    cfg = RunConfig(**DP)
    first, second = privacy.ServerPrivacy(cfg), privacy.ServerPrivacy(cfg)
    assert first.secret != second.secret
    second.load(first.state())
    assert second.secret == first.secret
    known = privacy.ServerPrivacy(RunConfig(**DP | dict(dp_noise_seed=3)))
    known.load(first.state())
    assert known.secret == 3  # a known seed is the run config's


# ------------------------------------------------------------------ settings
@pytest.mark.parametrize(
    "overrides, expected",
    [
        (dict(dp_clip_norm=-1.0), "dp-clip-norm=-1.0: expected a finite number >= 0"),
        (dict(dp_noise_multiplier=float("nan")), "dp-noise-multiplier=nan: expected a finite number >= 0"),
        (dict(dp_clip_norm=0.0), "dp-noise-multiplier=0.8: expected dp-clip-norm > 0 too"),
        (dict(dp_mode="secure"), "dp-mode='secure': expected one of central, local"),
        (dict(dp_delta=1.0), "dp-delta=1.0: expected a number in (0, 1)"),
        (dict(dp_noise_seed=-2), "dp-noise-seed=-2: expected an integer >= -1"),
        (dict(dp_noise_multiplier=0.0, dp_target_epsilon=8.0), "dp-target-epsilon=8.0: expected dp-noise-multiplier"),
        (dict(weighting="examples"), "weighting='examples' with dp-clip-norm=1.0: expected weighting='uniform'"),
    ],
)
def test_a_bad_dp_value_gets_one_line_naming_it(overrides, expected):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_flower({k.replace("_", "-"): v for k, v in (DP | overrides).items()})
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)


def test_dp_is_off_by_default():
    assert not RunConfig().dp


def test_plan_says_the_epsilon_a_run_ends_at_and_where_the_target_stops_it():
    from parablock_flwr.plan import privacy_lines

    assert privacy_lines(RunConfig()) == []
    cfg = RunConfig(**DP | dict(num_server_rounds=40, dp_target_epsilon=privacy.epsilon(0.8, 10, 1e-5) + 1e-9))
    (line,) = privacy_lines(cfg)
    assert line.startswith(f"differential privacy (central): epsilon {privacy.epsilon(0.8, 40, 1e-5):.3f} at delta")
    assert line.endswith("stops it after round 10")
