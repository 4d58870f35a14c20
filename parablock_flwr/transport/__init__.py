"""The direct transport: a block record's bytes on an authenticated gRPC stream beside Flower's
messages, which carry only each record's size and SHA-256 and a capability (docs/transport.md)."""

from parablock_flwr.transport.capabilities import CapabilityRegistry, Direction, RefusalKind, Refused, Ticket
from parablock_flwr.transport.client import TransportClient, TransportError
from parablock_flwr.transport.node_side import NodeTransport, StreamUnusable
from parablock_flwr.transport.server_side import RunTransport, StreamSettings, TransportSetupError, update_bound
from parablock_flwr.transport.service import Limits, TransportServer

__all__ = [
    "CapabilityRegistry",
    "Direction",
    "Limits",
    "NodeTransport",
    "RefusalKind",
    "Refused",
    "RunTransport",
    "StreamSettings",
    "StreamUnusable",
    "Ticket",
    "TransportClient",
    "TransportError",
    "TransportServer",
    "TransportSetupError",
    "update_bound",
]
