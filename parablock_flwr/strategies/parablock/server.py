"""ParaBlock, as defined by this project: the server half (client half: ``client.py``).

The server math is that of sequential BCD (``fedbcd/server.py``); the algorithm lives
on the client, which trains block ``b_r`` from ``x^{r-2} + Δ_i^{r-1}`` while
round r-1's exchange travels, then corrects (``ParaBlockClient.correct``).
The server adds the overlapped time model, (``verify-invariant``) a check that
each client's local model after the correction is exactly ``x^{r-1} + Δ_i^r``,
and each client's ``Δ_i^r`` in the checkpoint (what a restarted server hands back).
"""

from __future__ import annotations

import logging

from ... import core
from ...messages import LOCAL_MODEL_DIGEST
from ..fedbcd.server import FedBCD
from ..reply_checks import Reply

log = logging.getLogger(__name__)


class ParaBlock(FedBCD):
    """ParaBlock's server half: communication overlapped with the next block's computation."""

    algorithm = "parablock"
    overlapped = True

    def check_reply(self, server_round: int, block: int, reply: Reply) -> str | None:
        """With ``verify-invariant``: the client's local model after the correction must be
        exactly ``x^{r-1} + Δ_i^r`` (checked before ``g^r`` is applied: ``x`` is ``x^{r-1}``).
        A failed check rejects the update; the node is then resynchronised. It hashes the reply's update as it came
        (``core.model_digest``); ``x^{r-1}``'s tensors come from ``x_hashes``, which the checkpoint of round r-1
        filled while this round was out."""
        if not self.config.verify_invariant:
            return None
        reported = reply.trace.get(LOCAL_MODEL_DIGEST)
        if reported is None:
            return "verify-invariant is on and the reply carries no local-model digest"
        self.stats.invariant_checked += 1
        expected = core.model_digest(self.global_params, self.partition.all_names(), reply.update, self.x_hashes)
        if reported != expected:
            self.stats.invariant_failed += 1
            return "invariant broken: the local model is not x^{r-1} + its own update"
        return None

    def observe_update(self, server_round: int, block: int, reply: Reply) -> core.PendingUpdate:
        """Each accepted ``Δ_i^r``, for the checkpoint (by partition id): after round r the client's
        local model is ``x^{r-1} + Δ_i^r``, and a restarted server hands it back."""
        return core.PendingUpdate(block, server_round - 1, reply.update)

    def extra_round_metrics(self, server_round: int, accepted: list[Reply]) -> dict:
        """How many clients had to be resynchronised (trained from ``x^{r-1}``, no staleness)."""
        if server_round == 1:
            return {"num_resynchronised": 0}
        return {"num_resynchronised": sum(1 for r in accepted if r.metrics.base_version == server_round - 1)}
