"""An example of a strategy of your own, outside the package: ParaBlock that also records each round's largest
accepted update norm (``max_update_norm_seen``), to size ``max-update-norm`` from a real run. It changes no bit of
the model: the tests run it in a simulation and a deployment and compare the model with the default's.

    flwr run . --run-config 'strategy="extensions.update_norms:UpdateNormParaBlock"'
"""

from __future__ import annotations

import torch

from parablock_flwr.strategies import ParaBlock


class UpdateNormParaBlock(ParaBlock):
    """``ParaBlock``, and each round's largest L2 norm of an accepted update in its record."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.largest_norms: dict[int, float] = {}  # round -> its largest accepted update's L2 norm so far

    def observe_update(self, server_round: int, block: int, reply):
        """Each accepted update once, before it is combined (the round keeps none of them whole after)."""
        norm = torch.linalg.vector_norm(torch.cat([t.flatten().float() for t in reply.update.values()])).item()
        self.largest_norms[server_round] = max(self.largest_norms.get(server_round, 0.0), norm)
        return super().observe_update(server_round, block, reply)

    def extra_round_metrics(self, server_round: int, accepted: list) -> dict:
        largest = self.largest_norms.pop(server_round, 0.0)
        return {**super().extra_round_metrics(server_round, accepted), "max_update_norm_seen": largest}
