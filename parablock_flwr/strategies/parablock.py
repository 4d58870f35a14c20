"""ParaBlock's server side, as defined by this project.

The server math is that of sequential BCD (``fedbcd.py``); the algorithm
lives on the client, which trains block ``b_r`` from ``x^{r-2} + Δ_i^{r-1}``
while round r-1's exchange travels, then corrects. Here we only add:
the overlapped time model, (``verify-invariant``) a check that each
client's local model after the correction is exactly ``x^{r-1} + Δ_i^r``,
and each client's ``Δ_i^r`` in the checkpoint (the state a restarted
server must hand back).
"""

from __future__ import annotations

import logging

from flwr.app import Message, MetricRecord

from .. import core
from ..checkpoint import stage_pending
from .fedbcd import FedBCD

log = logging.getLogger("parablock_flwr")


class ParaBlock(FedBCD):
    """ParaBlock: communication overlapped with the next block's computation."""

    algorithm = "parablock"
    overlapped = True

    def observe_update(self, server_round: int, block: int, update: core.Tensors, metrics: MetricRecord,
                       msg: Message) -> None:
        """Each accepted ``Δ_i^r``: check the invariant, keep it for the checkpoint.

        After round r the client's local model is ``x^{r-1} + Δ_i^r``; the
        checkpoint keeps ``Δ_i^r`` by partition id, to hand it back if the server
        restarts (``resume-from``).
        """
        if self.verify_invariant:
            self.check_invariant(update, msg)
        if "partition-id" in metrics:
            stage_pending(self.run_dir, int(metrics["partition-id"]),
                          core.PendingUpdate(block, server_round - 1, update))

    def check_invariant(self, update: core.Tensors, msg: Message) -> None:
        """Compare the client's reported local-model digest with ``x^{r-1} + Δ_i^r``.

        Called before ``g^r`` is applied, so ``global_params`` is ``x^{r-1}``.
        """
        if "trace" not in msg.content.config_records:
            return
        reported = msg.content["trace"].get("local-model-sha256")
        expected = core.digest_after(self.global_params, self.partition.all_names(), update)
        self._round["invariant_checked"] = self._round.get("invariant_checked", 0) + 1
        if reported != expected:
            self._round["invariant_failed"] = self._round.get("invariant_failed", 0) + 1
            log.error("invariant broken on node %d: local model != x^{r-1} + own update", msg.metadata.src_node_id)

    def extra_round_metrics(self, server_round: int, accepted: list) -> dict:
        """How many clients had to be resynchronised (trained from ``x^{r-1}``, no staleness),
        and how many local models were checked against the invariant."""
        checked = {"invariant_checked": self._round.get("invariant_checked", 0),
                   "invariant_failed": self._round.get("invariant_failed", 0)} if self.verify_invariant else {}
        if server_round == 1:
            return {"num_resynchronised": 0, **checked}
        return {"num_resynchronised": sum(1 for m, _ in accepted
                                          if int(m.get("base-version", server_round - 2)) == server_round - 1),
                **checked}
