"""The algorithm registry: each algorithm's name, its server half and client half (``"module:Class"``,
relative to ``strategies/``), and what it fixes of the run config. Data only, imported by the run config
(``config.py``) and by ``strategies``, which loads the halves; a new algorithm is registered by adding its
two halves here (docs/extending.md, "A new algorithm")."""

from __future__ import annotations

# name -> "module:Class", relative to this package
SERVER_HALVES = {  # the default first (``RunConfig.algorithm``)
    "parablock": "parablock.server:ParaBlock",
    "fedbcd": "fedbcd.server:FedBCD",
    "fedavg-full": "fedavg.server:FedAvgFull",
    "fedavg-lora": "fedavg.server:FedAvgLora",
}
CLIENT_HALVES = {
    "parablock": "parablock.client:ParaBlockClient",
    "fedbcd": "fedbcd.client:BCDClient",
    "fedavg-full": "fedbcd.client:BCDClient",
    "fedavg-lora": "fedbcd.client:BCDClient",
}
# What else an algorithm fixes (config.RunConfig reads these; every other algorithm leaves them to the
# run config): the parameters it trains whatever ``train`` says, and whether its one block is every
# trainable parameter (``core.one_block``).
TRAINS_ONLY = {"fedavg-full": "full", "fedavg-lora": "lora"}
ONE_BLOCK = frozenset({"fedavg-full", "fedavg-lora"})


def algorithms() -> tuple[str, ...]:
    """The run config's choices of ``algorithm``: every registered algorithm."""
    return tuple(SERVER_HALVES)
