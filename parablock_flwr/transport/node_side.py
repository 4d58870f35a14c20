"""The node side of the direct transport: a round's block records fetched, and its update uploaded, on the
stream a ``messages.TransportOffer`` names.

Each fetched record is checked against the size and SHA-256 in Flower's message before a byte is used
(``TransportClient.download``), then read as the arrays Flower's path would have delivered
(``framing``). When the stream cannot be used (the address does not answer, a TLS failure, a refusal),
``StreamUnusable`` says why in one line and the caller falls back to Flower's path for that message. An
address that did not answer is not dialled again for ``retry_after_s``: a site whose firewall drops the
port pays the connection timeout once a minute, not once a message. No Flower and no torch here: the
node worker imports it.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..messages import MAX_REPLY_CONTENT, RecordOffer, TransportOffer, UpdateCommit, relay_name
from ..node.settings import SiteStream
from ..npy import npy_view
from .capabilities import Direction, Refused, Ticket
from .client import TransportClient, TransportError
from .framing import Buffers, FramingError, framed, framed_pieces, unframe

log = logging.getLogger(__name__)


class StreamUnusable(Exception):
    """The stream could not move a record; the message is one line (no token, no payload)."""


@dataclass(frozen=True)
class Prefetched:
    """A record fetched before Flower's message announced it: used only if the message's size and SHA-256
    for a record of that name are these bytes' (``matches``); anything else is fetched as usual."""

    name: str
    data: bytearray | memoryview
    sha256: str

    def matches(self, ref: RecordOffer) -> bool:
        return (ref.name, ref.size) == (self.name, len(self.data)) and hmac.compare_digest(ref.sha256, self.sha256)


