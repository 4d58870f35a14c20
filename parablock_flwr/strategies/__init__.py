"""The algorithms: each is a folder with a server half (``server.py``, a Flower strategy) and a
client half (``client.py``, which model a round trains from and what the client keeps).

| algorithm     | server half                  | client half                  |
|---------------|------------------------------|------------------------------|
| `fedbcd`      | `fedbcd.server.FedBCD`       | `fedbcd.client.BCDClient`    |
| `parablock`   | `parablock.server.ParaBlock` | `parablock.client.ParaBlockClient` |
| `fedavg-full` | `fedavg.server.FedAvgFull`   | `fedbcd.client.BCDClient`    |
| `fedavg-lora` | `fedavg.server.FedAvgLora`   | `fedbcd.client.BCDClient`    |

``correction = "none"`` (an ablation) gives ParaBlock the client half ``UncorrectedClient``.
The FedAvg baselines are sequential BCD over a single block (``core.one_block``).

This module imports neither half: a node worker loads only client halves (``client_half``),
never server code; the server halves are imported when first named (``strategy_class``, or
``from parablock_flwr.strategies import FedBCD``).
"""

from __future__ import annotations

import importlib

from ..registry import CLIENT_HALVES, ONE_BLOCK, SERVER_HALVES, TRAINS_ONLY, algorithms  # noqa: F401 - the registry

_EXPORTS = {  # the names this package has always exported, imported on first use
    "FedBCD": "fedbcd.server",
    "ParaBlock": "parablock.server",
    "FedAvgFull": "fedavg.server",
    "FedAvgLora": "fedavg.server",
    "BCDClient": "fedbcd.client",
    "ParaBlockClient": "parablock.client",
    "UncorrectedClient": "parablock.client",
    "CorrectionSlot": "parablock.client",
}


def _load(path: str):
    """``"module:Class"``: ``module`` relative to this package (the shipped algorithms), else an
    absolute module name (an algorithm in a package of your own)."""
    module, _, name = path.partition(":")
    try:
        loaded = importlib.import_module(f"{__name__}.{module}")
    except ModuleNotFoundError as err:
        if not f"{__name__}.{module}".startswith(str(err.name)):
            raise  # the module exists but imports something missing: say that
        loaded = importlib.import_module(module)
    return getattr(loaded, name)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def client_half(algorithm: str, correction: str = "at-end"):
    """The client half of ``algorithm`` (named in every round's message); ``correction`` is
    ``RunConfig.correction_mode``, whose ``"none"`` turns ParaBlock's correction off."""
    if algorithm not in CLIENT_HALVES:  # (RunConfig checked it against SERVER_HALVES already)
        raise ValueError(f"algorithm={algorithm!r}: expected one of {', '.join(CLIENT_HALVES)}")
    if algorithm == "parablock" and correction == "none":
        return _load("parablock.client:UncorrectedClient")()
    if algorithm == "parablock":
        return _load(CLIENT_HALVES[algorithm])(on_receipt=correction == "on-receipt")
    return _load(CLIENT_HALVES[algorithm])()


def strategy_class(algorithm: str, strategy: str):
    """The class to run: ``strategy = "module:Class"`` if set, else the algorithm's own.

    A named class must subclass the algorithm's class, so that the clients'
    behaviour (chosen by ``algorithm``) and the server's agree.
    """
    base = _load(SERVER_HALVES[algorithm])
    if not strategy:
        return base
    module_name, _, class_name = strategy.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"strategy={strategy!r}: cannot import it ({err}); expected 'package.module:Class'") from err
    fedbcd = _load(SERVER_HALVES["fedbcd"])
    if not (isinstance(cls, type) and issubclass(cls, fedbcd) and cls.algorithm == algorithm):
        raise ValueError(f"strategy={strategy!r}: expected a subclass of {base.__name__} (algorithm={algorithm!r})")
    return cls
