"""Server strategies: sequential BCD, ParaBlock and the FedAvg baselines (thin subclasses of it)."""

import importlib

from .fedavg import FedAvgFull, FedAvgLora
from .fedbcd import FedBCD
from .parablock import ParaBlock

STRATEGIES = {"fedbcd": FedBCD, "parablock": ParaBlock, "fedavg-full": FedAvgFull, "fedavg-lora": FedAvgLora}


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


__all__ = ["FedAvgFull", "FedAvgLora", "FedBCD", "ParaBlock", "STRATEGIES", "strategy_class"]
