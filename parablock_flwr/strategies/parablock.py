"""ParaBlock, as defined by this project: its server half and its client half.

The server math is that of sequential BCD (``fedbcd.py``); the algorithm lives
on the client, which trains block ``b_r`` from ``x^{r-2} + Δ_i^{r-1}`` while
round r-1's exchange travels, then corrects (``ParaBlockClient.correct``).
The server adds the overlapped time model, (``verify-invariant``) a check that
each client's local model after the correction is exactly ``x^{r-1} + Δ_i^r``,
and each client's ``Δ_i^r`` in the checkpoint (what a restarted server hands back).
"""

from __future__ import annotations

import logging

from .. import core
from ..checkpoint import stage_pending
from ..replica import FetchStep, ModelReplica
from .fedbcd import BCDClient, FedBCD
from .reply_checks import Reply

log = logging.getLogger(__name__)


class ParaBlock(FedBCD):
    """ParaBlock's server half: communication overlapped with the next block's computation."""

    algorithm = "parablock"
    overlapped = True

    def check_reply(self, server_round: int, block: int, reply: Reply) -> str | None:
        """With ``verify-invariant``: the client's local model after the correction must be
        exactly ``x^{r-1} + Δ_i^r`` (checked before ``g^r`` is applied: ``x`` is ``x^{r-1}``).
        A failed check rejects the update; the node is then resynchronised."""
        if not self.config.verify_invariant:
            return None
        reported = reply.trace.get("local-model-sha256")
        if reported is None:
            return "verify-invariant is on and the reply carries no local-model digest"
        self.stats.invariant_checked += 1
        if reported != core.digest_after(self.global_params, self.partition.all_names(), reply.update):
            self.stats.invariant_failed += 1
            return "invariant broken: the local model is not x^{r-1} + its own update"
        return None

    def observe_update(self, server_round: int, block: int, reply: Reply) -> None:
        """Keep each accepted ``Δ_i^r`` for the checkpoint, by partition id: after round r the
        client's local model is ``x^{r-1} + Δ_i^r``, and a restarted server hands it back."""
        stage_pending(self.run_dir, reply.partition_id, core.PendingUpdate(block, server_round - 1, reply.update))

    def extra_round_metrics(self, server_round: int, accepted: list[Reply]) -> dict:
        """How many clients had to be resynchronised (trained from ``x^{r-1}``, no staleness)."""
        if server_round == 1:
            return {"num_resynchronised": 0}
        return {"num_resynchronised": sum(1 for r in accepted if r.metrics["base-version"] == server_round - 1)}


class ParaBlockClient(BCDClient):
    """ParaBlock's client half: round r trains from the stale ``x^{r-2} + Δ_i^{r-1}``, then corrects.

    The node worker starts round r+1 as soon as round r's reply is ready (``runs_ahead``):
    that computation overlaps the exchange of round r.
    """

    runs_ahead = True

    def start_point(
        self, pending: core.PendingUpdate | None, server_round: int
    ) -> tuple[int, core.PendingUpdate | None]:
        """``x^{r-2} + Δ_i^{r-1}``; a client without a one-round-old pending update (round 1,
        it missed round r-1, it was resynchronised) starts from ``x^{r-1}``, as in BCD."""
        return core.parablock_base(pending, server_round)

    def finish_round(
        self, replica: ModelReplica, delta: core.Tensors, block: int, server_round: int, fetch_step: FetchStep
    ) -> core.PendingUpdate:
        return self.correct(replica, delta, block, server_round, fetch_step)

    @staticmethod
    def correct(
        replica: ModelReplica, delta: core.Tensors, block: int, server_round: int, fetch_step: FetchStep
    ) -> core.PendingUpdate:
        """The correction ``y[b_{r-1}] += η_s Δ̄^{r-1} − Δ_i^{r-1}``, applied exactly (``at-end``).

        The local model is kept as (global version, own pending update): the additive
        correction is re-basing the replica onto ``x^{r-1}`` (replaying ``g^{r-1}``) and
        keeping only ``Δ_i^r``. It equals the additive form in exact arithmetic and, unlike
        it, accumulates no float rounding: the invariant ``y = x^{r-1} + Δ_i^r`` holds to the
        bit, also when ``b_r == b_{r-1}``. The ``on-receipt`` mode applies the additive form
        to the running computation instead: ``core.correct_in_place``.
        """
        replica.advance_to(server_round - 1, fetch_step)
        return core.PendingUpdate(block=block, base_version=server_round - 1, delta=delta)
