"""The server side of the direct transport for one run: the stream service in the ServerApp process, and
what each round's messages say of it.

Per round, for each node: the message's block records are published once (a record every node gets, the
global step or the round's full sync, is one published record however many nodes fetch it), each with a
download capability for that node; an upload capability bounds the node's update; the message then
carries a ``messages.TransportOffer`` in place of the records. The node's reply carries an
``UpdateCommit``: ``claim`` hands over the uploaded bytes only when their SHA-256 is the reply's, which
Flower's node authentication vouches for. ``end_round`` forgets the round (capabilities, records,
uploads never claimed) and returns its counts for the round's record.

No Flower here: a record is any mapping of array names to npy payloads (bytes, or objects with ``.data``,
as Flower's ``Array``), so the rules are tested without processes.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from ..config import loopback
from ..messages import (
    GLOBAL_STEP,
    MAX_MESSAGE_CONTENT,
    MAX_REPLY_CONTENT,
    RecordOffer,
    TransportOffer,
    UpdateCommit,
)
from .capabilities import CapabilityRegistry, Direction, RefusalKind, Refused
from .framing import FramingError, framed, landed_far_enough, payloads, seal, unframe
from .service import KeptUpload, Limits, TransportServer, contiguous

log = logging.getLogger(__name__)
NPY_HEADER_BOUND = 4096  # an npy header of a 1-D array, at most (numpy pads them to 64 or 128 bytes)
LAYOUT_BYTES_PER_TENSOR = 512  # a wire layout entry: the name and shape as JSON, with room for long names


class TransportSetupError(ValueError):
    """The service cannot start as configured; one line naming the key and the value."""


@dataclass(frozen=True)
class StreamSettings:
    """The run config's ``transport-*`` keys (docs/configuration.md), as the ServerApp uses them."""

    address: str  # host:port the nodes dial; the port is served on every interface
    certfile: str = ""
    keyfile: str = ""
    ca: str = ""
    insecure: bool = False
    client_ca: str = ""  # the CA of the nodes' client certificates: mutual TLS (empty: the server's TLS only)

    @classmethod
    def from_run_config(cls, cfg) -> StreamSettings:
        return cls(cfg.transport_address, cfg.transport_certfile, cfg.transport_keyfile, cfg.transport_ca,
                   cfg.transport_insecure, cfg.transport_client_ca)  # fmt: skip

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0]

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    def read(self) -> tuple[Path | None, Path | None, str]:
        """The certificate and key paths and the CA's PEM, each file checked before the run starts."""
        if self.insecure:
            return None, None, ""
        for key, value in (("transport-certfile", self.certfile), ("transport-keyfile", self.keyfile),
                           ("transport-ca", self.ca), *((("transport-client-ca", self.client_ca),) if self.client_ca
                                                        else ())):  # fmt: skip
            if not Path(value).expanduser().is_file():
                raise TransportSetupError(f"{key}={value!r}: no such file on the server; expected a PEM file")
        ca_pem = Path(self.ca).expanduser().read_text()
        if "-----BEGIN CERTIFICATE-----" not in ca_pem:
            raise TransportSetupError(f"transport-ca={self.ca!r}: expected a PEM certificate")
        return Path(self.certfile).expanduser(), Path(self.keyfile).expanduser(), ca_pem


def is_reply(record: str) -> bool:
    """Whether an upload's name is a reply's content (``RunTransport.reply_name``), not a framed record."""
    return record.split("/")[1:2] == ["reply"]


def _decode(data, record: str):
    """An upload as its claim or take hands it over: a reply's content as its bytes, a block's framed record as
    its arrays' payloads (read-only views where it landed in memory, ``KeptUpload``; from a spill file, bytes)."""
    if is_reply(record):
        return bytes(contiguous(data, record))
    return unframe(data.view(), record) if isinstance(data, KeptUpload) else payloads(data, record)


def update_bound(numel: int, num_tensors: int) -> int:
    """The most bytes a node's framed update of a block may take: fp32 values (the widest transfer dtype;
    int8's values and scales take less), the layout, the npy headers and the frame's index."""
    return 4 * numel + LAYOUT_BYTES_PER_TENSOR * num_tensors + 3 * NPY_HEADER_BOUND + 64 * 1024


