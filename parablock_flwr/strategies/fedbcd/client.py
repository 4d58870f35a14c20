"""Sequential federated BCD, the client half: ``BCDClient`` (server half: ``server.py``).

Imports no server code: the node worker loads it.
"""

from __future__ import annotations

from ... import core
from ...replica import FetchStep, ModelReplica


class BCDClient:
    """Sequential BCD's client half: round r trains ``b_r`` from ``x^{r-1}`` and keeps nothing.

    A client half is an algorithm's whole client-side rule: which model a round trains from
    (``start_point``), what reaches a computation while it runs (``aggregate_arrived``, ParaBlock's
    on-receipt correction), and what the client keeps afterwards on ``x^{r-1}``, onto which the
    runtime has re-based the replica (``finish_round``; ParaBlock's at-end correction). The node
    runtime (``node.Node``) calls these hooks, and only these, in both drivers (the simulation's
    inline ClientApp and the deployment's node worker).
    """

    runs_ahead = False  # may the node worker start round r+1 before its message arrives?

    def start_point(
        self, pending: core.PendingUpdate | None, server_round: int, fetch_step: FetchStep
    ) -> tuple[int, core.PendingUpdate | None]:
        """``(v, pending)``: round r trains from ``x^v + pending``. BCD: ``x^{r-1}``."""
        return server_round - 1, None

    def new_slot(self):
        """What a computation that starts now takes from the outside at its step boundaries (a
        ``parablock.client.CorrectionSlot``), or None. BCD: nothing reaches a running computation."""
        return None

    def aggregate_arrived(self, slot, step: core.Tensors, started_from: core.PendingUpdate | None) -> None:
        """Round r's message brought ``g^{r-1}`` while round r's computation runs (or is about to
        start from ``started_from``). BCD: its computation started from ``x^{r-1}`` already."""

    def finish_round(
        self,
        started_from: core.PendingUpdate | None,
        delta: core.Tensors,
        block: int,
        server_round: int,
        fetch_step: FetchStep,
    ) -> core.PendingUpdate | None:
        """After ``Δ_i^r`` (trained from ``x^v + started_from``), with the node's replica re-based onto
        ``x^{r-1}`` (the runtime's correction step): what the client keeps on it until the next round,
        as an offset from ``x^{r-1}``. BCD: nothing."""
        return None

    def round_metrics(self, slot, replica: ModelReplica, kept: core.PendingUpdate | None, local_steps: int) -> dict:
        """What the reply reports of the client-side rule, by ``messages.TrainMetrics`` field name.
        BCD: no correction, after the last step."""
        return {"correction_after_step": local_steps}
