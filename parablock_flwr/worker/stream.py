"""The node worker's side of ``transport = "direct"``: a round's block records fetched from the run's stream
before the round runs, and its update uploaded once computed, so that Flower's messages carry only their
control data (docs/transport.md).

A message's ``stream-offer`` names the stream, the CA the node trusts for it, each record's size and
SHA-256, and the capabilities. When the stream cannot be used (the address does not answer, a TLS
failure, a refusal, or the site's node config says ``transport="flower"``), the update goes inline in the
Flower reply (``direct-fallbacks`` = 1 in its metrics); records the node could not fetch make the round
an error with the node's state intact (``messages.STREAM_UNUSABLE``), and the server sends that node its
next messages with their records inline. Each is logged once per address here, and counted by the server.
"""

from __future__ import annotations

import logging

import numpy as np

from .. import node
from ..messages import STREAM_UNUSABLE, MessageError, TransportOffer, UpdateCommit, WorkerRequest
from ..node_data import NodeSettings
from ..transport import NodeTransport, StreamUnusable

log = logging.getLogger(__name__)
FLOWER_ONLY = "flower"  # a site's node config ``transport``: keep to Flower's path


class WorkerStream:
    """One worker's channels to the run's stream (kept across rounds) and what it has logged."""

    def __init__(self) -> None:
        self.transport = NodeTransport()
        self._said: set[tuple[str, str]] = set()  # (what, address) logged once

    def offer(self, request: WorkerRequest) -> TransportOffer | None:
        """The request's offer, read strictly (a malformed one refuses the round, state intact)."""
        if not request.stream_offer:
            return None
        try:
            return TransportOffer.from_config(request.stream_offer)
        except MessageError as err:
            raise node.StateIntact(str(err)) from None

    def fetch(self, offer: TransportOffer, settings: NodeSettings, timeout_s: float) -> dict[str, np.ndarray]:
        """The offered records as the relay's ``record/array`` arrays, each checked against Flower's message;
        ``node.StateIntact`` (``STREAM_UNUSABLE``) when they cannot be fetched."""
        if not offer.records:
            return {}
        try:
            self._use(settings, timeout_s)
            arrays = self.transport.fetch_arrays(offer)
        except StreamUnusable as err:
            self._once("unusable", offer, f"direct transport: cannot fetch the round's records: {err}", log.warning)
            raise node.StateIntact(f"{STREAM_UNUSABLE}{err}") from None
        size = sum(r.size for r in offer.records)
        self._once("fetched", offer, f"direct transport: fetched {len(offer.records)} records ({size / 1e6:,.2f} MB) "
                   f"from {self._where(offer)}", log.info)  # fmt: skip
        return arrays

    def upload(
        self, offer: TransportOffer, settings: NodeSettings, pieces: dict[str, list[np.ndarray]], timeout_s: float
    ) -> UpdateCommit | None:
        """The update uploaded: its commit for the reply; None when it must go inline (a fallback)."""
        if not offer.upload_name:
            return None
        try:
            self._use(settings, timeout_s)
            commit = self.transport.upload_pieces(offer, pieces)
        except StreamUnusable as err:
            self._once("inline", offer, f"direct transport: the update goes inline on Flower's path ({err}); "
                       f"counted as a fallback, logged once", log.warning)  # fmt: skip
            return None
        self._once("uploaded", offer, f"direct transport: uploaded round {offer.server_round}'s update "
                   f"({commit.update_size / 1e6:,.2f} MB) to {self._where(offer)}", log.info)  # fmt: skip
        return commit

    def _use(self, settings: NodeSettings, timeout_s: float) -> None:
        if settings.transport == FLOWER_ONLY:
            raise StreamUnusable('this site\'s node config says transport="flower"')
        self.transport.address_override = settings.transport_address
        self.transport.timeout_s = timeout_s  # a transfer cannot take longer than the server waits

    def _where(self, offer: TransportOffer) -> str:
        return f"{self.transport.address(offer)} ({'PLAINTEXT' if offer.insecure else 'TLS'})"

    def _once(self, what: str, offer: TransportOffer, line: str, say) -> None:
        key = (what, self.transport.address(offer))
        if key not in self._said:
            self._said.add(key)
            say(line)
