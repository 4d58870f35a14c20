"""ParaBlock's server side, as defined by this project.

The server math is that of sequential BCD (``fedbcd.py``); the algorithm
lives on the client, which trains block ``b_r`` from ``x^{r-2} + Δ_i^{r-1}``
while round r-1's exchange travels, then corrects. Here we only add:
the overlapped time model, and (``verify-invariant``) a check that each
client's local model after the correction is exactly ``x^{r-1} + Δ_i^r``.
"""

from __future__ import annotations

import logging

from .. import core
from .fedbcd import FedBCD

log = logging.getLogger("parablock_flwr")


class ParaBlock(FedBCD):
    """ParaBlock: communication overlapped with the next block's computation."""

    algorithm = "parablock"
    overlapped = True

    def check_invariant(self, accepted: list) -> dict:
        """Compare each client's reported local-model digest with ``x^{r-1} + Δ_i^r``.

        Called before ``g^r`` is applied, so ``global_params`` is ``x^{r-1}``.
        """
        names = self.partition.all_names()
        checked, failed = 0, []
        for update, _, msg in accepted:
            if "trace" not in msg.content.config_records:
                continue
            reported = msg.content["trace"].get("local-model-sha256")
            expected = core.digest_after(self.global_params, names, update)
            checked += 1
            if reported != expected:
                failed.append(msg.metadata.src_node_id)
                log.error("invariant broken on node %d: local model != x^{r-1} + own update",
                          msg.metadata.src_node_id)
        return {"invariant_checked": checked, "invariant_failed": len(failed)}

    def extra_round_metrics(self, server_round: int, accepted: list) -> dict:
        """How many clients had to be resynchronised (trained from ``x^{r-1}``, no staleness)."""
        if server_round == 1:
            return {"num_resynchronised": 0}
        return {"num_resynchronised": sum(1 for _, m, _ in accepted
                                          if int(m.get("base-version", server_round - 2)) == server_round - 1)}
