"""Sequential federated BCD, the client half: ``BCDClient`` (server half: ``server.py``).

Imports no server code: the node worker loads it.
"""

from __future__ import annotations

from ... import core
from ...replica import FetchStep, ModelReplica


class BCDClient:
    """Sequential BCD's client half: round r trains ``b_r`` from ``x^{r-1}`` and keeps nothing.

    A client half says which model a round trains from and what the client keeps
    afterwards; the drivers (the simulation's inline ClientApp and the deployment's
    node worker) decide only where that state lives and when the computation runs.
    """

    runs_ahead = False  # may the node worker start round r+1 before its message arrives?

    def start_point(
        self, pending: core.PendingUpdate | None, server_round: int, fetch_step: FetchStep
    ) -> tuple[int, core.PendingUpdate | None]:
        """``(v, pending)``: round r trains from ``x^v + pending``. BCD: ``x^{r-1}``."""
        return server_round - 1, None

    def finish_round(
        self,
        replica: ModelReplica,
        started_from: core.PendingUpdate | None,
        delta: core.Tensors,
        block: int,
        server_round: int,
        fetch_step: FetchStep,
    ) -> core.PendingUpdate | None:
        """After ``Δ_i^r`` (trained from ``x^v + started_from``): what the client keeps until the
        next round. BCD: nothing."""
        return None
