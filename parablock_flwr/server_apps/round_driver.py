"""A round's messages out and its replies in, against the round's deadline: the run's driver.

``RoundDriver`` pushes what the algorithm built through the run's ``Channel`` and Flower's Grid, and hands
each reply over as soon as it is pulled, until every node has answered or ``round-timeout-s`` passes. What it
saw happen to messages (not taken by the Grid, unanswered, late, withdrawn) it counts, and it stamps when a
round's replies came; the run reads both into the round's record. It decides nothing about the algorithm
and writes nothing to disk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator

from flwr.app import Message
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid

from ..records import flower_ready
from ..strategies.round_stats import array_bytes
from ..transport.channel import Channel

log = logging.getLogger(__name__)

AUDIT_GRACE_S = 30.0  # the run's end waits this long, at most, for Flower's replies that audit the last ones


def expired_unanswered(reply: Message) -> bool:
    """The SuperLink's own reply to a message that expired (its TTL) before its node answered."""
    return (
        reply.metadata.src_node_id == SUPERLINK_NODE_ID
        and reply.has_error()
        and reply.error.code in (ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE)
    )


class RoundDriver:
    """Push and pull for one run: ``push``, ``push_ahead``, ``replies``, ``close``.

    ``batch_limit``: a push is sent in batches of at most this many bytes of arrays (one model's worth), so that
    catch-ups for many nodes never sit in memory together. ``counts`` and ``times`` are the round's, reset by
    ``new_round``; ``arrivals`` (node -> when its reply came) until the run takes them (``take_arrivals``).
    """

    def __init__(self, channel: Channel, round_timeout_s: float, pull_interval_s: float, batch_limit: int):
        self.channel = channel
        self.round_timeout_s = round_timeout_s
        self.pull_interval_s = pull_interval_s
        self.batch_limit = batch_limit
        self.counts = self.new_counts()
        # Wall-clock stamps (time.time, comparable with the node workers' on one host): the round's first push,
        # its first reply checked, the last reply (kept until the next one: the next round's record reads it).
        self.times: dict[str, float] = {}
        self.arrivals: dict[int, float] = {}
        self._deadline = 0.0  # time.monotonic() at which the round's outstanding replies are abandoned
        self._abandoned: dict[str, tuple[int, float]] = {}  # message id -> (node, when it expires)
        self._withdrawn: dict[str, tuple[int, float]] = {}  # messages pushed ahead, withdrawn: the same

    @staticmethod
    def new_counts() -> dict[str, int]:
        return {"messages_not_pushed": 0, "replies_missing": 0, "late_replies_dropped": 0, "round_retries": 0}

    def new_round(self) -> None:
        """A round begins: its counts start from zero."""
        self.counts = self.new_counts()

    def take_arrivals(self) -> dict[int, float]:
        """Each node's reply time since the last call (the round's clock reads them once)."""
        arrivals, self.arrivals = self.arrivals, {}
        return arrivals

    # ------------------------------------------------------------ messages out
    def push(self, grid: Grid, messages: Iterable[Message], ahead_round: int | None = None) -> dict[str, int]:
        """Push ``messages`` (each expires after ``round-timeout-s``); returns message id -> node for those the
        Grid took, with the round's deadline counted from now. ``ahead_round``: round r's first push, whose
        message to a node that has one pushed a round ahead (``push_ahead``) is not pushed but published for it
        (``Channel.deliver``: that message's id stands for it); those no message took are withdrawn.

        ``messages`` may be a generator: they are built and pushed in batches of at most ``batch_limit`` bytes.
        A message the Grid did not take (an empty or ``None`` id) is logged and counted
        (``messages_not_pushed``); its node is then one that did not answer."""
        sent: dict[str, int] = {}
        batch: list[Message] = []
        batch_bytes = 0
        for msg in messages:
            if ahead_round is not None and (mid := self.channel.deliver(msg, ahead_round)) is not None:
                sent[mid] = msg.metadata.dst_node_id
                continue
            msg.metadata.ttl = self.round_timeout_s
            batch.append(msg)
            batch_bytes += array_bytes(msg.content)
            if batch_bytes >= self.batch_limit:
                sent.update(self._push_batch(grid, batch))
                batch, batch_bytes = [], 0
        sent.update(self._push_batch(grid, batch))
        if ahead_round is not None:
            self.withdraw(ahead_round)
            self.times["pushed"] = time.time()
            self.times.pop("first_reply_checked", None)
        self._deadline = time.monotonic() + self.round_timeout_s
        return sent

    def resend(self, grid: Grid, messages: Iterable[Message]) -> dict[str, int]:
        """A round re-sent to the nodes without a valid reply (``push``), counted in ``round_retries``."""
        self.counts["round_retries"] += 1
        return self.push(grid, messages)

    def push_ahead(self, grid: Grid, server_round: int, nodes: set[int]) -> None:
        """Round r's messages pushed now, while round r-1 is in flight, to those of ``nodes`` the channel gives
        one (``Channel.message_ahead``: with the direct transport, nodes whose last reply committed its update on
        the stream): Flower delivers each as soon as its SuperNode has pushed round r-1's reply, and the node's
        worker waits on the stream for the content round r's push publishes. They live until round r may end."""
        messages = [m for n in sorted(nodes) if (m := self.channel.message_ahead(server_round, n)) is not None]
        taken = {mid for mid in grid.push_messages([flower_ready(m) for m in messages]) if mid} if messages else set()
        for msg in messages:
            if msg.metadata.message_id in taken:
                self.channel.pushed(server_round, msg.metadata.dst_node_id, msg.metadata.message_id)

    def withdraw(self, server_round: int, nodes: set[int] | None = None) -> None:
        """Round r's messages pushed ahead that no message took (or those to ``nodes``) are withdrawn: their
        replies are pulled and dropped until their messages expire."""
        expiry = time.monotonic() + 2 * self.round_timeout_s
        withdrawn = self.channel.withdraw(server_round, nodes)
        self._withdrawn.update({mid: (node, expiry) for mid, node in withdrawn.items()})

    def _push_batch(self, grid: Grid, batch: list[Message]) -> dict[str, int]:
        if not batch:
            return {}
        taken = {mid for mid in grid.push_messages([flower_ready(m) for m in batch]) if mid}
        sent = {}
        for msg in batch:
            if msg.metadata.message_id in taken:
                sent[msg.metadata.message_id] = msg.metadata.dst_node_id
            else:
                log.warning("the Grid did not take the message to node %d", msg.metadata.dst_node_id)
                self.counts["messages_not_pushed"] += 1
        return sent

    # ------------------------------------------------------------ replies in
    def replies(self, grid: Grid, sent: dict[str, int], server_round: int = 0) -> Iterator[Message]:
        """Each reply to ``sent`` as soon as it is pulled (every ``pull-interval-s``), until all have come or the
        deadline (``round-timeout-s`` after the push) passes, as the channel hands it over (``Channel.incoming``:
        with the direct transport, the update committed on the stream taken from it, checked by its digest); a
        reply whose content came on the stream is taken as soon as it is in (``Channel.replies_from_stream``,
        woken by its upload), its Flower reply pulled later as its audit (``Channel.audit``).

        Messages still unanswered at the deadline are abandoned: they expire on the SuperLink at the same time
        (their TTL), and a reply to one that still arrives later is pulled and dropped, counted in the round that
        pulls it (``late_replies_dropped``). The SuperLink's notice that a message expired unanswered is no
        reply: its node is missing, whether the notice comes just before the deadline (the TTL counts from the
        message's creation, a moment before the push) or after it. (Flower 1.42's SuperLink sends that notice for
        an expired message even when a reply came in time: a first pull later than ``round-timeout-s``, after a
        previous round's slow record, finds the round's nodes missing.)"""
        waiting, first_pull, channel = dict(sent), True, self.channel
        # At least one pull: what ran since the push (the previous round's record and checkpoint)
        # may have outlasted the deadline, and replies that came in time are waiting on the SuperLink.
        while waiting and (first_pull or time.monotonic() < self._deadline):
            first_pull = False
            for reply in channel.replies_from_stream(server_round, waiting):
                node = waiting.pop(reply.metadata.reply_to_message_id)
                self._arrived(node)
                yield channel.incoming(reply, server_round, node)
            audits = set(channel.audits)
            ids = set(waiting) | set(self._abandoned) | set(self._withdrawn) | audits
            pulled = list(grid.pull_messages(ids))[::-1] if waiting or audits else []
            while pulled:  # each reply leaves the list as it is checked: the pull holds none of them after
                reply = pulled.pop()
                if (node := self._round_reply(reply, waiting)) is not None:
                    self._arrived(node)
                    yield channel.incoming(reply, server_round, node)
            if waiting:
                channel.wait_for_replies(self.pull_interval_s)  # a reply on the stream may end it early
        channel.expire_audits()
        now = time.monotonic()
        self._abandoned = {m: v for m, v in self._abandoned.items() if v[1] > now}  # expired on the SuperLink
        self._withdrawn = {m: v for m, v in self._withdrawn.items() if v[1] > now}
        for mid, node in waiting.items():
            self._missing(node, "it did not answer")
            self._abandoned[mid] = (node, now + self.round_timeout_s)

    def _round_reply(self, reply: Message, waiting: dict[str, int]) -> int | None:
        """The node of a pulled reply to check now (its message leaves ``waiting``), or None for one dealt with
        here: an audit of a reply taken from the stream, a notice that a message expired, a late reply, the
        reply to a message withdrawn, or one to a message not ours."""
        mid = reply.metadata.reply_to_message_id
        if self.channel.audit(reply):
            return None
        if expired_unanswered(reply):
            self._abandoned.pop(mid, None)
            self._withdrawn.pop(mid, None)
            if mid in waiting:
                self._missing(waiting.pop(mid), "its message expired on the SuperLink before a reply")
            return None
        if mid in self._abandoned:
            node, _ = self._abandoned.pop(mid)
            self.counts["late_replies_dropped"] += 1
            log.warning("dropped a late reply of node %d (its round had ended)", node)
            return None
        if mid in self._withdrawn:  # a message pushed ahead that the server withdrew: counted then
            self._withdrawn.pop(mid)
            return None
        return waiting.pop(mid, None)  # None: not a message of ours, nothing to check it against

    def _arrived(self, node: int) -> None:
        """``node``'s reply is in, to be checked now."""
        self.times["last_reply"] = self.arrivals[node] = time.time()
        self.times.setdefault("first_reply_checked", self.times["last_reply"])  # checked on arrival

    def _missing(self, node: int, why: str) -> None:
        log.warning("node %d: %s within round-timeout-s=%g", node, why, self.round_timeout_s)
        self.counts["replies_missing"] += 1

    def pull_audits(self, grid: Grid) -> None:
        """Flower's replies that audit replies taken from the stream, those in now (``Channel.audit``)."""
        if self.channel.audits:
            for reply in grid.pull_messages(set(self.channel.audits)):
                self.channel.audit(reply)

    def close(self, grid: Grid, after_round: int) -> dict[str, int]:
        """The run is over: Flower's replies that audit the last replies taken from the stream are awaited (at
        most ``AUDIT_GRACE_S``, or ``round-timeout-s`` if shorter), those that did not come are counted, and the
        channel stops. Returns what the channel counted since the last round's record (the final evaluation's
        fallbacks, those audits, anything refused until it stopped), its rounds up to ``after_round`` forgotten."""
        until = time.monotonic() + min(AUDIT_GRACE_S, self.round_timeout_s)
        while self.channel.audits and time.monotonic() < until:
            self.pull_audits(grid)
            if self.channel.audits:
                time.sleep(self.pull_interval_s)
        self.channel.expire_audits(every=True)  # those that did not come: unaudited, said and counted
        self.channel.stop()
        return self.channel.end_round(after_round)
