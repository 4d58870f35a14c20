"""Capabilities for the direct transport: who may move which record's bytes, once, before when.

The server side issues one capability per node, round, direction and record, and sends it to that
node inside Flower's message, which Flower's TLS and node authentication protect. The stream
service (service.py) then accepts a capability once: it is bound to the run, node, round,
direction and record it was issued for, expires with the round's timeout, and a second use is
refused. Nothing here imports grpc or Flower, so the rules are tested without processes.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

TOKEN_BYTES = 32  # 256 bits: guessing one is out of reach
EXPIRED_KEPT_S = 600.0  # how long an expired capability is still refused as "expired" rather than unknown


class Direction(enum.StrEnum):
    UPLOAD = "upload"  # node -> server: the node's update
    DOWNLOAD = "download"  # server -> node: a step, catch-up, full sync or hand-back


class RefusalKind(enum.StrEnum):
    """Why the service refused a request; each kind is counted on its own."""

    BAD_HEADER = "bad_header"  # the first message is not a header this service reads
    BAD_CAPABILITY = "bad_capability"  # unknown token, or bound to another run, round or direction
    EXPIRED = "expired"  # the round's timeout passed
    REPLAYED = "replayed"  # the capability was used already (or is in use)
    FOREIGN_RECORD = "foreign_record"  # a node asks for a record its capability does not name
    OVERSIZED = "oversized"  # the declared size is above the bound, refused before any byte is read
    SIZE_MISMATCH = "size_mismatch"  # the bytes sent differ in length from the declared size
    DIGEST_MISMATCH = "digest_mismatch"  # the bytes' SHA-256 is not the declared one
    STALLED = "stalled"  # no message within the idle timeout
    TRICKLING = "trickling"  # bytes arrive below the minimum rate
    UNKNOWN_RECORD = "unknown_record"  # a download of a record not published
    BAD_REPLY = "bad_reply"  # a reply's content uploaded on the stream is not a reply's (the server reads it)
    LATE = "late"  # a transfer of a round that has ended (a slow node, one its round's deadline left out): no attack
    BUSY = "busy"  # a peer already holds its share of the service's calls (``service.Calls``)
    FOREIGN_PEER = "foreign_peer"  # a node's capability presented under another certificate than the node's own


class Refused(Exception):
    """A refusal: its kind, and one line of text that names values, never secrets or payload bytes."""

    def __init__(self, kind: RefusalKind, text: str):
        super().__init__(f"{kind}: {text}")
        self.kind = RefusalKind(kind)
        self.text = text

    def line(self) -> str:
        return f"refused {self.kind}: {self.text}"


class Revoked(Exception):
    """A request under a capability the server revoked: issued a round ahead to a node that round's messages
    then left out (not sampled, excluded). Not a refusal: nothing was attempted against the rules (a worker
    that trained ahead uploads as soon as it can); one line, counted apart from the refusals."""


PEERS_COUNTED = 256  # distinct peers counted one by one; the rest under OTHER_PEERS, so the count stays bounded
OTHER_PEERS = "other"


class Refusals:
    """Refusals counted by kind (what the round's record will carry) and by the peer that caused them (its
    certificate or, without one, its host: ``service.peer_identity``), never by the capability's node, whose
    token a thief may have presented. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._by_peer: Counter[str] = Counter()

    def add(self, refused: Refused, peer: str = "") -> None:
        with self._lock:
            self._counts[str(refused.kind)] += 1
            if peer:
                known = peer in self._by_peer or len(self._by_peer) < PEERS_COUNTED
                self._by_peer[peer if known else OTHER_PEERS] += 1

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def by_peer(self) -> dict[str, int]:
        """Refusals per peer identity, whatever their kind."""
        with self._lock:
            return dict(self._by_peer)


