"""``transport = "direct"`` in the ServerApp: each message's block records moved onto the run's stream before
the push, and each reply's committed update taken from it after the pull, so that everything between (the
algorithm's messages, the reply checks, ``wire.unpack``, the bytes counted per round) is what Flower's
path gives (docs/transport.md).

A node's records go on the stream until it shows it cannot use it: a reply that carries its update inline
with ``direct-fallbacks`` (its upload failed, or its site keeps to Flower's path), or an error reply that
says it could not fetch them (``messages.STREAM_UNUSABLE``). Its next messages then carry their records
inline, with an upload capability still, and the first update it commits on the stream brings it back.
Each such message is counted (``direct_fallbacks``) and logged once per node (``RunTransport.fell_back``).

A node whose last reply committed its update on the stream gets its next round's message pushed a round
ahead (``message_ahead``): Flower delivers it and starts the node's ClientApp while this round is still
being aggregated. The node's worker (its capability came in this round's offer, ``outgoing``) waits on the
stream for the content ``deliver`` publishes once the algorithm has built it, and starts that round with it;
the ClientApp gets the round's answer from the worker (a node without a worker: its ClientApp waits for the
content). Flower's delivery and the ClientApp's start leave the critical path.

With ``transport-replies-on-stream``, a node's worker also uploads its reply's content (metrics, trace and the
commit of its update, once the update is up) under a capability its round's offer gave: ``replies_on_stream``
hands it to the run as that node's reply as soon as it is in, and it is checked and aggregated as Flower's
would be. Flower's reply still comes, relayed by the node's ClientApp, and trails as the audit of the reply
taken (``audit``): the same commit, counted (``direct_replies_audited``); another, counted, said, and the node's
replies go on Flower's path from then on (``direct_replies_contradicted``); none before the message expires, or
an error, counted (``direct_replies_unaudited``). Flower's round trip leaves the critical path; the trust that
aggregation rests on is then the capability's (docs/transport.md, "Trust model").
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from flwr.app import ConfigRecord, Error, Message, MessageType, Metadata, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode

from ..messages import (
    BLOCK_RECORDS,
    COMMIT,
    MESSAGE_AHEAD,
    METRICS,
    OFFER,
    PROTOCOL_KEY,
    ROUND,
    STREAM_UNUSABLE,
    UPDATE,
    MessageError,
    UpdateCommit,
    key,
)
from ..npy import npy_view
from ..records import payloads_record
from ..versions import PROTOCOL_VERSION
from ..wire import VALUES, LandingArrays
from .capabilities import RefusalKind, Refused
from .channel import Channel
from .message_bytes import content_to_bytes, reply_from_bytes
from .server_side import RunTransport

log = logging.getLogger(__name__)
FALLBACKS = key("direct_fallbacks")
UPDATE_AHEAD, STEP_PREFETCHED = key("direct_update_ahead"), key("direct_step_prefetched")
CONTENT_FETCHED = key("direct_content_fetched")
DIRECT = "direct transport:"  # what a reply rejected here says first
# A node with more replies than this taken from the stream and not yet audited (Flower's cycle per message is
# slower than the rounds) gets no message and no content a round ahead: its next round waits for Flower's
# message, so that Flower's backlog of its messages stays bounded however short the rounds.
AUDITS_BEHIND = 2
CLIENTAPP_STAMPS = key("clientapp_")  # the metrics the ClientApp adds to its reply: left out of the audit


class Audit(NamedTuple):
    """A reply taken from the stream, awaiting Flower's reply to the same message."""

    node: int
    digest: str  # ``audit_digest`` of its content
    expires: float  # time.monotonic() past which Flower's reply can no longer come


