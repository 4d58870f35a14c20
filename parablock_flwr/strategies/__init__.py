"""The algorithms: each is a server half (a Flower strategy) and a client half, registered together.

| algorithm     | server half  | client half       |
|---------------|--------------|-------------------|
| `fedbcd`      | `FedBCD`     | `BCDClient`       |
| `parablock`   | `ParaBlock`  | `ParaBlockClient` |
| `fedavg-full` | `FedAvgFull` | `BCDClient`       |
| `fedavg-lora` | `FedAvgLora` | `BCDClient`       |

``correction = "none"`` (an ablation) gives ParaBlock the client half ``UncorrectedClient``.

The FedAvg baselines are sequential BCD over a single block (``core.one_block``).
"""

import importlib

from .fedavg import FedAvgFull, FedAvgLora
from .fedbcd import BCDClient, FedBCD
from .parablock import CorrectionSlot, ParaBlock, ParaBlockClient, UncorrectedClient

STRATEGIES = {"fedbcd": FedBCD, "parablock": ParaBlock, "fedavg-full": FedAvgFull, "fedavg-lora": FedAvgLora}
CLIENTS = {"fedbcd": BCDClient, "parablock": ParaBlockClient, "fedavg-full": BCDClient, "fedavg-lora": BCDClient}


def client_half(algorithm: str, correction: str = "at-end") -> BCDClient:
    """The client half of ``algorithm`` (named in every round's message); ``correction`` is
    ``RunConfig.correction_mode``, whose ``"none"`` turns ParaBlock's correction off."""
    if algorithm not in CLIENTS:
        raise ValueError(f"algorithm={algorithm!r}: expected one of {', '.join(CLIENTS)}")
    if algorithm == "parablock" and correction == "none":
        return UncorrectedClient()
    return CLIENTS[algorithm]()


def strategy_class(algorithm: str, strategy: str) -> type[FedBCD]:
    """The class to run: ``strategy = "module:Class"`` if set, else the algorithm's own.

    A named class must subclass the algorithm's class, so that the clients'
    behaviour (chosen by ``algorithm``) and the server's agree.
    """
    base = STRATEGIES[algorithm]
    if not strategy:
        return base
    module_name, _, class_name = strategy.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"strategy={strategy!r}: cannot import it ({err}); expected 'package.module:Class'") from err
    if not (isinstance(cls, type) and issubclass(cls, FedBCD) and cls.algorithm == algorithm):
        raise ValueError(f"strategy={strategy!r}: expected a subclass of {base.__name__} (algorithm={algorithm!r})")
    return cls


__all__ = [
    "BCDClient",
    "CLIENTS",
    "CorrectionSlot",
    "FedAvgFull",
    "FedAvgLora",
    "FedBCD",
    "ParaBlock",
    "ParaBlockClient",
    "STRATEGIES",
    "UncorrectedClient",
    "client_half",
    "strategy_class",
]
