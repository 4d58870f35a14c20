"""The stream service: a block record's bytes beside Flower's messages, over gRPC with TLS.

Two methods on one gRPC service, with raw bytes as messages (no generated code):
- ``Upload`` (client-streaming): a header (capability, record, size, SHA-256), then chunks. The
  bytes are hashed as they arrive and accepted only when length and digest equal the declaration;
  they then wait in the inbox until the node's Flower reply claims them with its own digest.
- ``Download`` (server-streaming): a header (capability, record), then the published record's chunks.

Every refusal is one line to the caller (the gRPC status details), one log line, one count by kind,
and changes nothing: the capability is released, the inbox and outbox stay as they were.
The server runs in a thread pool of the process that starts it. Who may hold one of its workers, and for how
long (``Calls``, ``Limits.header_timeout_s``), is the module's other concern: with ``client_ca`` (mutual TLS)
only a peer holding a certificate of the consortium's CA completes the handshake, each peer holds at most its
share of the pool, and a node's capabilities are bound to its certificate (``CapabilityRegistry.reserve``).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import queue
import ssl
import tempfile
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from parablock_flwr import kept_blocks
from parablock_flwr.memory import LARGE_BUFFER_BYTES
from parablock_flwr.transport.capabilities import (
    CapabilityRegistry,
    Direction,
    RefusalKind,
    Refusals,
    Refused,
    Revoked,
    Ticket,
)
from parablock_flwr.transport.framing import Buffers
from parablock_flwr.transport.headers import HEX64, Header, parse_header

log = logging.getLogger(__name__)

SERVICE = "parablock.transport.Transport"
UPLOAD = f"/{SERVICE}/Upload"
DOWNLOAD = f"/{SERVICE}/Download"
# Half the size from which a buffer is mapped afresh and unmapped when freed (``memory.map_large_buffers``): each
# message's copies (gRPC's, Python's bytes) then come from the heap's warm pages, where 4 MiB messages each took
# new pages, zeroed, on both sides (docs/transport.md). At memory speed, 512 KiB a message costs gRPC little.
CHUNK_BYTES = LARGE_BUFFER_BYTES // 2
COALESCE_BYTES = CHUNK_BYTES // 2  # an upload's messages below this are joined before they are held (``_receive``)
TRAILER_BYTES = 64  # an upload's SHA-256 sent after its bytes: hex digits
# What either side accepts: a chunk of an earlier release too (4 MiB: a site's worker and the server may be a
# release apart) plus room for framing; larger messages are refused by grpc.
MESSAGE_LIMIT = 4 * 2**20 + 2**20
# A call that moves no bytes for this long (a download waiting a round ahead) is pinged, each way; no answer
# within KEEPALIVE_TIMEOUT_S ends it. A connection a NAT or firewall dropped silently then fails in under a
# minute instead of holding the node's SuperNode, or one of the service's workers, until its capability ends;
# and the pings keep an idle NAT mapping alive.
KEEPALIVE_S = 30.0
KEEPALIVE_TIMEOUT_S = 20.0
CONNECTION_IDLE_S = 300.0  # a connection with no call for this long is closed (a node's channel reconnects)
QUEUED_PER_WORKER = 4  # calls in the service at most, per worker of its pool (the rest wait for a worker)
HOST_SHARE = 0.75  # of the pool, what one host may hold without a client certificate (sites behind a NAT share it)


def channel_options(keepalive_s: float = KEEPALIVE_S, server: bool = False) -> list[tuple[str, int]]:
    """gRPC's options on both ends: the message limit, and keepalive pings after ``keepalive_s`` without
    data, answered within ``KEEPALIVE_TIMEOUT_S`` (or ``keepalive_s``, if shorter); a server accepts a
    client's pings at that pace (gRPC's default policy would close a connection pinged more often than
    every 5 minutes)."""
    every_ms, timeout_ms = int(keepalive_s * 1000), int(min(KEEPALIVE_TIMEOUT_S, keepalive_s) * 1000)
    options = [
        ("grpc.max_receive_message_length", MESSAGE_LIMIT),
        ("grpc.max_send_message_length", MESSAGE_LIMIT),
        ("grpc.keepalive_time_ms", every_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # What times a keepalive ping out in grpcio 1.85 (its default: 60 s), not the option above.
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.http2.max_pings_without_data", 0),  # a wait sends no data: ping throughout it
    ]
    if server:
        options += [("grpc.http2.min_recv_ping_interval_without_data_ms", every_ms // 2),
                    ("grpc.http2.max_ping_strikes", 0),
                    ("grpc.max_connection_idle_ms", int(CONNECTION_IDLE_S * 1000))]  # fmt: skip
    return options


STATUS = {
    RefusalKind.BAD_HEADER: grpc.StatusCode.INVALID_ARGUMENT,
    RefusalKind.BAD_CAPABILITY: grpc.StatusCode.PERMISSION_DENIED,
    RefusalKind.EXPIRED: grpc.StatusCode.PERMISSION_DENIED,
    RefusalKind.REPLAYED: grpc.StatusCode.PERMISSION_DENIED,
    RefusalKind.FOREIGN_RECORD: grpc.StatusCode.PERMISSION_DENIED,
    RefusalKind.OVERSIZED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RefusalKind.SIZE_MISMATCH: grpc.StatusCode.INVALID_ARGUMENT,
    RefusalKind.DIGEST_MISMATCH: grpc.StatusCode.DATA_LOSS,
    RefusalKind.STALLED: grpc.StatusCode.DEADLINE_EXCEEDED,
    RefusalKind.TRICKLING: grpc.StatusCode.DEADLINE_EXCEEDED,
    RefusalKind.UNKNOWN_RECORD: grpc.StatusCode.NOT_FOUND,
    RefusalKind.LATE: grpc.StatusCode.FAILED_PRECONDITION,
    RefusalKind.BUSY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RefusalKind.FOREIGN_PEER: grpc.StatusCode.PERMISSION_DENIED,
}


@dataclass(frozen=True)
class Limits:
    """How slow an upload may be: no message for ``idle_timeout_s`` is a stall; after ``grace_s``,
    an average below ``min_rate_bytes_s`` is a trickle. A call's header (an upload's or a download's first
    message) must come within ``header_timeout_s``: a call that sends none holds a worker that long, not longer.
    ``chunk_bytes``: the download's chunk size. ``calls_per_peer``: the calls one client certificate may hold
    at once (``Calls``): a node's round uses at most six (two uploads and its reply, a download, and two waits
    for records published a round later)."""

    idle_timeout_s: float = 30.0
    min_rate_bytes_s: float = 1e6
    grace_s: float = 10.0
    chunk_bytes: int = CHUNK_BYTES
    header_timeout_s: float = 10.0
    calls_per_peer: int = 8

    def __post_init__(self):
        if not (type(self.calls_per_peer) is int and self.calls_per_peer > 0):
            raise ValueError(f"calls_per_peer={self.calls_per_peer!r}; expected a positive integer")
        for name in ("idle_timeout_s", "min_rate_bytes_s", "grace_s", "header_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r}; expected a positive number")
        if not 0 < self.chunk_bytes <= CHUNK_BYTES:
            raise ValueError(f"chunk_bytes={self.chunk_bytes!r}; expected 1..{CHUNK_BYTES}")


@dataclass(frozen=True)
class Published:
    """A record the server publishes once: its bytes in memory (``Buffers``: the parts it was framed from, never
    joined) or a file, with size and SHA-256 (hex)."""

    name: str
    size: int
    sha256: str
    data: Buffers | None = None
    path: Path | None = None

    def chunks(self, chunk_bytes: int):
        if self.data is not None:
            yield from self.data.chunks(chunk_bytes)
            return
        with open(self.path, "rb") as f:
            while chunk := f.read(chunk_bytes):
                yield chunk


class Outbox:
    """Records published for download, each once; a download issued a round ahead waits for its record."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._records: dict[str, Published] = {}
        self._held: set[str] = set()  # published, but not yet to downloads waiting for them (``release``)

    def publish(
        self, name: str, data: Buffers | bytes | None = None, path: Path | None = None, held: bool = False
    ) -> Published:
        """Publish ``data`` or the file at ``path`` under ``name``; its size and SHA-256 go into Flower's message.
        ``Buffers`` are served as they are (their parts must not change: ``framing.framed`` gives ``bytes``, or
        read-only views of memory this app never writes again); other bytes-like data is copied first. ``held``:
        downloads waiting for it (``wait_for``) get it only once it is ``release``d."""
        if (data is None) == (path is None):
            raise ValueError(
                f"publish {name!r}: give either data or path, not {'both' if data is not None else 'neither'}"
            )
        if data is not None:
            data = data if isinstance(data, Buffers) else Buffers([bytes(data)])
            record = Published(name, len(data), data.sha256(), data=data)
        else:
            path = Path(path)
            with open(path, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
            record = Published(name, path.stat().st_size, digest, path=path)
        with self._lock:
            if name in self._records:
                raise ValueError(f"record {name!r} is already published; a record is published once")
            self._records[name] = record
            if held:
                self._held.add(name)
            self._lock.notify_all()
        return record

    def release(self, name: str) -> None:
        """A record published ``held`` goes to the downloads waiting for it."""
        with self._lock:
            self._held.discard(name)
            self._lock.notify_all()

    def get(self, name: str, held_too: bool = True) -> Published | None:
        """The record ``name``; with ``held_too=False`` None while it is held (what a download issued ahead
        sees: a held record is not yet its node's)."""
        with self._lock:
            if not held_too and name in self._held:
                return None
            return self._records.get(name)

    def wait_for(self, name: str, alive, poll_s: float = 0.25) -> Published | None:
        """The record ``name`` once it is published; None when ``alive()`` turns false first (its capability
        expired, was revoked or dropped with its round, the caller left, the service stops). ``alive`` is
        asked at least every ``poll_s``, since those ends do not notify."""
        with self._lock:
            while alive():  # asked first on every wake: a revocation before the release wins
                record = self._records.get(name)
                if record is not None and name not in self._held:
                    return record
                self._lock.wait(poll_s)
            return None

    def retire(self, name: str) -> None:
        with self._lock:
            self._records.pop(name, None)
            self._held.discard(name)


class KeptUpload:
    """An upload received in memory kept across rounds (``kept_blocks``): a buffer of its declared size, each chunk
    copied into place as it comes, on the receiving thread while the rest is still on its way. Its arrays are then
    read where they landed (``view``): no copy after the last byte, and no block's pages faulted in afresh each
    round (a copy into new memory cost about a second a 236 MB update on this project's 2-core VM). The buffer is
    taken when the upload's header comes, for the size it declares (bounded by its capability).

    While it lands, a reader may read what has landed (``landing``, ``wait_until``): the server's pass over a
    round's updates runs as their bytes arrive (``wire.LandingArrays``). Landed bytes are never written again."""

    def __init__(self, size: int) -> None:
        self._data = kept_blocks.host_bytes(size)
        self._size = 0
        self._landed = threading.Condition()
        self._broken_off = False
        self.address = np.frombuffer(self._data, dtype=np.uint8).ctypes.data if size else 0

    def append(self, chunk) -> None:
        """The next chunk (the service refuses one past the declared size before it comes here)."""
        end = self._size + len(chunk)
        self._data[self._size : end] = chunk
        with self._landed:
            self._size = end
            self._landed.notify_all()

    def __len__(self) -> int:
        return self._size

    def view(self) -> memoryview:
        """The bytes received, read-only (the buffer goes back to the pool when the last view of it goes)."""
        return self._data[: self._size].toreadonly()

    def landing(self) -> memoryview:
        """All the declared bytes, read-only, whether they have landed or not: read only what ``wait_until`` says
        has (the same memory as ``view``'s once all have)."""
        return self._data.toreadonly()

    def wait_until(self, address: int) -> None:
        """Returns once every byte below ``address`` (in ``landing``'s memory) has landed; raises
        ``UploadBrokenOff`` where the upload ended before them (refused, broken off: ``break_off``)."""
        with self._landed:
            while self._size < address - self.address:
                if self._broken_off:
                    raise UploadBrokenOff(f"the upload ended at {self._size:,} of {len(self._data):,} bytes")
                self._landed.wait()

    def break_off(self) -> None:
        """No more bytes will land (the service gave the upload up): whoever waits for them is told."""
        with self._landed:
            self._broken_off = True
            self._landed.notify_all()


class UploadBrokenOff(RuntimeError):
    """The bytes waited for (``KeptUpload.wait_until``) will not land."""


class SpillFile:
    """An upload received into a file (``Inbox.buffer``): unlinked when created, so nothing is left behind
    whatever happens to the upload or the process; written as its chunks come and read back by range when
    claimed (the ``Buffers`` reading ``framing.payloads`` uses), with plain writes and reads: a mapping of the
    file would fault once per page."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd
        self._size = 0

    def append(self, chunk) -> None:
        view = memoryview(chunk).cast("B")
        self._size += view.nbytes
        while view.nbytes:
            view = view[os.write(self._fd, view) :]

    def __len__(self) -> int:
        return self._size

    def read(self, start: int, stop: int) -> bytes:
        parts, at = [], start
        while at < stop:
            part = os.pread(self._fd, min(stop - at, 2**30), at)
            if not part:
                raise OSError(f"the spilled upload ends at {at} bytes; {stop} expected")
            parts.append(part)
            at += len(part)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def tobytes(self) -> bytes:
        return self.read(0, len(self))

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        self.close()


Received = Buffers | KeptUpload | SpillFile | bytearray  # where an upload's bytes are received (``Inbox.buffer``)


@dataclass
class _Upload:
    """An accepted upload waiting for its claim: its declared digest and size, and either its decoding,
    started on arrival (``decoding``), or its bytes in a file, decoded when claimed (``spilled``)."""

    sha256: str
    size: int
    decoding: futures.Future | None = None
    spilled: SpillFile | None = None


def contiguous(data: Received, record: str) -> bytes | bytearray | memoryview:
    """An upload's bytes in one buffer: the inbox's ``decode`` when the service knows nothing of records."""
    if isinstance(data, KeptUpload):
        return data.view()
    return data.tobytes() if isinstance(data, Buffers | SpillFile) else data


class Inbox:
    """Uploads whose bytes matched their declaration, waiting for the Flower reply that commits them.

    An upload is received in memory (``KeptUpload``; a reply's content as the chunks gRPC delivered,
    ``framing.Buffers``) and decoded at once, in a thread of its own, by ``decode(data, record)`` (the run's
    side reads the framed record's arrays' payloads where they landed), so that the reply that claims it finds
    it ready; a claim still hands it over only under the declared digest and size, and a decoding that failed is
    raised then, never before.
    With ``spill_dir``, an upload that finds ``memory_uploads`` uploads in memory (held or still arriving) is
    received into a file there instead, and decoded when claimed: the server holds a round's uploads and the
    next round's moved ahead until their replies claim them, so held in memory they would grow the
    server's memory with the nodes. Counted in uploads, as the round's aggregation counts the updates it
    holds (``strategies/update_spill.py``): each is bounded by its capability, so the inbox holds at most
    ``memory_uploads`` blocks, and a deployment of a few sites never writes a block to disk and reads it
    back on the critical path, however large the block."""

    def __init__(
        self,
        refusals: Refusals,
        spill_dir: Path | None = None,
        memory_uploads: int = 0,
        decode=contiguous,
        outside_budget=lambda record: False,
    ) -> None:
        self._lock = threading.Lock()
        self._records: dict[tuple, _Upload] = {}
        self._refusals = refusals
        if spill_dir is not None and memory_uploads < 1:
            raise ValueError(f"memory_uploads={memory_uploads} with a spill folder: expected at least 1")
        self.spill_dir, self.memory_uploads, self.decode = spill_dir, memory_uploads, decode
        self.outside_budget = outside_budget  # record name -> whether its upload is kept out of the budget
        self.spilled = 0  # uploads received into a file
        self._receiving: dict[int, tuple] = {}  # id(buffer) -> (slot, buffer): uploads in memory still arriving
        self._ended: dict[int, int] = {}  # run id -> its last round ended (``drop_round``): later uploads are late
        # One thread: a decoding reads a record's index where its bytes landed, or copies them from the spill file.
        self._decoder = futures.ThreadPoolExecutor(1, "transport-decode")
        self.arrived = threading.Event()  # set by every upload held: whoever waits for one checks again

    def buffer(self, ticket: Ticket, size: int) -> Received:
        """Where an upload of ``size`` bytes is received: memory (``KeptUpload``), or (the class's
        docstring) a ``SpillFile`` in ``spill_dir``, its space reserved first (a full disk is an error here,
        not a failed write halfway). An upload received in memory counts toward ``memory_uploads`` from here on,
        not from its ``put``, so that uploads arriving together cannot pass the budget together, and can be read
        as it lands (``landing``); ``discard`` gives back what was not ``put``."""
        if self.outside_budget(ticket.record):  # a reply's content: small, never a file, no block's share of memory
            return Buffers()
        with self._lock:
            in_memory = sum(u.spilled is None and not self.outside_budget(slot[3]) for slot, u in self._records.items())
            in_memory += len(self._receiving)
            if self.spill_dir is None or size == 0 or in_memory < self.memory_uploads:
                received = KeptUpload(size)
                self._receiving[id(received)] = (_slot(ticket), received)
                return received
        try:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            fd, path = tempfile.mkstemp(dir=self.spill_dir, prefix=".upload-")
        except OSError as err:
            log.warning("transport: an upload of %d bytes is received in memory: %s", size, err)
            return KeptUpload(size)
        try:
            os.unlink(path)
            os.posix_fallocate(fd, 0, size)
        except OSError as err:  # a full disk, a file system without fallocate: memory, said
            os.close(fd)
            log.warning("transport: an upload of %d bytes is received in memory: %s in %s", size, err, self.spill_dir)
            return KeptUpload(size)
        with self._lock:
            self.spilled += 1
        return SpillFile(fd)

    def put(self, ticket: Ticket, sha256: str, data: Received) -> None:
        """Hold an accepted upload for its claim; one in memory starts decoding now (the class's docstring), or
        here once the inbox is closed (the service stopping). An upload whose round ended while it arrived is
        refused as ``late`` (the caller gives its buffer back): no later ``drop_round`` would drop it."""
        with self._lock:
            self._refuse_if_ended(ticket)
        if isinstance(data, SpillFile):
            upload = _Upload(sha256, len(data), spilled=data)
        elif self.outside_budget(ticket.record):  # small: decoded here, never behind a block's decoding
            upload = _Upload(sha256, len(data), decoding=self._decode_now(data, ticket.record))
        else:
            upload = _Upload(sha256, len(data), decoding=self._decode_soon(data, ticket.record))
        with self._lock:
            self._receiving.pop(id(data), None)
            try:
                self._refuse_if_ended(ticket)  # its round may have ended while its decoding started
            except Refused:
                _forget(upload)
                raise
            old = self._records.get(_slot(ticket))
            self._records[_slot(ticket)] = upload
        self.arrived.set()
        if old is not None:
            _forget(old)

    def _refuse_if_ended(self, ticket: Ticket) -> None:
        """``late`` for an upload of a round ``drop_round`` has ended (called holding the lock)."""
        if ticket.round <= self._ended.get(ticket.run_id, 0):
            raise Refused(RefusalKind.LATE, f"round {ticket.round} of run {ticket.run_id} ended while its "
                          f"upload {ticket.record!r} arrived")  # fmt: skip

    def _decode_soon(self, data, record: str) -> futures.Future:
        try:
            return self._decoder.submit(self.decode, data, record)
        except RuntimeError:  # closed: decoded here, so that a claim still finds it
            return self._decode_now(data, record)

    def _decode_now(self, data, record: str) -> futures.Future:
        done: futures.Future = futures.Future()
        try:
            done.set_result(self.decode(data, record))
        except Exception as err:  # raised at the claim, as from the thread
            done.set_exception(err)
        return done

    def discard(self, data: Received | None) -> None:
        """An upload's buffer that will not be ``put`` (refused, broken off): its share of the memory budget
        given back, its file closed."""
        with self._lock:
            self._receiving.pop(id(data), None)
        if isinstance(data, KeptUpload):
            data.break_off()
        if isinstance(data, SpillFile):
            data.close()

    def claim(self, run_id: int, node_id: int, round: int, record: str, sha256: str, size: int | None = None):
        """The upload, decoded (``decode``), when its digest equals ``sha256`` (from the node's Flower reply) and
        its length ``size`` (when given), and None when nothing was uploaded (the caller falls back). A different
        digest or size is refused, counted, and leaves the inbox as it was; an upload that ``decode`` refused
        raises its error here, once the digest and size are the reply's."""
        with self._lock:
            held = self._records.get((run_id, node_id, round, record))
            if held is None:
                return None
            where = f"node {node_id} round {round} record {record!r}"
            refused = None
            if not hmac.compare_digest(held.sha256, sha256):
                refused = Refused(RefusalKind.DIGEST_MISMATCH, f"{where}: the reply's SHA-256 is not the uploaded one")
            elif size is not None and size != held.size:
                refused = Refused(
                    RefusalKind.SIZE_MISMATCH, f"{where}: {held.size} bytes uploaded; the reply commits {size}"
                )
            if refused is not None:
                self._refusals.add(refused)
                raise refused
            del self._records[(run_id, node_id, round, record)]
        return self._decoded(held, record)

    def take(self, run_id: int, node_id: int, round: int, record: str):
        """The upload in this slot, decoded, or None when nothing was uploaded: for a record that its capability
        alone vouches for (a reply's content on the stream), which no reply's digest commits."""
        with self._lock:
            held = self._records.pop((run_id, node_id, round, record), None)
        return None if held is None else self._decoded(held, record)

    def _decoded(self, held: _Upload, record: str):
        if held.decoding is not None:
            return held.decoding.result()
        try:
            return self.decode(held.spilled, record)
        finally:
            held.spilled.close()

    def peek(self, run_id: int, node_id: int, round: int, record: str):
        """The upload in this slot as its claim would hand it over (the same object), left for that claim; None
        when there is none, it waits in a file (decoded only when claimed), or its decoding failed (the claim
        raises that). Nothing here vouches for it: no reply has committed its digest yet."""
        with self._lock:
            held = self._records.get((run_id, node_id, round, record))
        if held is None or held.decoding is None:
            return None
        try:
            return held.decoding.result()
        except Exception:  # noqa: BLE001 - the claim raises it, once a reply commits the upload
            return None

    def landing(self, run_id: int, node_id: int, round: int, record: str) -> KeptUpload | None:
        """The upload still arriving in memory in this slot (read as it lands: ``KeptUpload.wait_until``), or None.
        Nothing vouches for it: its digest is checked when its last byte lands, and a reply commits it later."""
        with self._lock:
            return next((data for slot, data in self._receiving.values() if slot == (run_id, node_id, round, record)),
                        None)  # fmt: skip

    def holds(self, run_id: int, node_id: int, round: int, record: str) -> bool:
        """Whether an upload waits in this slot (for a reply to claim it)."""
        with self._lock:
            return (run_id, node_id, round, record) in self._records

    def drop_round(self, run_id: int, round: int) -> int:
        """Forget a round's uploads no reply claimed (the round ended), and refuse later ones of it and of any
        round before (``put``); how many were dropped."""
        with self._lock:
            self._ended[run_id] = max(self._ended.get(run_id, 0), round)
            slots = [slot for slot in self._records if slot[:1] + slot[2:3] == (run_id, round)]
            dropped = [self._records.pop(slot) for slot in slots]
            late = [data for slot, data in self._receiving.values() if slot[0] == run_id and slot[2] <= round]
        for upload in dropped:
            _forget(upload)
        for data in late:  # refused when its last byte lands: whoever reads it as it lands stops now
            data.break_off()
        return len(dropped)

    def close(self) -> None:
        """The decoding thread ends once the decodings it holds are done (a claim may still take them); a later
        upload is decoded in ``put`` itself."""
        self._decoder.shutdown(wait=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)


def _forget(upload: _Upload) -> None:
    """An upload no claim will take: its decoding cancelled if not started, its file closed."""
    if upload.decoding is not None:
        upload.decoding.cancel()
    if upload.spilled is not None:
        upload.spilled.close()


def _slot(t: Ticket) -> tuple:
    return (t.run_id, t.node_id, t.round, t.record)


class _Feed:
    """Pulls a client stream in a helper thread so the handler can wait with a timeout (a stalled
    client would otherwise hold the handler forever)."""

    _END = object()

    def __init__(self, requests) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=4)
        self._stop = threading.Event()
        threading.Thread(target=self._pull, args=(requests,), daemon=True, name="transport-feed").start()

    def _pull(self, requests) -> None:
        try:
            for message in requests:
                if not self._put(message):
                    return
        except Exception:  # the RPC ended (cancelled or aborted): the handler sees the end
            pass
        self._put(self._END)

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def next(self, timeout: float):
        """The next message, None at the stream's end; raises queue.Empty after ``timeout``."""
        item = self._queue.get(timeout=timeout)
        return None if item is self._END else item

    def stop(self) -> None:
        self._stop.set()


def peer_identity(context: grpc.ServicerContext) -> tuple[str, str]:
    """Who a call comes from: ``(identity, certificate)``. Under mutual TLS both are the SHA-256 of the client
    certificate's DER bytes (what the peer proved it holds the key of); without a client certificate the
    identity is the peer's host (``host:127.0.0.1``: several nodes behind one NAT share it) and the certificate
    is empty."""
    pem = (context.auth_context().get("x509_pem_cert") or [b""])[0]
    if pem:
        fingerprint = hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem.decode("ascii"))).hexdigest()
        return f"cert:{fingerprint}", fingerprint
    host = context.peer().rpartition(":")[0].partition(":")[2] or context.peer()  # ipv4:H:P, ipv6:[H]:P
    return f"host:{host}", ""