class NodeTransport:
    """One node's channels to the stream, kept across rounds (one per address and CA)."""

    def __init__(
        self,
        site: SiteStream | None = None,
        connect_timeout_s: float = 5.0,
        timeout_s: float | None = None,
        retry_after_s: float = 60.0,
        clock=time.monotonic,
    ):
        self.site = site or SiteStream()  # the site's own settings (its node config)
        self.connect_timeout_s, self.timeout_s, self.retry_after_s = connect_timeout_s, timeout_s, retry_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._clients: dict[tuple[str, str, bool], TransportClient] = {}
        self._unreachable: dict[tuple[str, str, bool], tuple[float, str]] = {}  # key -> (until, why)

    def address(self, offer: TransportOffer) -> str:
        return self.site.address or offer.address

    def fetch(self, offer: TransportOffer, prefetched: Prefetched | None = None) -> dict[str, dict[str, memoryview]]:
        """Each offered record's arrays (message record name -> array name -> npy payload), every record
        checked against its size and SHA-256 from Flower's message; a record ``prefetched`` holds with that
        very size and SHA-256 is taken from it instead of the stream. Raises ``StreamUnusable``."""
        out = {}
        for ref in offer.records:
            if prefetched is not None and prefetched.matches(ref):
                data = prefetched.data
            else:
                ticket = self._ticket(offer, Direction.DOWNLOAD, ref.name, ref.token)
                data = self._call(offer, lambda client, t=ticket, r=ref: client.download(t, r.size, r.sha256))
            try:
                out[ref.record] = unframe(data, ref.record)
            except FramingError as err:
                raise StreamUnusable(f"record {ref.record}: {err}") from None
        return out

    def fetch_arrays(self, offer: TransportOffer, prefetched: Prefetched | None = None) -> dict[str, np.ndarray]:
        """``fetch``'s records as the relay hands them to the node worker: ``record/array`` -> the array
        (``messages.relay_name``), each a read-only view of the fetched bytes."""
        return {
            relay_name(record, name): npy_view(payload, relay_name(record, name))
            for record, payloads in self.fetch(offer, prefetched).items()
            for name, payload in payloads.items()
        }

    def upload(self, offer: TransportOffer, payloads: Mapping[str, object]) -> UpdateCommit:
        """Send the update (array name -> npy payload) under the offer's upload capability; the commit the
        reply carries. Raises ``StreamUnusable`` (then the update goes in the reply, on Flower's path)."""
        return self._upload(offer, framed(payloads))

    def upload_pieces(self, offer: TransportOffer, pieces: Mapping[str, list[np.ndarray]]) -> UpdateCommit:
        """``upload`` of the update as ``wire.pack_pieces`` returns it (each array as its 1-D pieces)."""
        return self._upload(offer, framed_pieces(pieces))

    def upload_ahead(self, offer: TransportOffer, pieces: Mapping[str, list[np.ndarray]]) -> UpdateCommit:
        """``upload_pieces`` of round r+1's update under the capability round r's ``offer`` issued ahead, into
        round r+1's own slot: the commit round r+1's reply carries."""
        name, token, bound = offer.ahead_upload_name, offer.ahead_upload_token, offer.ahead_upload_max_size
        return self._upload(offer, framed_pieces(pieces), name, token, bound, offer.server_round + 1)

    def upload_reply(self, offer: TransportOffer, content: bytes) -> None:
        """The round's reply content (``message_bytes.reply_to_bytes``) under the offer's reply capability, after
        the update it commits. Raises ``StreamUnusable`` (the reply then goes on Flower's path alone)."""
        if not offer.reply_name:
            raise StreamUnusable("the message offers no reply capability")
        self._upload(offer, Buffers([content]), offer.reply_name, offer.reply_token, MAX_REPLY_CONTENT)

    def prefetch(self, offer: TransportOffer, expected_size: int = 0) -> Prefetched:
        """Round r+1's global step under the capability round r's ``offer`` issued ahead, as soon as the server
        publishes it (the call waits until then), received into kept memory of ``expected_size`` where given
        (``TransportClient.download_unannounced``). Raises ``StreamUnusable``."""
        if not offer.ahead_step_name:
            raise StreamUnusable("the message offers no download ahead")
        ticket = Ticket(bytes.fromhex(offer.ahead_step_token), offer.run_id, offer.node_id, offer.server_round + 1,
                        Direction.DOWNLOAD, offer.ahead_step_name)  # fmt: skip
        bound = offer.ahead_step_max_size
        data, sha256 = self._call(offer, lambda c: c.download_unannounced(ticket, bound, expected_size), ahead=True)
        return Prefetched(offer.ahead_step_name, data, sha256)

    def _upload(
        self, offer: TransportOffer, data: Buffers, name: str = "", token: str = "", bound: int = 0, round: int = 0
    ) -> UpdateCommit:
        name, token = name or offer.upload_name, token or offer.upload_token
        bound, round = bound or offer.upload_max_size, round or offer.server_round
        if not name:
            raise StreamUnusable("the message offers no upload capability")
        if len(data) > bound:
            raise StreamUnusable(f"an update of {len(data)} bytes; the offer bounds it at {bound}")
        ticket = Ticket(bytes.fromhex(token), offer.run_id, offer.node_id, round, Direction.UPLOAD, name)
        # Hashed as it is sent (the digest follows the bytes): the server receives while the node hashes.
        sha256 = self._call(offer, lambda client: client.upload(ticket, data), ahead=round != offer.server_round)
        return UpdateCommit(update_size=len(data), update_sha256=sha256)

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    def message_content(self, offer: TransportOffer) -> bytearray | None:
        """The content of a message pushed a round ahead (the offer's ``message_*``), which the server
        publishes once it has built it (the call waits until then); None when the server withdrew it (its
        capability revoked while it waited, or an empty record). Raises ``StreamUnusable``."""
        if not offer.message_name:
            raise StreamUnusable("the message names no content on the stream")
        ticket = self._ticket(offer, Direction.DOWNLOAD, offer.message_name, offer.message_token)

        def fetch(client: TransportClient) -> bytearray | None:
            try:
                data, _ = client.download_unannounced(ticket, offer.message_max_size)
            except TransportError as err:
                if err.code == "NOT_FOUND":  # revoked while it waited: not messaged in this round after all
                    return None
                raise
            return data or None

        return self._call(offer, fetch, ahead=True)

    @staticmethod
    def _ticket(offer: TransportOffer, direction: Direction, name: str, token: str) -> Ticket:
        return Ticket(bytes.fromhex(token), offer.run_id, offer.node_id, offer.server_round, direction, name)

    def _call(self, offer: TransportOffer, fn, ahead: bool = False):
        """``fn(client)`` on the offer's channel; any failure as ``StreamUnusable``. An address that could not
        be reached (``UNAVAILABLE`` before any connection: no answer within ``connect_timeout_s``, refused, TLS
        failed) is not dialled again for ``retry_after_s``, unless the call moved bytes ``ahead`` of their
        message. A server that went away during a call (killed, and maybe resumed at the same address within
        the minute) was reached: it says nothing of the next call, which dials again."""
        site = self.site
        if offer.insecure and site.require_tls:
            raise StreamUnusable("the message offers a plaintext stream; this site's node config requires TLS")
        try:  # the site's files, read by the worker's user: one it cannot read is this message on Flower's path
            ca = Path(site.ca).expanduser().read_text() if site.ca and not offer.insecure else offer.ca_pem
            identity = None if offer.insecure else site.identity()
        except OSError as err:
            raise StreamUnusable(
                f"this site's stream settings: cannot read {err.filename!r} ({err.strerror})"
            ) from None
        key = (self.address(offer), ca, offer.insecure)
        with self._lock:
            until, why = self._unreachable.get(key, (0.0, ""))
            if self._clock() < until:
                raise StreamUnusable(f"{why} (not dialled again for {until - self._clock():.0f} s)")
            client = self._clients.get(key)
            if client is None:
                client = TransportClient(key[0], insecure=key[2], timeout_s=self.timeout_s,
                                         ca_pem=None if key[2] else key[1].encode(),
                                         connect_timeout_s=self.connect_timeout_s, identity=identity)  # fmt: skip
                self._clients[key] = client
        client.timeout_s = self.timeout_s
        try:
            return fn(client)
        except Refused as refused:
            raise StreamUnusable(f"the stream at {key[0]} {refused.line()}") from None
        except TransportError as err:
            why = f"the stream at {key[0]} failed: {err}"
            if err.code == "UNAVAILABLE" and not ahead and never_connected(err):
                with self._lock:
                    self._unreachable[key] = (self._clock() + self.retry_after_s, why)
                    self._clients.pop(key, None)
                client.close()
            raise StreamUnusable(why) from None


def never_connected(err: TransportError) -> bool:
    """Whether a call's ``UNAVAILABLE`` is gRPC's failure to connect at all (its details say so: "failed to
    connect to all addresses", "DNS resolution failed"), not a connection lost during the call ("Cancelling
    all calls", "Socket closed": the server stopped, or was killed, with the call under way)."""
    text = str(err)
    return "failed to connect" in text or "DNS resolution failed" in text
