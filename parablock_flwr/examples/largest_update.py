"""Block selection: train next the block whose last update was largest.

Blocks never trained come first (in order); after that, the block whose last
global step had the largest RMS is picked, on the idea that it is still far
from converged. An example of overriding ``choose_block``.
"""

from __future__ import annotations

import math

from .. import core
from ..strategies.parablock.server import ParaBlock


class LargestUpdateParaBlock(ParaBlock):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.last_rms: dict[int, float] = {}  # block -> RMS of its latest global step

    def choose_block(self, server_round: int) -> int:
        """Unvisited blocks first, then the largest recent update.

        Called during round r-1 for round r, so it sees steps up to round r-2
        and must avoid the block already chosen for round r-1 only if it wants
        to; here the choice is purely by the recorded sizes.
        """
        for block in range(self.partition.num_blocks):
            if block not in self.last_rms and block not in self.decided_blocks().values():
                return block
        return max(self.last_rms, key=self.last_rms.get)

    def server_update(self, server_round: int, block: int, mean_update: core.Tensors) -> core.Tensors:
        step = super().server_update(server_round, block, mean_update)
        squares = sum(float(t.double().pow(2).sum()) for t in step.values())
        count = sum(t.numel() for t in step.values())
        self.last_rms[block] = math.sqrt(squares / max(count, 1))
        return step

    def state_dict(self) -> dict:
        """The recorded sizes decide future blocks: a resumed run must have them."""
        return {"last_rms": {str(b): v for b, v in self.last_rms.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.last_rms = {int(b): v for b, v in state.get("last_rms", {}).items()}
