"""ParaBlock, the client half: ``ParaBlockClient`` (the stale start point and the correction),
``CorrectionSlot`` (the ``on-receipt`` correction of a running computation) and
``UncorrectedClient`` (the ablation ``correction = "none"``). Server half: ``server.py``.

Imports no server code: the node worker loads it.
"""

from __future__ import annotations

import threading

from ... import core
from ...replica import FetchStep, ModelReplica
from ..fedbcd.client import BCDClient


class ParaBlockClient(BCDClient):
    """ParaBlock's client half: round r trains from the stale ``x^{r-2} + Δ_i^{r-1}``, then corrects.

    The node worker starts round r+1 as soon as round r's reply is ready (``runs_ahead``):
    that computation overlaps the exchange of round r.
    """

    runs_ahead = True

    def __init__(self, on_receipt: bool = False) -> None:
        self.on_receipt = on_receipt  # correction = "on-receipt": correct the running computation

    def start_point(
        self, pending: core.PendingUpdate | None, server_round: int, fetch_step: FetchStep
    ) -> tuple[int, core.PendingUpdate | None]:
        """``x^{r-2} + Δ_i^{r-1}``; a client without a one-round-old pending update (round 1,
        it missed round r-1, it was resynchronised) starts from ``x^{r-1}``, as in BCD."""
        return core.parablock_base(pending, server_round)

    def new_slot(self) -> CorrectionSlot | None:
        return CorrectionSlot() if self.on_receipt else None

    def aggregate_arrived(
        self, slot: CorrectionSlot | None, step: core.Tensors, started_from: core.PendingUpdate | None
    ) -> None:
        """``on-receipt``: a computation from the stale ``x^{r-2} + Δ_i^{r-1}`` gets ``g^{r-1}``."""
        if slot is not None and started_from is not None:
            self.correct_on_receipt(slot, step, started_from)

    @staticmethod
    def correct_on_receipt(slot: CorrectionSlot, step: core.Tensors, started_from: core.PendingUpdate) -> None:
        """The correction ``y[b_{r-1}] += η_s Δ̄^{r-1} − Δ_i^{r-1}`` handed to the running computation:
        applied in place (``core.correct_in_place``) at its next step boundary, never inside a step.
        Inline (simulation) ``g^{r-1}`` came with the message: it is applied after the first step, as
        a node worker does when the exchange is shorter than one local step."""
        slot.post(step, started_from.delta)

    def finish_round(
        self,
        started_from: core.PendingUpdate | None,
        delta: core.Tensors,
        block: int,
        server_round: int,
        fetch_step: FetchStep,
    ) -> core.PendingUpdate:
        return self.correct(delta, block, server_round)

    @staticmethod
    def correct(delta: core.Tensors, block: int, server_round: int) -> core.PendingUpdate:
        """What the correction ``y[b_{r-1}] += η_s Δ̄^{r-1} − Δ_i^{r-1}`` (``at-end``) leaves the client: its
        own ``Δ_i^r``, written on ``x^{r-1}``.

        The local model is kept as (global version, own pending update): the node runtime re-bases the
        replica onto ``x^{r-1}`` (replaying ``g^{r-1}``, ``Node.finish_round``) and the client keeps only
        ``Δ_i^r``. It equals the additive form in exact arithmetic and, unlike it, accumulates no float
        rounding: the invariant ``y = x^{r-1} + Δ_i^r`` holds to the bit, also when ``b_r == b_{r-1}``.
        The ``on-receipt`` mode applies the additive form to the running computation as well
        (``correct_on_receipt``); its result is kept the same way here, and how far the live model had
        drifted is reported (``round_metrics``).
        """
        return core.PendingUpdate(block=block, base_version=server_round - 1, delta=delta)

    def round_metrics(
        self, slot: CorrectionSlot | None, replica: ModelReplica, kept: core.PendingUpdate | None, local_steps: int
    ) -> dict:
        """After which step the correction reached the computation (``local-steps``: at the end), and
        with ``on-receipt`` how far the live model drifted from the exact one (``correction-drift``), by
        ``messages.TrainMetrics`` field name."""
        if slot is None:
            return {"correction_after_step": local_steps}
        out = {"correction_after_step": slot.applied_after_step or local_steps}
        if slot.live and kept is not None:
            out["correction_drift"] = slot.drift(replica.params, kept.delta)
        return out