@dataclass(frozen=True)
class Ticket:
    """What a node receives in Flower's message to use the stream: the token and what it is bound to."""

    token: bytes = field(repr=False)  # a secret: never in a repr, a log line or an error
    run_id: int
    node_id: int
    round: int
    direction: Direction
    record: str


@dataclass
class _Grant:
    ticket: Ticket
    expires_at: float
    max_size: int | None
    waits: bool = False  # a download that waits for its record's publication (issued a round ahead)
    state: str = field(default="issued")  # issued -> in_use -> used; a refusal sends in_use back; or revoked, ended


def _key(token: bytes) -> bytes:
    """The registry's index: a hash of the token, so the lookup's timing says nothing about a guess."""
    return hashlib.sha256(token).digest()


class CapabilityRegistry:
    """The server side's capabilities: issue, check (constant time), reserve, finish, release.

    ``clock`` is injectable so that expiry is tested without sleeping.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._grants: dict[bytes, _Grant] = {}
        # (run, node) -> the certificate its first accepted request came under (``reserve``): the node's from then on
        self._pinned: dict[tuple[int, int], str] = {}

    def issue(
        self,
        run_id: int,
        node_id: int,
        round: int,
        direction: Direction,
        record: str,
        ttl_s: float,
        max_size: int | None = None,
        waits: bool = False,
    ) -> Ticket:
        """A fresh capability; ``ttl_s`` is the round's timeout, ``max_size`` bounds an upload's declaration.
        ``waits``: a download of a record not published yet waits for it (a capability issued a round ahead,
        whose record the server publishes when that round's messages are built) instead of being refused."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s={ttl_s!r}; expected a positive number of seconds (the round's timeout)")
        if Direction(direction) is Direction.UPLOAD and (max_size is None or max_size < 0):
            raise ValueError(f"max_size={max_size!r}; an upload capability needs a size bound >= 0")
        ticket = Ticket(secrets.token_bytes(TOKEN_BYTES), run_id, node_id, round, Direction(direction), record)
        with self._lock:
            self._prune()
            self._grants[_key(ticket.token)] = _Grant(ticket, self._clock() + ttl_s, max_size, waits)
        return ticket

    def reserve(self, claim: Ticket, size: int | None = None, certificate: str = "") -> Ticket:
        """Check ``claim`` (what a request presents) and mark its capability in use; a second request
        with it is refused as replayed. Refusals change nothing. ``size``: an upload's declared size.
        ``certificate``: the fingerprint of the client certificate the request came under (mutual TLS; empty
        without): once a node's transfer has completed under a certificate (``finish``), a capability of that
        node presented under any other is refused as ``foreign_peer``, so that a stolen token is useless without
        the node's key. A refused or broken transfer pins nothing."""
        with self._lock:
            grant = self._grants.get(_key(claim.token))
            if grant is None or not hmac.compare_digest(grant.ticket.token, claim.token):
                raise Refused(RefusalKind.BAD_CAPABILITY, "the capability is not one this server issued")
            mine = grant.ticket
            if (mine.run_id, mine.round, mine.direction) != (claim.run_id, claim.round, claim.direction):
                raise Refused(
                    RefusalKind.BAD_CAPABILITY,
                    f"the capability is for run {mine.run_id} round {mine.round} {mine.direction}, "
                    f"not run {claim.run_id} round {claim.round} {claim.direction}",
                )
            if (mine.node_id, mine.record) != (claim.node_id, claim.record):
                raise Refused(
                    RefusalKind.FOREIGN_RECORD,
                    f"node {claim.node_id} asks for record {claim.record!r}; the capability names "
                    f"node {mine.node_id}'s record {mine.record!r}",
                )
            pinned = self._pinned.get((mine.run_id, mine.node_id), "")
            if certificate and pinned and not hmac.compare_digest(pinned, certificate):
                raise Refused(RefusalKind.FOREIGN_PEER, f"node {mine.node_id}'s capability under certificate "
                              f"{certificate[:16]}; the node's is {pinned[:16]}")  # fmt: skip
            if grant.state == "ended":
                raise Refused(RefusalKind.LATE, f"round {mine.round} of run {mine.run_id} has ended")
            if grant.state == "revoked":
                raise Revoked(f"node {mine.node_id}'s capability for round {mine.round} was revoked: the round's "
                              f"messages left the node out")  # fmt: skip
            if self._clock() >= grant.expires_at:
                raise Refused(RefusalKind.EXPIRED, f"the capability for round {mine.round} expired")
            if grant.state != "issued":
                raise Refused(
                    RefusalKind.REPLAYED, f"the capability for {mine.record!r} was {grant.state.replace('_', ' ')}"
                )
            if mine.direction is Direction.UPLOAD:
                if size is None or grant.max_size is None or size > grant.max_size:
                    raise Refused(
                        RefusalKind.OVERSIZED, f"declared size {size} bytes; at most {grant.max_size} allowed"
                    )
            grant.state = "in_use"
            return mine

    def finish(self, ticket: Ticket, certificate: str = "") -> None:
        """The transfer completed: the capability is spent, and the node's first completed transfer under a
        client certificate binds its capabilities to it (``reserve``)."""
        self._set(ticket, "used")
        if certificate:
            with self._lock:
                self._pinned.setdefault((ticket.run_id, ticket.node_id), certificate)

    def release(self, ticket: Ticket) -> None:
        """The transfer was refused or broke: the capability is as before it (until it expires)."""
        self._set(ticket, "issued")

    def waits(self, ticket: Ticket) -> bool:
        """Whether a download under ``ticket`` waits for its record's publication."""
        with self._lock:
            grant = self._grants.get(_key(ticket.token))
            return grant is not None and grant.waits

    def alive(self, ticket: Ticket) -> bool:
        """Whether ``ticket``'s capability still holds: not expired, nor revoked, nor dropped with its round
        (what ends a download waiting for its record)."""
        with self._lock:
            grant = self._grants.get(_key(ticket.token))
            return grant is not None and grant.state not in ("revoked", "ended") and self._clock() < grant.expires_at

    def revoke(self, run_id: int, round: int, node_id: int) -> int:
        """Revoke ``node_id``'s capabilities of ``round`` (a node issued them a round ahead and not messaged
        in that round); how many. A request under one is then turned away as ``Revoked``, not refused, until
        it is pruned, after its expiry."""
        with self._lock:
            grants = [g for g in self._grants.values()
                      if (g.ticket.run_id, g.ticket.round, g.ticket.node_id) == (run_id, round, node_id)]  # fmt: skip
            for grant in grants:
                grant.state = "revoked"
            return len(grants)

    def drop_round(self, run_id: int, round: int) -> int:
        """End a round's capabilities (the round ended); how many. Each is kept, ended, until it is pruned after
        its expiry: a request under it is refused as ``late`` (a slow node's, not an attacker's: no token but
        the server's own is ever late), and a transfer under way with it cannot be finished. Revoked ones stay
        revoked: a left-out node's worker may finish its computation ahead after the round, and its upload is
        then turned away as revoked."""
        with self._lock:
            grants = [g for g in self._grants.values()
                      if (g.ticket.run_id, g.ticket.round) == (run_id, round) and g.state != "revoked"]  # fmt: skip
            for grant in grants:
                grant.state = "ended"
            return len(grants)

    def _set(self, ticket: Ticket, state: str) -> None:
        with self._lock:
            grant = self._grants.get(_key(ticket.token))
            if grant is not None and grant.state not in ("revoked", "ended"):  # one under way stays so
                grant.state = state

    def _prune(self) -> None:
        """Drop long-expired capabilities so a long run's registry stays small."""
        now = self._clock()
        for k in [k for k, g in self._grants.items() if now >= g.expires_at + EXPIRED_KEPT_S]:
            del self._grants[k]
