"""The privacy accountant (docs/privacy.md): the ε a run's released updates have spent at ``dp-delta``.

``dp-accounting`` (Google's DP accounting library, the one behind TensorFlow Privacy) does the accounting: its
Rényi-DP accountant of the (subsampled) Gaussian mechanism, composed over rounds. It is chosen over Opacus's
copy of the same accountant because it depends on no torch build and is kept as a library of its own.

Each round releases one Gaussian mechanism of sensitivity ``dp-clip-norm`` per site whose update it used. The
server's sample is seeded by the run's seed, which every site knows: it is not secret, so no amplification by
sampling is claimed. A site's ε composes the rounds that released its update; the run's is that of the site
released most (``PrivacyLedger``).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from . import core


def epsilon(noise_multiplier: float, rounds: int, delta: float, sampling_rate: float = 1.0) -> float:
    """ε at ``delta`` after ``rounds`` Gaussian mechanisms of noise multiplier σ (each on a Poisson sample of
    rate ``sampling_rate``); 0 for no round, infinite without noise."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    from dp_accounting import dp_event, rdp  # scipy and more: only where DP is on

    event = dp_event.GaussianDpEvent(noise_multiplier)
    if sampling_rate < 1.0:
        event = dp_event.PoissonSampledDpEvent(sampling_rate, event)
    accountant = rdp.RdpAccountant()
    accountant.compose(event, rounds)
    return float(accountant.get_epsilon(delta))


@dataclass
class PrivacyLedger:
    """How many rounds released each site's update (by partition id), and the ε that comes to."""

    noise_multiplier: float
    delta: float
    releases: dict[int, int] = field(default_factory=dict)  # partition -> rounds that released its update

    def released(self, partitions) -> None:
        """One round released the updates of these sites."""
        for p in set(partitions):
            self.releases[p] = self.releases.get(p, 0) + 1

    @property
    def rounds(self) -> int:
        """The most rounds any site's update was released in."""
        return max(self.releases.values(), default=0)

    def epsilon(self, more_rounds: int = 0) -> float:
        """ε of the site released most, after ``more_rounds`` further releases of it."""
        return epsilon(self.noise_multiplier, self.rounds + more_rounds, self.delta)

    def state(self) -> dict:
        return {"releases": {str(p): n for p, n in sorted(self.releases.items())}}

    def load(self, state: dict) -> None:
        self.releases = {int(p): int(n) for p, n in state.get("releases", {}).items()}


class ServerPrivacy:
    """The server's part of differential privacy (``dp-clip-norm`` > 0): each accepted update clipped again
    (central mode: a node that did not clip is bounded all the same), the mean's noise (central), and the
    ledger. The noise comes from a secret seed the server draws, kept in the checkpoint (a resumed run draws
    the same noise), never in the run config, which every site reads; ``dp-noise-seed`` >= 0 replaces it
    (tests and research only)."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.central = cfg.dp_mode == "central"
        self.secret = cfg.dp_noise_seed if cfg.dp_noise_seed >= 0 else secrets.randbits(63)
        self.ledger = PrivacyLedger(cfg.dp_noise_multiplier, cfg.dp_delta)
        self.scaled: list[bool] = []  # whether the server scaled each update of the round, in order (central)

    def clip_updates(self, updates: Iterable[core.Tensors]) -> Iterator[core.Tensors]:
        """Central mode: each update onto the ``dp-clip-norm`` ball, as it is combined (the sensitivity of the
        sum is the clip norm, whatever a node sent). Local mode: as they came (each is noised already)."""
        self.scaled = []
        for update in updates:
            if self.central:
                update, scaled = core.clip(update, self.cfg.dp_clip_norm)
                self.scaled.append(scaled)
            yield update

    def noised(self, server_round: int, mean: core.Tensors, num_updates: int) -> core.Tensors:
        """Central mode: the mean of ``num_updates`` clipped updates plus Gaussian noise of std
        ``σ C / n`` (the sum's ``σ C``, divided as the mean is), from round r's seed."""
        cfg = self.cfg
        if not self.central or cfg.dp_noise_multiplier == 0 or num_updates == 0:
            return mean
        noise = core.gaussian(mean, core.noise_seed(self.secret, server_round))
        return core.add_noise(mean, noise, cfg.dp_noise_multiplier * cfg.dp_clip_norm / num_updates)

    def released(self, accepted) -> dict:
        """Round r's step is applied: the sites whose updates it used (``accepted``, the replies in it) are
        charged one release. Returns the round's record fields: ε so far, and how many of its updates were
        clipped (central: by their node, which says so only in this mode, or by the server)."""
        self.ledger.released(r.partition_id for r in accepted)
        record = {"dp_epsilon": self.ledger.epsilon(), "dp_delta": self.cfg.dp_delta,
                  "dp_releases": self.ledger.rounds}  # fmt: skip
        if self.central:
            scaled = self.scaled + [False] * (len(accepted) - len(self.scaled))
            record["dp_clipped"] = sum(bool(r.metrics.dp_clipped) or s for r, s in zip(accepted, scaled))
        return record

    def stop_reason(self, server_round: int) -> str | None:
        """Why round r must not run: it would bring ε past ``dp-target-epsilon`` (None: it may run)."""
        target = self.cfg.dp_target_epsilon
        if target <= 0:
            return None
        after = self.ledger.epsilon(more_rounds=1)
        if after <= target:
            return None
        return (f"dp-target-epsilon={target:g} reached: round {server_round} would bring epsilon from "
                f"{self.ledger.epsilon():.3f} to {after:.3f} at dp-delta={self.cfg.dp_delta:g}")  # fmt: skip

    def state(self) -> dict:
        return {**self.ledger.state(), "noise_secret": self.secret}

    def load(self, state: dict) -> None:
        self.ledger.load(state)
        if "noise_secret" in state and self.cfg.dp_noise_seed < 0:
            self.secret = int(state["noise_secret"])
