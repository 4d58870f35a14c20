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

import contextlib
import math
import secrets
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

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
        self.adds_noise = self.central and cfg.dp_noise_multiplier > 0
        self._noise: dict[int, tuple[dict, Future]] = {}  # round -> (its block's shapes, its noise being drawn)

    def clip_updates(self, updates: Iterable[core.Tensors]) -> Iterator[core.Tensors]:
        """Central mode: each update onto the ``dp-clip-norm`` ball, as it is combined (the sensitivity of the
        sum is the clip norm, whatever a node sent). Local mode: as they came (each is noised already)."""
        self.scaled = []
        for update in updates:
            if self.central:
                update, scaled = core.clip(update, self.cfg.dp_clip_norm)
                self.scaled.append(scaled)
            yield update

    def clip_scale(self, update: Mapping[str, torch.Tensor]) -> float | None:
        """The factor ``clip_updates`` would scale ``update`` by (``core.clip_scale``; None: left as it is, as
        every update in local mode): the server finds it as a reply is checked (``Reply.clip_scale``)."""
        return core.clip_scale(update, self.cfg.dp_clip_norm) if self.central else None

    def clip_scales(self, accepted: Sequence) -> list[float | None] | None:
        """``clip_updates`` as factors, for the server's one pass (``core.applied_mean_step``): the accepted
        replies' ``clip_scale``, in order, counted as ``clip_updates`` counts what it scaled. None where a reply's
        was not found as it was checked (one made elsewhere): then each step runs apart, ``clip_updates`` included."""
        if not all(r.clip_scale_found for r in accepted):
            return None
        scales = [r.clip_scale for r in accepted]
        self.scaled = [s is not None for s in scales] if self.central else []
        return scales

    def draw_noise_ahead(self, server_round: int, like: Mapping[str, torch.Tensor]) -> None:
        """Round r's noise (``core.gaussian`` for the block ``like`` shapes) drawn on a thread of its own once
        the round's messages are built: a pass over the block at the generator's pace (one core: about 230 M
        values a second here, docs/privacy.md), while the nodes train rather than between the last reply and the
        next message."""
        if not self.adds_noise or server_round in self._noise:
            return
        shapes = {n: torch.empty(t.shape, device="meta") for n, t in like.items()}
        seed, drawn = core.noise_seed(self.secret, server_round), Future()

        def draw() -> None:
            try:
                drawn.set_result(core.gaussian(shapes, seed))
            except BaseException as err:  # noqa: BLE001 - the aggregation that waits for it raises it
                drawn.set_exception(err)

        self._noise = {server_round: (_shapes(shapes), drawn)}  # only the latest round's: memory of one block
        threading.Thread(target=draw, name=f"dp-noise-r{server_round}", daemon=True).start()

    def noise(self, server_round: int, like: Mapping[str, torch.Tensor]) -> core.Tensors:
        """Round r's standard normal noise for the block ``like`` shapes: the draw started ahead, where it was
        for these shapes, else drawn now. The same bits either way (one seeded generator, in name order)."""
        ahead = self._noise.get(server_round)
        if ahead is not None and ahead[0] == _shapes(like):
            with contextlib.suppress(Exception):  # a draw that failed (out of memory, say) is made again here
                return ahead[1].result()
        return core.gaussian(like, core.noise_seed(self.secret, server_round))

    def noise_std(self, num_updates: int) -> float:
        """The std of the mean's noise, ``σ C / n`` (the sum's ``σ C``, divided as the mean is)."""
        return self.cfg.dp_noise_multiplier * self.cfg.dp_clip_norm / num_updates

    def noised(self, server_round: int, mean: core.Tensors, num_updates: int) -> core.Tensors:
        """Central mode: the mean of ``num_updates`` clipped updates plus Gaussian noise of std
        ``σ C / n``, from round r's seed."""
        if not self.adds_noise or num_updates == 0:
            return mean
        return core.add_noise(mean, self.noise(server_round, mean), self.noise_std(num_updates))

    def released(self, accepted) -> dict:
        """Round r's step is applied: the sites whose updates it used (``accepted``, the replies in it) are
        charged one release. Returns the round's record fields: ε so far, and how many of its updates were
        clipped (central: by their node, which says so only in this mode, or by the server)."""
        self.ledger.released(r.partition_id for r in accepted)
        self._noise = {}  # the round is over: its noise is not drawn from again
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


def _shapes(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in tensors.items()}
