"""The node: what a node does in a round, the same in simulation and deployment, and what it keeps.

| module         | what it holds                                                                        |
|----------------|--------------------------------------------------------------------------------------|
| ``settings``   | a SuperNode's node config: its own data, device, allow-lists, stream (no torch)      |
| ``state``      | what a node keeps between rounds (``NodeState``) and its durable residual store       |
| ``cache``      | the per-process cache: the replica and the data (``resources``), what fits (``check_fits``) |
| ``request``    | a message, read once from the schema (``Request``), the reply, and refusals         |
| ``runtime``    | ``Node``: one node's state and the only code that changes it, a round step by step  |
| ``compute``    | a computation (``Job``, ``compute_update`` with its out-of-memory retry, evaluation) |

The drivers (``client_apps/inline.py``, ``worker/server.py``) use the names re-exported here. They load on
first use: the thin ClientApp imports ``node.settings`` without torch.
"""

import importlib

_HOMES = {
    "node_device": "..model",
    **dict.fromkeys(("NodeResources", "check_fits", "loaded", "resources"), ".cache"),
    **dict.fromkeys(
        ("Job", "compute_update", "computed", "evaluate_replica", "run_here", "update_metrics"), ".compute"
    ),
    **dict.fromkeys(("NodeAnswer", "RequestRefused", "Request", "StateIntact", "check_blocks"), ".request"),
    **dict.fromkeys(
        ("Ahead", "Node", "ResidualsMissing", "ResidualWriteFailed", "in_background", "timed", "wait_for_write"),
        ".runtime",
    ),
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value  # once: later reads are plain attribute reads
    return value