class CorrectionSlot:
    """An aggregate handed to the running computation (``on-receipt`` mode).

    ``ParaBlockClient.correct_on_receipt`` posts ``(g^{r-1}, Δ_i^{r-1})``; the computation
    applies it at its next step boundary, never inside a step.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._posted: tuple[core.Tensors, core.Tensors] | None = None
        self.applied_after_step: int | None = None
        self._touched: set[str] = set()
        self._applied: tuple[core.Tensors, core.Tensors] | None = None
        self.live: core.Tensors = {}  # the corrected blocks as training left them (``capture``)

    def post(self, step: core.Tensors, own_update: core.Tensors) -> None:
        with self._lock:
            self._posted = (step, own_update)

    def __call__(self, k: int, params: dict, before: core.Tensors) -> None:
        with self._lock:
            posted, self._posted = self._posted, None
        if posted is not None and self.applied_after_step is None:
            core.correct_in_place(params, before, *posted)
            self._applied, self.applied_after_step = posted, k
            self._touched = set(posted[0]) | set(before)

    def rearm(self) -> None:
        """A computation that starts over (out-of-memory retry) takes the correction again."""
        with self._lock:
            if self._applied is not None:
                self._posted, self._applied, self.applied_after_step = self._applied, None, None

    def capture(self, params: dict) -> None:
        """After the last step: keep what the correction touched, to measure its drift (``drift``)."""
        if self.applied_after_step is not None:
            self.live = {n: params[n].detach().float().clone() for n in self._touched}

    def drift(self, replica_params: dict, own_update: core.Tensors) -> float:
        """The largest difference between the live model the round finished on and the exact
        ``x^{r-1} + Δ_i^r`` (the replica once re-based, plus the node's update): float rounding of
        the in-place correction; 0 when it was not applied."""
        worst = 0.0
        for n, live in self.live.items():
            exact = replica_params[n].detach().float().cpu()
            if n in own_update:
                exact = exact + own_update[n].float()
            worst = max(worst, float((live.cpu() - exact).abs().max()))
        return worst


class UncorrectedClient(ParaBlockClient):
    """The ablation ``correction = "none"``: ParaBlock's staleness without the correction.

    The client never takes in the aggregate: its model is ``y_i = x^0 + Σ_s Δ_i^s``, its
    own updates only, on every block it trained, while the server still aggregates
    ``x^r = x^{r-1} + g^r``. It is stored, like ParaBlock's, as a global version plus an
    offset (``y_i − x^v``, now over several blocks): after round r, ``v = r − 1``.
    Only for measuring what the correction buys (docs/algorithm.md, "Without the correction").
    """

    def start_point(
        self, pending: core.PendingUpdate | None, server_round: int, fetch_step: FetchStep
    ) -> tuple[int, core.PendingUpdate | None]:
        """``y_i`` written on ``x^{r-2}``; a client that has not trained yet starts from ``x^{r-1}``."""
        if pending is None:
            return server_round - 1, None
        steps = [fetch_step(v)[1] for v in range(pending.base_version + 1, server_round - 1)]
        return server_round - 2, core.PendingUpdate(
            pending.block, server_round - 2, core.uncorrected_offset(pending.delta, {}, steps)
        )

    def finish_round(
        self,
        started_from: core.PendingUpdate | None,
        delta: core.Tensors,
        block: int,
        server_round: int,
        fetch_step: FetchStep,
    ) -> core.PendingUpdate:
        """``y_i += Δ_i^r``, written on ``x^{r-1}``: the offset loses ``g^{r-1}`` where ParaBlock's
        correction would have taken it in."""
        if started_from is None:  # trained from x^{r-1}
            offset = dict(delta)
        else:  # trained from x^{r-2} + offset
            offset = core.uncorrected_offset(started_from.delta, delta, [fetch_step(server_round - 1)[1]])
        return core.PendingUpdate(block=block, base_version=server_round - 1, delta=offset)