def audit_digest(content: RecordDict) -> str:
    """The SHA-256 of what a reply says, as the stream's reply and Flower's reply to the same message must both
    say it: its metrics (but the ClientApp's own stamps), its trace and the commit of its update."""
    said = {name: {k: v for k, v in record.items() if not k.startswith(CLIENTAPP_STAMPS)}
            for name, record in (*content.metric_records.items(), *content.config_records.items())}  # fmt: skip
    return hashlib.sha256(json.dumps(said, sort_keys=True, default=repr).encode()).hexdigest()


class DirectChannel(Channel):
    """The run's side of ``transport = "direct"`` around Flower's messages (the module's docstring)."""

    updates_land_ahead = True  # a node's update is uploaded before its reply (ParaBlock's: a round ahead)

    def __init__(self, transport: RunTransport, replies_on_stream: bool = False):
        super().__init__()
        self.transport = transport
        self.replies_on_stream = replies_on_stream  # the run config's ``transport-replies-on-stream``
        # Flower's replies awaited as the audit of a reply taken from the stream (``audits``: message id -> its
        # ``Audit``); nodes whose audit contradicted them; each node's message of a round, counted (a retry is
        # another attempt, whose reply has a slot of its own on the stream).
        self.audits: dict[str, Audit] = {}
        self.replies_distrusted: set[int] = set()
        self._attempts: dict[tuple[int, int], int] = {}
        self.on_stream: dict[int, bool] = {}  # node -> whether its records go on the stream (default: yes)
        self.committed: set[int] = set()  # nodes whose last reply committed its update on the stream
        # round -> node -> (the id of its message pushed a round ahead, when that message expires)
        self.pushed_ahead: dict[int, dict[int, tuple[str, float]]] = {}
        self._withdrawn: dict[str, int] = {}  # message id -> node: withdrawn by ``deliver``, for ``withdraw``

    def outgoing(
        self, messages: Iterable[Message], server_round: int, update_bound: Callable[[int], int] | None,
        last_round: bool, first: bool, messages_ahead: bool,
    ) -> Iterator[Message]:  # fmt: skip
        """Each of ``messages`` with its block records on the stream (``message_on_stream``), with a capability to
        upload the round's update bounded by ``update_bound(r)`` (None: the messages ask for none) and, but in the
        last round, round r+1's capabilities (its update's bound and this round's block's, for g^r). After the
        round's ``first`` push (not a retry's), nodes it did not message lose theirs for round r."""
        bound = ahead = None
        if update_bound is not None:
            bound = update_bound(server_round)
            if not last_round:
                ahead = (update_bound(server_round + 1), bound)
        nodes = set()
        for msg in messages:
            nodes.add(msg.metadata.dst_node_id)
            yield self.message_on_stream(msg, server_round, bound, ahead, messages_ahead)
        if update_bound is not None and first:  # every node of the round is messaged: capabilities issued ahead end
            self.transport.messaged(server_round, nodes)

    def message_on_stream(
        self, msg: Message, server_round: int, upload_max_size: int | None, ahead: tuple[int, int] | None = None,
        messages_ahead: bool = False,
    ) -> Message:  # fmt: skip
        """``msg`` with its block records on the stream (unless its node is on Flower's path) and the offer
        in their place; ``upload_max_size``: the bound on the node's update (None: the message asks for none);
        ``ahead``: the bounds of round r+1's update and global step, whose capabilities a node on the stream
        gets now (``RunTransport.ahead_offer``; None: none, the last round). ``messages_ahead``: round r+1's
        message is pushed a round ahead to a node that gets one (``message_ahead``), and that node's worker gets a
        capability to take its content from the stream itself (``RunTransport.content_ahead``)."""
        node, content = msg.metadata.dst_node_id, msg.content
        records = {name: content.array_records[name] for name in BLOCK_RECORDS if name in content.array_records}
        if not self.on_stream.get(node, True):
            records, ahead = {}, None  # they stay in the message: this node fetches nothing, moves nothing ahead
        # The same test as ``message_ahead``'s for round r+1: no reply is taken between this push and that one.
        content_ahead = ahead is not None and messages_ahead and self._ahead_ok(node)
        attempt = 0
        if self.replies_on_stream and self.on_stream.get(node, True) and node not in self.replies_distrusted:
            attempt = self._attempts[(server_round, node)] = self._attempts.get((server_round, node), 0) + 1
        offer = self.transport.offer(server_round, node, records, upload_max_size, ahead, content_ahead, attempt)
        for name in records:
            del content[name]
        content[OFFER] = ConfigRecord(offer.to_config())
        return msg

    def message_ahead(self, server_round: int, node: int) -> Message | None:
        """``node``'s round-r message to push before round r-1 is aggregated, or None: only to a node whose
        last reply committed its update on the stream (a node on Flower's path, or not known to reach the
        stream, gets its message when it is built) and whose audits are not ``AUDITS_BEHIND`` behind, while the
        service has a worker to wait with."""
        if not self._ahead_ok(node):
            return None
        offer = self.transport.message_ahead_offer(server_round, node)
        if offer is None:
            return None
        round_config = ConfigRecord({PROTOCOL_KEY: PROTOCOL_VERSION, key("server_round"): server_round})
        content = RecordDict({ROUND: round_config, MESSAGE_AHEAD: ConfigRecord(offer.to_config())})
        return Message(content, dst_node_id=node, message_type=MessageType.TRAIN, ttl=2 * self.transport.ttl_s)

    def pushed(self, server_round: int, node: int, message_id: str) -> None:
        """``message_ahead``'s message to ``node`` was taken by the SuperLink (its TTL counts from now)."""
        expires = time.monotonic() + 2 * self.transport.ttl_s
        self.pushed_ahead.setdefault(server_round, {})[node] = (message_id, expires)

    def deliver(self, msg: Message, server_round: int) -> str | None:
        """The id of the message pushed ahead to ``msg``'s node for round r, once ``msg``'s content (built by
        the algorithm, its records on the stream) is published for it; None when it has none, or when
        ``msg`` must go on Flower's path (tensors inline: a node that fell back), in which case the message
        pushed ahead is withdrawn."""
        node = msg.metadata.dst_node_id
        ahead = self.pushed_ahead.get(server_round, {}).pop(node, None)
        if ahead is None:
            if self.transport.content_awaited(server_round, node):  # its worker waits, its message goes on Flower's
                self.transport.publish_message(server_round, node, b"", pushed=False)
            return None
        message_id, expires = ahead
        # A round r-1 that ran long (a retry, a straggler) leaves the message pushed ahead (and its capability)
        # less than a round's time to live: the round's own message goes instead.
        content = content_to_bytes(msg.content) if expires - time.monotonic() > self.transport.ttl_s else None
        self.transport.publish_message(server_round, node, content or b"")
        if content is None:
            self._withdrawn[message_id] = node
            return None
        return message_id

    def withdraw(self, server_round: int, nodes: set[int] | None = None) -> dict[str, int]:
        """Round r's messages pushed ahead that no message took (their nodes not messaged), or those to
        ``nodes`` (round r-1 is re-sent to them: their SuperNodes would otherwise take the message pushed
        ahead first, and wait on it for round r-1 to end): message id -> node, whose replies (``WITHDRAWN``)
        the run drops. Their capabilities were revoked (``messaged``) or their content is withdrawn now."""
        pushed = self.pushed_ahead.get(server_round, {})
        left = {n: pushed.pop(n)[0] for n in list(pushed) if nodes is None or n in nodes}
        if nodes is None:
            self.pushed_ahead.pop(server_round, None)
        for node in left:
            self.transport.publish_message(server_round, node, b"")
        withdrawn, self._withdrawn = {**self._withdrawn, **{mid: node for node, mid in left.items()}}, {}
        return withdrawn

    def incoming(self, reply: Message, server_round: int, node: int) -> Message:
        """``reply`` with its committed update taken from the stream (as the ``update`` record Flower's path
        carries), or an error reply in its place saying why it must be rejected (``rejected``). A reply on
        Flower's path is returned as it is, its fallback noted."""
        why = self._take(reply, server_round, node)
        return reply if why is None else rejected(reply, why)

    def landed_updates(self, server_round: int, nodes: set[int]) -> dict[int, dict] | None:
        """Each of ``nodes``' round-r update uploaded and not yet claimed, as ``incoming`` will put it in its reply
        (``records.payloads_record`` over the same payloads: the arrays read the same memory), or still arriving,
        as ``wire.LandingArrays`` over the memory it lands in; None while one has not begun to land."""
        landed = {}
        for node in sorted(nodes):
            payloads, wait_until = self.transport.landed_update(server_round, node), None
            if payloads is None and (landing := self.transport.landing_update(server_round, node, VALUES)) is not None:
                payloads, wait_until = landing
            if payloads is None:
                return None
            arrays = {name: npy_view(payload, name) for name, payload in payloads.items()}  # npy, checked
            landed[node] = arrays if wait_until is None else LandingArrays(arrays, wait_until)
        return landed

    def _ahead_ok(self, node: int) -> bool:
        """Whether ``node`` gets its next round's message (and content) a round ahead: its last reply committed
        its update on the stream, and Flower is not more than ``AUDITS_BEHIND`` of its replies behind."""
        behind = sum(audit.node == node for audit in self.audits.values())
        return node in self.committed and self.on_stream.get(node, True) and behind <= AUDITS_BEHIND

    def replies_from_stream(self, server_round: int, waiting: dict[str, int]) -> list[Message]:
        """The replies of ``waiting``'s nodes (message id -> node) whose content came on the stream
        (``RunTransport.take_reply``, the slot of the node's last message of the round), each as the reply
        Flower would deliver to that message (``incoming`` takes its update next); Flower's reply to that
        message is then awaited as its audit. A content that is not a reply's is refused (counted, said) and
        changes nothing: the node's reply on Flower's path is awaited."""
        replies = []
        for message_id, node in waiting.items() if self.replies_on_stream else ():
            attempt = self._attempts.get((server_round, node))
            if attempt is None or node in self.replies_distrusted:
                continue
            if (data := self.transport.take_reply(server_round, node, attempt)) is None:
                continue
            try:
                content = reply_from_bytes(data)
                UpdateCommit.from_config(dict(content[COMMIT]))
            except MessageError as err:
                self.transport.refused(Refused(RefusalKind.BAD_REPLY, f"node {node} round {server_round}: {err}"),
                                       "its reply on Flower's path is awaited")  # fmt: skip
                continue
            metadata = Metadata(run_id=self.transport.run_id, message_id="", src_node_id=node,
                                dst_node_id=SUPERLINK_NODE_ID, reply_to_message_id=message_id, group_id="",
                                created_at=time.time(), ttl=self.transport.ttl_s,
                                message_type=MessageType.TRAIN)  # fmt: skip
            replies.append(Message(content=content, metadata=metadata))
            # Flower's reply can come as long as the message lives (a message pushed ahead: twice the timeout).
            expires = time.monotonic() + 2 * self.transport.ttl_s
            self.audits[message_id] = Audit(node, audit_digest(content), expires)
            self.transport.count("direct_replies_on_stream")
        return replies

    def audit(self, reply: Message) -> bool:
        """Whether ``reply`` is Flower's reply to a message whose reply came on the stream (the run then drops
        it): the audit of that reply, counted as the class's docstring says."""
        audit = self.audits.pop(reply.metadata.reply_to_message_id, None)
        if audit is None:
            return False
        if reply.has_error():
            self._unaudited(audit.node, f"its reply on Flower's path is an error ({str(reply.error.reason)[:80]})")
        elif audit_digest(reply.content) == audit.digest:
            self.transport.count("direct_replies_audited")
        else:
            self.transport.count("direct_replies_contradicted")
            self.replies_distrusted.add(audit.node)
            log.warning("direct transport: node %d's reply on Flower's path says another thing than its reply on the "
                        "stream, which the round took; counted in direct_replies_contradicted; its replies go on "
                        "Flower's path from now on", audit.node)  # fmt: skip
        return True

    def expire_audits(self, every: bool = False) -> None:
        """Audits whose Flower reply can no longer come (``every``: all, the run ends): their replies stay
        unaudited (counted, said)."""
        now = time.monotonic()
        for message_id in [m for m, audit in self.audits.items() if every or audit.expires <= now]:
            self._unaudited(self.audits.pop(message_id).node, "no reply on Flower's path while its message lived")

    def _unaudited(self, node: int, why: str) -> None:
        self.transport.count("direct_replies_unaudited")
        log.warning("direct transport: node %d's reply taken from the stream is not audited: %s; counted in "
                    "direct_replies_unaudited", node, why)  # fmt: skip

    def _take(self, reply: Message, server_round: int, node: int) -> str | None:
        if reply.has_error():
            if STREAM_UNUSABLE in str(reply.error.reason):
                self._fell_back(node, "it could not fetch the round's records from the stream")
            return None
        content = reply.content
        metrics = content.metric_records.get(METRICS)
        flags = {k: metrics is not None and type(metrics.get(k)) is int and metrics[k] == 1
                 for k in (UPDATE_AHEAD, STEP_PREFETCHED, CONTENT_FETCHED)}  # fmt: skip
        self.transport.moved_ahead(update=False, step=flags[STEP_PREFETCHED], content=flags[CONTENT_FETCHED])
        if COMMIT not in content.config_records:
            if metrics is not None and type(metrics.get(FALLBACKS)) is int and metrics[FALLBACKS] > 0:
                self._fell_back(node, "its update came inline")
            self.committed.discard(node)
            return None
        if UPDATE in content.array_records:
            return "a reply with both an update and a commit of one on the stream: expected one"
        try:
            commit = UpdateCommit.from_config(dict(content.config_records[COMMIT]))
            payloads = self.transport.claim(server_round, node, commit)
        except (MessageError, Refused) as err:
            return str(err) if isinstance(err, MessageError) else err.line()
        if payloads is None:
            return (f"its update ({commit.update_size} bytes) is committed but was not uploaded on the stream in round "
                    f"{server_round}")  # fmt: skip
        content[UPDATE] = payloads_record(payloads)  # read where they landed: nothing copied
        del content[COMMIT]
        self.on_stream[node] = True
        self.committed.add(node)
        self.transport.moved_ahead(update=flags[UPDATE_AHEAD], step=False)  # a committed update, claimed
        return None

    def _fell_back(self, node: int, why: str) -> None:
        self.on_stream[node] = False
        self.committed.discard(node)
        self.transport.fell_back(node, why)

    def end_round(self, server_round: int) -> dict[str, int]:
        """The round's counts for its record; its capabilities, records and unclaimed uploads forgotten."""
        self._attempts = {k: n for k, n in self._attempts.items() if k[0] > server_round}
        return self.transport.end_round(server_round)

    def wait_for_replies(self, seconds: float) -> None:
        """Between pulls: woken early by a reply's upload when replies come on the stream."""
        if self.replies_on_stream:
            self.transport.wait_for_upload(seconds)
        else:
            time.sleep(seconds)

    def stop(self) -> None:
        self.transport.stop()


def rejected(reply: Message, why: str) -> Message:
    """An error reply in place of ``reply`` (same sender, same message answered): the reply checks reject it
    with ``why``, and its node, whose update the server could not take, gets a full sync next."""
    return Message(error=Error(code=ErrorCode.UNKNOWN, reason=f"{DIRECT} {why}"), metadata=copy.copy(reply.metadata))