@dataclass(eq=False)
class Call:
    """A call in flight: its peer (``peer_identity``), the capability it reserved once it has, and whether the
    service cancelled it (its capability ended while it ran)."""

    peer: str
    certificate: str
    context: grpc.ServicerContext
    ticket: Ticket | None = None
    cancelled: bool = False
    waiting: bool = False  # a download waiting for its record's publication


class Calls:
    """The service's calls in flight. A peer with a certificate holds at most ``per_peer`` of them at once; one
    more is refused as ``busy`` and counted against it, so that no node (nor a thief of its tokens, who needs a
    certificate of the consortium's CA to connect at all) takes another's share of the pool. A peer without one
    (no ``client_ca``: whoever reaches the port) is its host, which holds at most ``per_host`` (generous: sites
    behind one NAT share a host), so one host cannot take the whole pool; many hosts still can, which only
    mutual TLS prevents. ``cancel_ended`` cancels each call whose capability ended (expired, its round ended,
    revoked) while it moves bytes, so that a peer that stops reading gives back its worker (a download waiting
    for its record ends by itself then: ``TransportServer._wait_for``)."""

    def __init__(self, per_peer: int, per_host: int) -> None:
        self.per_peer, self.per_host = per_peer, per_host
        self._lock = threading.Lock()
        self._calls: set[Call] = set()
        self.cancelled = 0  # calls cancelled because their capability ended

    def enter(self, context: grpc.ServicerContext) -> Call:
        peer, certificate = peer_identity(context)
        call = Call(peer, certificate, context)
        with self._lock:
            held, most = sum(c.peer == peer for c in self._calls), self.per_peer if certificate else self.per_host
            if held >= most:
                raise Refused(RefusalKind.BUSY, f"this peer holds {held} calls; at most {most} at once")
            self._calls.add(call)
        return call

    def leave(self, call: Call) -> None:
        with self._lock:
            self._calls.discard(call)

    def __len__(self) -> int:
        with self._lock:
            return len(self._calls)

    def cancel_ended(self, alive) -> int:
        """Cancel the calls whose capability ``alive(ticket)`` says has ended; how many."""
        with self._lock:
            ended = [c for c in self._calls
                     if c.ticket is not None and not c.cancelled and not c.waiting and not alive(c.ticket)]  # fmt: skip
            for call in ended:
                call.cancelled = True
            self.cancelled += len(ended)
        for call in ended:
            call.context.cancel()
        return len(ended)


