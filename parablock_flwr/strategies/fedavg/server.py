"""The FedAvg baselines: federated BCD whose one block is every trainable parameter.

With a single block, a round of ``FedBCD`` is exactly a FedAvg round: every
client trains all trainable parameters for ``local-steps`` steps from the
current global model, sends its whole update, and the server applies the
weighted mean. The partition (``core.one_block``) makes the difference, not
the strategy; these classes only name the algorithm in messages and records.
"""

from __future__ import annotations

from ..fedbcd.server import FedBCD


class FedAvgFull(FedBCD):
    """FedAvg over all trainable weights: the upper bound on communication per round."""

    algorithm = "fedavg-full"


class FedAvgLora(FedBCD):
    """FedAvg over PEFT LoRA adapters (the FedIT recipe): only adapter arrays travel."""

    algorithm = "fedavg-lora"