class RunTransport:
    """The stream service of one run and what each round's messages say of it (the module's docstring)."""

    def __init__(
        self,
        settings: StreamSettings,
        run_id: int,
        ttl_s: float,
        limits: Limits | None = None,
        registry: CapabilityRegistry | None = None,
        spill_dir: Path | None = None,
        memory_uploads: int = 0,
    ):
        """``spill_dir``: where uploads past the first ``memory_uploads`` in memory wait for their replies
        (``service.Inbox``; None: all in memory)."""
        certfile, keyfile, self.ca_pem = settings.read()
        self.settings, self.run_id, self.ttl_s = settings, run_id, ttl_s
        self.server = TransportServer(
            registry, address=f"[::]:{settings.port}", cert_file=certfile, key_file=keyfile,
            insecure=settings.insecure, limits=limits or Limits(), spill_dir=spill_dir,
            memory_uploads=memory_uploads, decode=_decode, outside_budget=is_reply,
            client_ca=Path(settings.client_ca).expanduser() if settings.client_ca else None,
        )  # fmt: skip
        self.address = settings.address  # the port the nodes dial: the bound one once started
        self._lock = threading.Lock()
        self._published: dict[int, dict[int, tuple[object, str, int, str]]] = {}  # round -> id(source) -> record
        self._names = 0
        self._fallbacks = 0
        self._fallen_back: set[int] = set()  # nodes whose fallback was logged (once each)
        self._ahead_nodes: dict[int, set[int]] = {}  # round -> nodes issued capabilities for it a round ahead
        self._service_counted: dict[str, int] = {}  # the service's own counts at the last ``end_round``
        self._waiting_steps: dict[int, set[int]] = {}  # round -> nodes issued its step's download a round ahead
        self._waiting_messages: dict[int, set[int]] = {}  # round -> nodes pushed its message a round ahead
        self._message_keys: dict[tuple[int, int], bytes] = {}  # (round, node) -> its content's HMAC key
        self._messages_ahead: set[tuple[int, int]] = set()  # (round, node) pushed its message a round ahead
        self._ahead = {"direct_updates_ahead": 0, "direct_steps_prefetched": 0, "direct_ahead_revoked": 0,
                       "direct_messages_ahead": 0, "direct_messages_withdrawn": 0,
                       "direct_contents_fetched": 0, "direct_replies_on_stream": 0, "direct_replies_audited": 0,
                       "direct_replies_contradicted": 0, "direct_replies_unaudited": 0}  # fmt: skip
        self._refusals_counted: dict[str, int] = {}

    # ------------------------------------------------------------ lifecycle
    def start(self) -> str:
        """Serve; the address the nodes dial (with the bound port when the configured one is 0)."""
        port = self.server.start()
        self.address = f"{self.settings.host}:{port}"
        security = "PLAINTEXT" if self.settings.insecure else "mutual TLS" if self.settings.client_ca else "TLS"
        log.info("direct transport: serving %s (%s) for run %s", self.address, security, self.run_id)
        if security == "TLS" and not loopback(self.settings.host):
            log.warning("direct transport: TLS without transport-client-ca: whoever reaches port %d can open calls, "
                        "and a node's token alone speaks for it; set transport-client-ca (docs/transport.md, Trust "
                        "model)", port)  # fmt: skip
        return self.address

    def stop(self) -> None:
        self.server.stop()

    def __enter__(self) -> RunTransport:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------ a round's messages
    def offer(
        self,
        server_round: int,
        node: int,
        records: Mapping[str, Mapping[str, object]],
        upload_max_size: int | None,
        ahead: tuple[int, int] | None = None,
        content_ahead: bool = False,
        reply: int = 0,
    ) -> TransportOffer:
        """What ``node``'s round-r message carries in place of ``records`` (message record name -> its arrays'
        npy payloads): each non-empty record published once per round (by identity: the same mapping for
        every node is one record) with a download capability for ``node``, and an upload capability bounded
        by ``upload_max_size`` (None: the message asks for no update), and with ``reply`` (the node's message of
        the round, counted from 1; 0: none) one to upload the reply's own content (``take_reply``). Capabilities
        expire with ``ttl_s``.

        ``ahead`` (the bounds of round r+1's update and global step; None: none) adds round r+1's capabilities
        (``ahead_offer``), so that the node moves those bytes before round r+1's message comes, and with
        ``content_ahead`` its worker takes round r+1's content too (``content_ahead``)."""
        registry = self.server.registry
        offers = []
        for record, source in records.items():
            if not len(source):
                continue  # an empty record (round 1's global step): nothing to move
            name, size, sha256 = self._publish(server_round, record, source)
            ticket = registry.issue(self.run_id, node, server_round, Direction.DOWNLOAD, name, ttl_s=self.ttl_s)
            offers.append(RecordOffer(record, name, size, sha256, ticket.token.hex()))
        upload_name = upload_token = ""
        if upload_max_size is not None:
            upload_name = self.upload_name(server_round, node)
            ticket = registry.issue(self.run_id, node, server_round, Direction.UPLOAD, upload_name, ttl_s=self.ttl_s,
                                    max_size=upload_max_size)  # fmt: skip
            upload_token = ticket.token.hex()
        reply_name = reply_token = ""
        if upload_max_size is not None and reply:
            reply_name = self.reply_name(server_round, node, reply)
            ticket = registry.issue(self.run_id, node, server_round, Direction.UPLOAD, reply_name, ttl_s=self.ttl_s,
                                    max_size=MAX_REPLY_CONTENT)  # fmt: skip
            reply_token = ticket.token.hex()
        offer = TransportOffer(
            address=self.address, run_id=self.run_id, node_id=node, server_round=server_round, ca_pem=self.ca_pem,
            insecure=self.settings.insecure, records=tuple(offers), upload_name=upload_name,
            upload_token=upload_token, upload_max_size=upload_max_size or 0, reply_name=reply_name,
            reply_token=reply_token,
        )  # fmt: skip
        return offer if ahead is None else self.ahead_offer(offer, *ahead, message=content_ahead)

    def ahead_offer(
        self, offer: TransportOffer, update_max_size: int, step_max_size: int, message: bool = False
    ) -> TransportOffer:
        """``offer`` (round r) with round r+1's capabilities for its node: an upload into round r+1's own slot
        (``upload_name``), bounded by ``update_max_size`` (round r+1's block), and a download of round r+1's
        global step under the name it will be published by (``step_name``), bounded by ``step_max_size`` and
        waiting for its publication. Both are bound to round r+1 and expire when it may end (rounds r and
        r+1's timeouts), single use like any other; a node not messaged in round r+1 loses them then
        (``messaged``). ``message``: round r+1's message will be pushed ahead to this node (``message_ahead_offer``),
        and its worker gets a capability to download that message's content itself (``content_ahead``)."""
        registry, node, ahead_round = self.server.registry, offer.node_id, offer.server_round + 1
        up_name, step_name = self.upload_name(ahead_round, node), self.step_name(ahead_round)
        up = registry.issue(self.run_id, node, ahead_round, Direction.UPLOAD, up_name, ttl_s=2 * self.ttl_s,
                            max_size=update_max_size)  # fmt: skip
        with self._lock:
            nodes = self._ahead_nodes.setdefault(ahead_round, set())
            nodes.add(node)
            waiting = self._waiting_steps.setdefault(ahead_round, set())
            # A waiting download holds one of the service's workers until the step is out: at most half of
            # them wait, so that the round's uploads and fetches always find one; the others fetch the step
            # when their message comes.
            # A retried message issues no second one (a node that never replies would hold more).
            waits = node not in waiting and self._waits(ahead_round) < self.server.max_workers // 2
            if waits:
                waiting.add(node)
        offer = dataclasses.replace(
            offer, ahead_upload_name=up_name, ahead_upload_token=up.token.hex(), ahead_upload_max_size=update_max_size
        )
        if waits:
            step = registry.issue(self.run_id, node, ahead_round, Direction.DOWNLOAD, step_name, ttl_s=2 * self.ttl_s,
                                  waits=True)  # fmt: skip
            offer = dataclasses.replace(
                offer, ahead_step_name=step_name, ahead_step_token=step.token.hex(), ahead_step_max_size=step_max_size
            )
        return self.content_ahead(offer) if message else offer

    def content_ahead(self, offer: TransportOffer) -> TransportOffer:
        """``offer`` (round r) with a capability for its node's worker to download round r+1's message content
        (``message_name``) as soon as the server publishes it, under the key round r+1's message pushed ahead
        will name too: the worker starts round r+1 then, not when Flower delivers that message and starts a
        ClientApp. It takes the slot that message's own capability would (one download of the content waits
        per node: the ClientApp hands its capability to the worker, which uses it only without its own). Not
        issued when the service's workers that may wait are taken, nor again to a retried message."""
        node, ahead_round = offer.node_id, offer.server_round + 1
        with self._lock:
            reserved = self._reserve_content(ahead_round, node)
        if reserved is None or not reserved[1]:
            return offer
        name, token = self._content_capability(ahead_round, node)
        return dataclasses.replace(
            offer, ahead_message_name=name, ahead_message_token=token, ahead_message_key=reserved[0].hex()
        )

    def _reserve_content(self, server_round: int, node: int) -> tuple[bytes, bool] | None:
        """(Under the lock.) ``node``'s round-r content: its HMAC key and whether it was reserved just now (a
        waiting slot taken); None when the service's workers that may wait are taken."""
        if (key := self._message_keys.get((server_round, node))) is not None:
            return key, False
        waiting = self._waiting_messages.setdefault(server_round, set())
        if node in waiting or self._waits(server_round) >= self.server.max_workers // 2:
            return None
        waiting.add(node)
        self._ahead_nodes.setdefault(server_round, set()).add(node)
        key = self._message_keys[(server_round, node)] = secrets.token_bytes(32)
        return key, True

    def _content_capability(self, server_round: int, node: int) -> tuple[str, str]:
        """A download capability for ``node``'s round-r content, waiting until it is published: its name and
        token (hex), living as long as round r may (rounds r-1 and r's timeouts)."""
        name = self.message_name(server_round, node)
        ticket = self.server.registry.issue(self.run_id, node, server_round, Direction.DOWNLOAD, name,
                                            ttl_s=2 * self.ttl_s, waits=True)  # fmt: skip
        return name, ticket.token.hex()

    def _waits(self, server_round: int) -> int:
        """Downloads of round r's records that may wait on the service (under the lock)."""
        return len(self._waiting_steps.get(server_round, ())) + len(self._waiting_messages.get(server_round, ()))

    def message_ahead_offer(self, server_round: int, node: int) -> TransportOffer | None:
        """What ``node``'s message of round r carries when it is pushed a round ahead: a capability to download
        the message's content (``message_name``), which waits on the service until the content is published
        (``publish_message``) or the node is found not to be messaged in round r (``messaged`` revokes it).
        Bound to run, node and round r, single use, living as long as round r may (rounds r-1 and r's timeouts).
        None when the service's workers that may wait are all taken (the message then goes on Flower's path).
        A node whose worker was given a capability for the same content (``content_ahead``) gets a second one
        under the same key, in the slot already taken: its ClientApp hands it to the worker."""
        with self._lock:
            if (server_round, node) in self._messages_ahead:
                return None
            if (reserved := self._reserve_content(server_round, node)) is None:
                return None
            self._messages_ahead.add((server_round, node))
        name, token = self._content_capability(server_round, node)
        return TransportOffer(
            address=self.address, run_id=self.run_id, node_id=node, server_round=server_round, ca_pem=self.ca_pem,
            insecure=self.settings.insecure, message_name=name, message_token=token,
            message_max_size=MAX_MESSAGE_CONTENT, message_key=reserved[0].hex(),
        )  # fmt: skip

    def publish_message(self, server_round: int, node: int, content: bytes, pushed: bool = True) -> None:
        """``node``'s round-r message content, for its download waiting under ``message_ahead_offer``'s
        capability, behind its HMAC under the key that offer gave the node (``framing.seal``);
        ``b""`` withdraws the message (the node was messaged on Flower's path instead): its ClientApp
        replies that it was withdrawn, and the server drops that reply. ``pushed``: a message was pushed ahead
        for this content (counted, published or withdrawn); else ``b""`` only ends the wait of its node's worker."""
        name = self.message_name(server_round, node)
        with self._lock:
            key = self._message_keys.pop((server_round, node))
        data = seal(key, content) if content else b""
        self.server.outbox.publish(name, data=data)
        with self._lock:
            self._published.setdefault(server_round, {})[name] = (data, name, len(data), "")  # by name: b"" is shared
            if pushed:
                self._ahead["direct_messages_ahead" if content else "direct_messages_withdrawn"] += 1

    def content_awaited(self, server_round: int, node: int) -> bool:
        """Whether a download of ``node``'s round-r message content may be waiting (a capability for it was
        issued, and nothing is published yet): ``publish_message`` must then end it, with the content or
        ``b""``."""
        with self._lock:
            return (server_round, node) in self._message_keys

    @staticmethod
    def message_name(server_round: int, node: int) -> str:
        """A node's message content of a round on the service."""
        return f"r{server_round}/message/{node}"

    def messaged(self, server_round: int, nodes: set[int]) -> int:
        """Round r's messages are built, for ``nodes``: capabilities issued a round ahead to any other node (not
        sampled, excluded) are revoked, and its waiting download ends without the step; then round r's step
        goes to the downloads waiting for it (published ``held`` until now, so that a revoked node never gets
        it). Counted (``direct_ahead_revoked``, nodes), not refused: nothing was attempted against the rules."""
        with self._lock:
            unmessaged = sorted(self._ahead_nodes.pop(server_round, set()) - set(nodes))
            self._ahead["direct_ahead_revoked"] += len(unmessaged)
        for node in unmessaged:
            self.server.registry.revoke(self.run_id, server_round, node)
        if unmessaged:
            log.info("direct transport: round %d's capabilities issued ahead to nodes %s revoked (not messaged in "
                     "round %d)", server_round, unmessaged, server_round)  # fmt: skip
        self.server.outbox.release(self.step_name(server_round))
        return len(unmessaged)

    def moved_ahead(self, update: bool, step: bool, content: bool = False) -> None:
        """A reply says its update moved before its message came (``update``), its global step was fetched
        before it (``step``), and its worker started the round from its content on the stream (``content``):
        counted for the round's record."""
        with self._lock:
            self._ahead["direct_updates_ahead"] += int(update)
            self._ahead["direct_steps_prefetched"] += int(step)
            self._ahead["direct_contents_fetched"] += int(content)

    @staticmethod
    def step_name(server_round: int) -> str:
        """The global step of round r on the service: a name both sides know a round ahead."""
        return f"r{server_round}/{GLOBAL_STEP}"

    @staticmethod
    def reply_name(server_round: int, node: int, attempt: int) -> str:
        """A node's reply content to its ``attempt``-th message of a round on the service (``is_reply``): a
        retried message's reply has a slot of its own (nothing commits a reply's content, as a reply commits its
        update: the first attempt's, come late, must not pass for the retry's)."""
        return f"r{server_round}/reply/{node}/{attempt}"

    @staticmethod
    def upload_name(server_round: int, node: int) -> str:
        """A node's update of a round on the service: one name per node and round, so that a retried
        message's new capability and the first one's upload meet in the same slot."""
        return f"r{server_round}/update/{node}"

    def _publish(self, server_round: int, record: str, source: Mapping[str, object]) -> tuple[str, int, str]:
        with self._lock:
            published = self._published.setdefault(server_round, {})
            if id(source) in published:
                return published[id(source)][1:]
            self._names += 1
            name, held = f"r{server_round}/{record}/{self._names}", False
            if record == GLOBAL_STEP and all(n != self.step_name(server_round) for _, n, _, _ in published.values()):
                name, held = self.step_name(server_round), True  # the round's step: downloads issued ahead wait
            out = self.server.outbox.publish(name, data=framed(source), held=held)  # the payloads, not a copy
            published[id(source)] = (source, name, out.size, out.sha256)  # the source held: its id stays its own
            return name, out.size, out.sha256

    # ------------------------------------------------------------ a node's reply
    def claim(self, server_round: int, node: int, commit: UpdateCommit) -> dict[str, memoryview | bytes] | None:
        """The npy payload of each array of ``node``'s uploaded update (read-only, never written again), when its
        SHA-256 and size are the reply's ``commit``; None when nothing was uploaded under this round's name. A
        different digest or size, or bytes that are not a framed record, raise ``Refused`` (counted; the reply is
        rejected). The payloads were read from the upload as it arrived (``service.Inbox``); only this hands them
        over."""
        name = self.upload_name(server_round, node)
        try:
            return self.server.inbox.claim(
                self.run_id, node, server_round, name, commit.update_sha256, commit.update_size
            )
        except Refused as refused:  # counted by the inbox
            log.warning("transport %s", refused.line())
            raise
        except FramingError as err:
            self._refuse(Refused(RefusalKind.BAD_HEADER, str(err)))

    def landed_update(self, server_round: int, node: int) -> dict[str, memoryview | bytes] | None:
        """The npy payload of each array of ``node``'s round-r update uploaded so far, unclaimed (``claim`` still
        hands over the same payloads, under the reply's digest), or None: for work started before the reply
        comes that is kept only if the reply commits these very bytes (``FedBCD.prepare_pass_ahead``)."""
        return self.server.inbox.peek(self.run_id, node, server_round, self.upload_name(server_round, node))

    def landing_update(self, server_round: int, node: int, last: str) -> tuple[dict[str, memoryview], Callable] | None:
        """``node``'s round-r update while it still arrives in memory, once every array but ``last`` (its values,
        the last on the wire) has landed (``framing.landed_far_enough``): the npy payload of each array over all its
        declared bytes, and what waits for them (``wait_until``: an address in them), for a pass over its values as
        they land (``wire.LandingArrays``); else None. As ``landed_update``'s, kept only where the reply commits the
        bytes that then lie there."""
        name = self.upload_name(server_round, node)
        upload = self.server.inbox.landing(self.run_id, node, server_round, name)
        if upload is None:
            return None
        try:
            payloads = landed_far_enough(upload.landing(), len(upload), name, last)
        except FramingError:  # its claim refuses it once it has landed
            return None
        return None if payloads is None else (payloads, upload.wait_until)

    def take_reply(self, server_round: int, node: int, attempt: int) -> bytes | None:
        """``node``'s reply content to its ``attempt``-th round-r message, as uploaded under its capability
        (``offer``'s ``reply``), or None when none came."""
        return self.server.inbox.take(self.run_id, node, server_round, self.reply_name(server_round, node, attempt))

    def wait_for_upload(self, timeout_s: float) -> None:
        """Until an upload is held (a reply's content, say) or ``timeout_s`` passes; the next wait waits for the
        next one. Call it after checking what is held: an upload held meanwhile ends it at once."""
        inbox = self.server.inbox
        inbox.arrived.wait(timeout_s)
        inbox.arrived.clear()

    def count(self, name: str, n: int = 1) -> None:
        """A count of the round's record (one of ``end_round``'s ``direct_*``) raised by ``n``."""
        with self._lock:
            self._ahead[name] += n

    def refused(self, refused: Refused, then: str = "") -> None:
        """A refusal the server itself made (not the service's), counted and said in one line."""
        self.server.refusals.add(refused)
        log.warning("transport %s%s", refused.line(), f"; {then}" if then else "")

    def _refuse(self, refused: Refused) -> None:
        self.refused(refused)
        raise refused

    def fell_back(self, node: int, reason: str) -> None:
        """``node`` moved a message's bytes on Flower's path instead: counted, and logged once per node."""
        with self._lock:
            self._fallbacks += 1
            first = node not in self._fallen_back
            self._fallen_back.add(node)
        if first:
            log.warning("direct transport: node %d uses Flower's path (%s); counted in direct_fallbacks, logged "
                        "once per node", node, reason)  # fmt: skip

    def end_round(self, server_round: int) -> dict[str, int]:
        """Forget round r (its capabilities, published records and unclaimed uploads); the round's counts
        for its record: fallbacks, and refusals in all and by kind since the last ``end_round``."""
        server = self.server
        server.registry.drop_round(self.run_id, server_round)
        with self._lock:
            for _, name, _, _ in self._published.pop(server_round, {}).values():
                server.outbox.retire(name)
            fallbacks, self._fallbacks = self._fallbacks, 0
            ahead = dict(self._ahead)
            self._ahead = dict.fromkeys(ahead, 0)
            self._ahead_nodes.pop(server_round, None)
            self._waiting_steps.pop(server_round, None)
            self._waiting_messages.pop(server_round, None)
            self._message_keys = {k: v for k, v in self._message_keys.items() if k[0] > server_round}
            self._messages_ahead = {k for k in self._messages_ahead if k[0] > server_round}
        server.inbox.drop_round(self.run_id, server_round)
        counts = server.refusals.counts()
        new = {k: v - self._refusals_counted.get(k, 0) for k, v in counts.items()}
        self._refusals_counted = counts
        record = {"direct_fallbacks": fallbacks, "direct_refusals": sum(new.values()), **ahead, **self._turned_away()}
        record.update({f"direct_refused_{kind}": n for kind, n in sorted(new.items()) if n})
        return record

    def _turned_away(self) -> dict[str, int]:
        """What the service did apart from refusals since the last ``end_round``: requests under a revoked
        capability turned away, downloads whose wait ended without their record, uploads received into a
        file instead of memory, calls cancelled because their capability ended (a peer that stopped reading)."""
        now = {"direct_revoked_used": self.server.revoked_used, "direct_waits_ended": self.server.waits_ended,
               "direct_uploads_spilled": self.server.inbox.spilled,
               "direct_calls_cancelled": self.server.calls.cancelled}  # fmt: skip
        new = {k: v - self._service_counted.get(k, 0) for k, v in now.items()}
        self._service_counted = now
        return new
