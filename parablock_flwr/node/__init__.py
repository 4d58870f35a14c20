"""The node: what a node does in a round, the same in simulation and deployment, in four parts.

| module         | what it holds                                                                        |
|----------------|--------------------------------------------------------------------------------------|
| ``cache``      | the per-process cache: the replica and the data (``resources``), what fits (``check_fits``) |
| ``request``    | a message, read once from the schema (``Request``), the reply, and refusals         |
| ``runtime``    | ``Node``: one node's state and the only code that changes it, a round step by step  |
| ``compute``    | a computation (``Job``, ``compute_update`` with its out-of-memory retry, evaluation) |

The drivers (``client_apps/inline.py``, ``worker/server.py``) use the names re-exported here.
"""

from ..model import node_device
from .cache import NodeResources, check_fits, loaded, resources
from .compute import Job, compute_update, computed, evaluate_replica, run_here, update_metrics
from .request import NodeAnswer, Refused, Request, StateIntact, check_blocks
from .runtime import Ahead, Node, ResidualsMissing, ResidualWriteFailed, in_background, wait_for_write

__all__ = [
    "Ahead",
    "Job",
    "Node",
    "NodeResources",
    "Refused",
    "NodeAnswer",
    "Request",
    "ResidualWriteFailed",
    "ResidualsMissing",
    "StateIntact",
    "check_blocks",
    "check_fits",
    "compute_update",
    "computed",
    "evaluate_replica",
    "in_background",
    "loaded",
    "node_device",
    "resources",
    "run_here",
    "update_metrics",
    "wait_for_write",
]