class TransportServer:
    """The stream service, with its capability registry, outbox, inbox and refusal counts."""

    def __init__(
        self,
        registry: CapabilityRegistry | None = None,
        address: str = "0.0.0.0:0",
        cert_file: Path | None = None,
        key_file: Path | None = None,
        insecure: bool = False,
        limits: Limits = Limits(),
        max_workers: int = 64,
        spill_dir: Path | None = None,
        memory_uploads: int = 0,
        decode=contiguous,
        keepalive_s: float = KEEPALIVE_S,
        outside_budget=lambda record: False,
        client_ca: Path | None = None,
    ):
        """``decode``: how an upload is read for its claim (``Inbox``), ``outside_budget``: which records' uploads
        it holds outside its memory budget (small ones: a reply's content); ``spill_dir``: where uploads past the
        first ``memory_uploads`` in memory wait in files (None: all in memory); ``keepalive_s``:
        ``channel_options``; ``client_ca``: the CA whose certificates the nodes present (mutual TLS: a peer
        without one fails the handshake, before any call); ``max_workers``: the calls served at once (more are
        refused at once, never queued behind a stalled one)."""
        if client_ca is not None and insecure:
            raise ValueError("client_ca with insecure=True; mutual TLS needs TLS")
        if insecure and (cert_file or key_file):
            raise ValueError("insecure=True with a certificate; choose TLS (cert_file and key_file) or insecure")
        if not insecure and not (cert_file and key_file):
            raise ValueError(
                f"cert_file={cert_file!r}, key_file={key_file!r}; TLS needs both (plaintext only with insecure=True)"
            )
        self.registry = registry or CapabilityRegistry()
        self.refusals = Refusals()
        self.outbox = Outbox()
        self.inbox = Inbox(self.refusals, spill_dir, memory_uploads, decode=decode, outside_budget=outside_budget)
        self.limits = limits
        self._stopping = threading.Event()
        self._waits_lock = threading.Lock()
        self.waits_ended = 0  # downloads that waited for a record and ended without it (not refusals)
        self.revoked_used = 0  # requests under a revoked capability, turned away (not refusals)
        self._address, self._insecure = address, insecure
        self._cert = Path(cert_file).read_bytes() if cert_file else None
        self._key = Path(key_file).read_bytes() if key_file else None
        self._client_ca = Path(client_ca).read_bytes() if client_ca is not None else None
        self.calls = Calls(limits.calls_per_peer, max(limits.calls_per_peer, int(HOST_SHARE * max_workers)))
        self.max_workers = max_workers  # concurrent transfers, a download waiting ahead included
        self.keepalive_s = keepalive_s
        self._server: grpc.Server | None = None
        self.port: int | None = None

    def start(self) -> int:
        """Start serving; the bound port (``address`` may ask for port 0: any free one)."""
        options = channel_options(self.keepalive_s, server=True)
        # Each upload holds a worker and a feed thread; the pool bounds concurrent transfers. A call past it waits
        # for a worker (each peer holds at most its share, and a stalled one at most the header's deadline), and
        # past QUEUED_PER_WORKER times the pool gRPC refuses it at once (RESOURCE_EXHAUSTED: the node falls back).
        pool = futures.ThreadPoolExecutor(self.max_workers, "transport")
        self._server = grpc.server(pool, options=options, maximum_concurrent_rpcs=QUEUED_PER_WORKER * self.max_workers)
        # Download reads its request as a stream: its handler starts with the call (a unary request is read in
        # gRPC's code, holding a worker for as long as the peer does not send it), so the header's deadline and
        # the per-peer cap apply to it too. On the wire it is the same call.
        handlers = {
            "Upload": grpc.stream_unary_rpc_method_handler(self._upload),
            "Download": grpc.stream_stream_rpc_method_handler(self._download),
        }
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        if self._insecure:
            self.port = self._server.add_insecure_port(self._address)
        else:
            credentials = grpc.ssl_server_credentials(
                [(self._key, self._cert)], root_certificates=self._client_ca, require_client_auth=bool(self._client_ca)
            )
            self.port = self._server.add_secure_port(self._address, credentials)
        if not self.port:
            raise OSError(f"the transport service could not bind {self._address!r}")
        self._server.start()
        threading.Thread(target=self._watch, daemon=True, name="transport-watch").start()
        security = "PLAINTEXT" if self._insecure else "mutual TLS" if self._client_ca else "TLS"
        log.info("transport service on port %d (%s)", self.port, security)
        return self.port

    def _watch(self, every_s: float = 1.0) -> None:
        """Cancel, every ``every_s``, the calls whose capability ended (``Calls.cancel_ended``)."""
        while not self._stopping.wait(every_s):
            try:
                if cancelled := self.calls.cancel_ended(self.registry.alive):
                    log.info("transport: %d call(s) cancelled: their capability ended", cancelled)
            except Exception:  # noqa: BLE001 - one failed pass must not end the cancelling for the run
                log.exception("transport: cancelling the calls whose capability ended failed; trying again")

    def stop(self, grace_s: float = 1.0) -> None:
        self._stopping.set()  # downloads waiting for a record end
        if self._server is not None:
            self._server.stop(grace_s).wait()
            self._server = None
        self.inbox.close()

    def _refuse(self, refused: Refused, context: grpc.ServicerContext, call: Call) -> None:
        """One line to the caller and the log, counted by kind and against the peer that caused it. A call the
        service cancelled (its capability ended) is refused as ``late``, whatever broke in it then."""
        if call.cancelled:
            refused = Refused(RefusalKind.LATE, f"the capability of record {call.ticket.record!r} ended during it")
        self.refusals.add(refused, call.peer)
        log.warning("transport %s (from %s)", refused.line(), call.peer[:21])
        context.abort(STATUS[refused.kind], refused.line())

    def _enter(self, context: grpc.ServicerContext) -> Call:
        """The call, counted against its peer (``Calls``); a peer past its share is refused as ``busy``."""
        try:
            return self.calls.enter(context)
        except Refused as refused:
            peer = peer_identity(context)[0]
            self.refusals.add(refused, peer)
            log.warning("transport %s (from %s)", refused.line(), peer[:21])
            context.abort(STATUS[refused.kind], refused.line())

    def _turn_away(self, revoked: Revoked, context: grpc.ServicerContext) -> None:
        """A request under a revoked capability: one line to the caller and the log, counted apart from the
        refusals (``revoked_used``); it changes nothing."""
        with self._waits_lock:
            self.revoked_used += 1
        log.info("transport: %s", revoked)
        context.abort(grpc.StatusCode.NOT_FOUND, str(revoked))

    def _upload(self, requests, context: grpc.ServicerContext) -> bytes:
        call = self._enter(context)
        feed = ticket = data = None
        done = False
        try:
            feed = _Feed(requests)
            header = parse_header(self._header(feed), Direction.UPLOAD)
            ticket = call.ticket = self.registry.reserve(header.claim, header.size, call.certificate)
            data = self.inbox.buffer(ticket, header.size)
            sha256 = self._receive(feed, header, data)
            self.inbox.put(ticket, sha256, data)
            self.registry.finish(ticket, call.certificate)
            done = True
            return b"accepted"
        except Refused as refused:
            self._refuse(refused, context, call)
        except Revoked as revoked:
            self._turn_away(revoked, context)
        finally:
            if feed is not None:
                feed.stop()
            self.calls.leave(call)
            # Anything but acceptance (a refusal, a broken stream, an error) leaves the capability as it was.
            if ticket is not None and not done:
                self.registry.release(ticket)
                self.inbox.discard(data)

    def _receive(self, feed: _Feed, header: Header, data: Received) -> str:
        """The declared bytes into ``data`` (``Inbox.buffer``), hashed as they arrive, and their SHA-256; any
        difference from the declaration is refused. A header without a SHA-256 declares that it follows the
        bytes (``_trailer``): the client hashed while it sent. Messages under ``COALESCE_BYTES`` are joined
        before they are kept, so that many small ones cost what their bytes cost."""
        digest, got, start, small = hashlib.sha256(), 0, time.monotonic(), bytearray()
        while got < header.size and (chunk := self._next(feed, start, got)) is not None:
            if got + len(chunk) > header.size:
                raise Refused(RefusalKind.SIZE_MISMATCH, f"more than the declared {header.size} bytes")
            digest.update(chunk)
            got += len(chunk)
            if len(chunk) >= COALESCE_BYTES and not small:
                data.append(chunk)
                continue
            small += chunk
            if len(small) >= COALESCE_BYTES:
                data.append(bytes(small))
                small = bytearray()
        if small:
            data.append(bytes(small))
        if got != header.size:
            raise Refused(RefusalKind.SIZE_MISMATCH, f"{got} bytes; declared {header.size}")
        declared = header.sha256 or self._trailer(feed, start, got)
        if self._next(feed, start, got) is not None:
            raise Refused(RefusalKind.SIZE_MISMATCH, f"more than the declared {header.size} bytes")
        if not hmac.compare_digest(digest.hexdigest(), declared):
            raise Refused(
                RefusalKind.DIGEST_MISMATCH, f"record {header.claim.record!r}: SHA-256 differs from the declared one"
            )
        return declared

    def _trailer(self, feed: _Feed, start: float, got: int) -> str:
        """The SHA-256 a client sends after the declared bytes: 64 lowercase hex digits as one message."""
        trailer = self._next(feed, start, got)
        if trailer is None:
            raise Refused(RefusalKind.BAD_HEADER, f"no SHA-256 after the declared {got} bytes; the header has none")
        text = bytes(trailer[: TRAILER_BYTES + 1]).decode("ascii", "replace")
        if len(trailer) != TRAILER_BYTES or not HEX64.fullmatch(text):
            raise Refused(
                RefusalKind.BAD_HEADER,
                f"the SHA-256 after the bytes: {len(trailer)} bytes; expected {TRAILER_BYTES} lowercase hex digits",
            )
        return text

    def _header(self, feed: _Feed):
        """A call's first message, within ``Limits.header_timeout_s`` (a stall after that)."""
        try:
            first = feed.next(self.limits.header_timeout_s)
        except queue.Empty:
            raise Refused(RefusalKind.STALLED, f"no header within {self.limits.header_timeout_s:g} s") from None
        if first is None:
            raise Refused(RefusalKind.BAD_HEADER, "the stream ended before its header")
        return first

    def _next(self, feed: _Feed, start: float, got: int):
        """The next message, refusing a stall (nothing for the idle timeout) or a trickle (below the
        minimum average rate once the grace period is over)."""
        limits = self.limits
        try:
            message = feed.next(limits.idle_timeout_s)
        except queue.Empty:
            raise Refused(
                RefusalKind.STALLED, f"no message for {limits.idle_timeout_s:g} s after {got} bytes"
            ) from None
        elapsed = time.monotonic() - start
        if message is not None and elapsed > limits.grace_s and got / elapsed < limits.min_rate_bytes_s:
            raise Refused(
                RefusalKind.TRICKLING,
                f"{got} bytes in {elapsed:.1f} s; at least {limits.min_rate_bytes_s:g} B/s after {limits.grace_s:g} s",
            )
        return message

    def _wait_for(self, ticket: Ticket, context: grpc.ServicerContext) -> Published:
        """A record issued a round ahead, once published. Its capability's end (expiry, the round's end, a
        revocation: the node is not messaged in that round) or the service's stop ends the wait: counted in
        ``waits_ended``, not as a refusal (nothing was attempted against the rules)."""

        def alive() -> bool:
            return not self._stopping.is_set() and context.is_active() and self.registry.alive(ticket)

        record = self.outbox.wait_for(ticket.record, alive)
        if record is None:
            self.registry.release(ticket)
            with self._waits_lock:
                self.waits_ended += 1
            log.info("transport: record %r was not published before its capability ended", ticket.record)
            context.abort(grpc.StatusCode.NOT_FOUND, f"record {ticket.record!r} was not published before its "
                          f"capability ended")  # fmt: skip
        return record

    def _download(self, requests, context: grpc.ServicerContext):
        call = self._enter(context)
        try:
            yield from self._send(call, requests, context)
        finally:
            self.calls.leave(call)

    def _send(self, call: Call, requests, context: grpc.ServicerContext):
        """A download's header read (within its deadline), its capability reserved, and its record's chunks."""
        ticket = record = feed = None
        try:
            feed = _Feed(requests)
            header = parse_header(self._header(feed), Direction.DOWNLOAD)
            ticket = call.ticket = self.registry.reserve(header.claim, certificate=call.certificate)
            waits = self.registry.waits(ticket)
            record = self.outbox.get(ticket.record, held_too=not waits)
            if record is None and not waits:
                raise Refused(RefusalKind.UNKNOWN_RECORD, f"record {ticket.record!r} is not published")
        except Refused as refused:
            if ticket is not None:
                self.registry.release(ticket)
            self._refuse(refused, context, call)
        except Revoked as revoked:
            self._turn_away(revoked, context)
        finally:
            if feed is not None:
                feed.stop()
        if record is None:
            call.waiting = True  # its wait ends with its capability by itself (``_wait_for``): not cancelled
            record = self._wait_for(ticket, context)
            call.waiting = False
        done = False
        try:
            yield from record.chunks(self.limits.chunk_bytes)
            done = True
        finally:
            if done:
                self.registry.finish(ticket, call.certificate)
            else:
                self.registry.release(ticket)
