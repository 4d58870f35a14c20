"""What can be attempted against a live direct stream (docs/transport.md, "Trust model"), for the deployment
tests: by an outsider, who holds no capability (none ever leaves Flower's authenticated messages), with no
client certificate or with a site's own, and by a site misusing its own node's capabilities, read from its
ClientApp's request to its node worker, or presenting them under another site's certificate (a stolen token).

``identity``: a site's client certificate and key (PEM bytes), as the stream's mutual TLS asks for; None: none.

Each attempt is made with a real gRPC client against the ServerApp's running service and gives back what
the client got: a ``Refused`` (its kind, its one line) or, for what the service never sees (a plaintext
dial at its TLS port), the ``TransportError``.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from parablock_flwr.messages import TransportOffer
from parablock_flwr.transport import Direction, Refused, Ticket, TransportClient, TransportError
from parablock_flwr.transport.headers import encode_header
from parablock_flwr.transport.service import UPLOAD

Outcome = Refused | TransportError | AssertionError


def refusal(call: Callable[[], object]) -> Outcome:
    """What ``call`` raised: a refusal, or a transport error; an ``AssertionError`` when the stream accepted it
    (returned, not raised: the attempts after it still run, and the test names it)."""
    try:
        call()
    except (Refused, TransportError) as outcome:
        return outcome
    return AssertionError("the stream accepted what it should have refused")


Identity = tuple[bytes, bytes] | None


def raw_upload(address: str, ca_pem: bytes, messages, identity: Identity = None) -> Outcome:
    """An Upload call whose client sends whatever ``messages`` yields (a header of its own making, or none),
    read back as ``TransportClient`` reads a refusal."""
    cert, key = identity or (None, None)
    credentials = grpc.ssl_channel_credentials(root_certificates=ca_pem, private_key=key, certificate_chain=cert)
    with grpc.secure_channel(address, credentials) as channel:
        call = channel.stream_unary(UPLOAD, request_serializer=lambda b: b, response_deserializer=lambda b: b)
        return refusal(lambda: TransportClient._call(lambda: call(messages, timeout=120)))


def wait_listening(address: str, timeout_s: float = 600) -> None:
    """Until something accepts connections at ``address`` (the ServerApp starts its stream before round 1)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"nothing listened at {address} within {timeout_s:g} s")


def forged(direction: Direction, record: str) -> Ticket:
    """A capability an outsider makes up: 256 random bits, bound to whatever it claims."""
    return Ticket(os.urandom(32), 1, 1, 1, direction, record)


def outsider(
    address: str, ca_pem: bytes, found: dict[str, Outcome], stalled: threading.Event, identity: Identity = None
) -> None:
    """Everything an outsider can attempt without a capability, into ``found``: forged capabilities up and
    down, a first message that is no header, an upload that stalls before its header (refused once the
    service's header deadline passes, beside the rest; ``stalled`` is set then), and a plaintext dial at the
    TLS port. ``ca_pem``: the CA the service's certificate is signed by (public: Flower's messages carry it).
    Without ``identity``, a service that requires mutual TLS ends each at the handshake."""
    wait_listening(address)
    release = threading.Event()

    def stalls():
        release.wait(120)  # connected, and never a byte
        yield from ()

    def stall() -> None:
        try:
            found["stalled"] = raw_upload(address, ca_pem, stalls(), identity)
        finally:
            release.set()
            stalled.set()

    staller = threading.Thread(target=stall, daemon=True)
    staller.start()
    with TransportClient(address, ca_pem=ca_pem, timeout_s=60, identity=identity) as client:
        found["forged upload"] = refusal(lambda: client.upload(forged(Direction.UPLOAD, "r1/update/1"), b"x"))
        found["forged download"] = refusal(lambda: client.download(forged(Direction.DOWNLOAD, "r1/x/1"), 1, "0" * 64))
    found["not a header"] = raw_upload(address, ca_pem, iter([b"\x00garbage"]), identity)
    with TransportClient(address, insecure=True, timeout_s=20) as plaintext:
        found["plaintext"] = refusal(lambda: plaintext.upload(forged(Direction.UPLOAD, "r1/update/1"), b"x"))
    staller.join(timeout=120)


def misuse_before(offer: TransportOffer, identity: Identity, thief: Identity) -> dict[str, Outcome]:
    """A site's misuse of its own capabilities before its node worker uses them: an oversized declaration,
    another node's update slot, another record than its own, bytes whose SHA-256 or length is not the
    declared one, a trickling upload. Each is refused and releases the capability (the worker then uses it)."""
    ca_pem, node, rnd = offer.ca_pem.encode(), offer.node_id, offer.server_round
    up = Ticket(bytes.fromhex(offer.upload_token), offer.run_id, node, rnd, Direction.UPLOAD, offer.upload_name)
    ref = offer.records[0]
    down = Ticket(bytes.fromhex(ref.token), offer.run_id, node, rnd, Direction.DOWNLOAD, ref.name)
    other = node + 1 if node + 1 < 2**63 else node - 1
    found = {
        "oversized": raw_upload(
            offer.address, ca_pem, iter([encode_header(up, offer.upload_max_size + 1, "0" * 64)]), identity
        )
    }
    with TransportClient(offer.address, ca_pem=ca_pem, timeout_s=60, identity=identity) as client:
        another = Ticket(up.token, offer.run_id, other, rnd, Direction.UPLOAD, f"r{rnd}/update/{other}")
        found["another node's slot"] = refusal(lambda: client.upload(another, b"x"))
        elsewhere = Ticket(down.token, offer.run_id, node, rnd, Direction.DOWNLOAD, f"r{rnd}/global-step/0")
        found["another record"] = refusal(lambda: client.download(elsewhere, ref.size, ref.sha256))
        found["digest"] = refusal(lambda: client.upload(up, b"y" * 1000, sha256="0" * 64))
    found["size"] = raw_upload(offer.address, ca_pem, iter([encode_header(up, 1000, "0" * 64), b"y" * 999]), identity)

    def trickles():
        yield encode_header(up, offer.upload_max_size, "0" * 64)
        for _ in range(200):  # 1 kB every 0.2 s: never idle, far below the minimum rate
            time.sleep(0.2)
            yield b"t" * 1000

    found["trickling"] = raw_upload(offer.address, ca_pem, trickles(), identity)
    return found


def misuse_after(offer: TransportOffer, identity: Identity, thief: Identity) -> dict[str, Outcome | None]:
    """A site presenting a record's download capability twice once its node worker has answered the round.
    The first use is refused as replayed when the worker used it, and is the site's own (the same bytes,
    harmless; ``None``) when the worker took that record another way (a step prefetched a round ahead); the
    second is refused as replayed either way, or as ``late`` once the round has ended:
    with its reply on the stream, the server may end the round before the site tries. Then another site
    (``thief``) presents the same capability under its own certificate: refused as ``foreign_peer``, since the
    node's first transfer bound its capabilities to its certificate. (Its upload capability
    is not replayed: when the worker's update went ahead, that capability is unused and an upload under it
    would replace the update before the reply claims it, the site's own update only; the fast tier covers an
    upload replayed.)"""
    ca_pem, ref, rnd = offer.ca_pem.encode(), offer.records[0], offer.server_round
    down = Ticket(bytes.fromhex(ref.token), offer.run_id, offer.node_id, rnd, Direction.DOWNLOAD, ref.name)
    with TransportClient(offer.address, ca_pem=ca_pem, timeout_s=60, identity=identity) as client:

        def fetch() -> None:
            client.download(down, ref.size, ref.sha256)

        try:
            fetch()
            first = None
        except (Refused, TransportError) as outcome:
            first = outcome
        found = {"download again": first, "replayed download": refusal(fetch)}
    with TransportClient(offer.address, ca_pem=ca_pem, timeout_s=60, identity=thief) as stolen:
        found["stolen token"] = refusal(lambda: stolen.download(down, ref.size, ref.sha256))
    return found


class SocketTap:
    """A site's own process between its ClientApp and its node worker: the worker's socket moved aside and
    this one in its place, relaying each connection byte for byte. ``on_offer`` sees each request's stream
    offer. Once in all the taps sharing ``once``, on the first request whose offer has records on the
    stream and an upload capability, it misuses that offer's capabilities (``misuse_before`` before
    relaying the request, ``misuse_after`` once the worker's reply is relayed); ``found`` then holds the
    offer (``"offer"``), the tapped node's partition (``"partition"``) and every attempt's outcome. That
    request is relayed only once ``hold`` is set (what must happen while the run is still on: the service
    refusing a stall after its idle timeout)."""

    def __init__(self, path: Path, partition: int, share: Shared, identity: Identity, thief: Identity):
        self.path, self.real, self.partition, self.share = path, path.with_name(path.name + ".real"), partition, share
        self.identity, self.thief = identity, thief  # its site's certificate, and another site's
        os.rename(path, self.real)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._relay, args=(conn,), daemon=True).start()

    def _relay(self, conn: socket.socket) -> None:
        share, misused = self.share, None
        with conn, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as worker:
            worker.connect(str(self.real))
            length = _exactly(conn, 8)
            header = _exactly(conn, struct.unpack(">Q", length)[0])
            fields = json.loads(header).get("stream-offer") or {}
            if fields:
                offer = TransportOffer.from_config(fields)
                share.on_offer(offer)
                if offer.records and offer.upload_name and share.once.acquire(blocking=False):
                    misused = offer
                    share.found.update(offer=offer, partition=self.partition)
                    _attempt(share.found, misuse_before, offer, self.identity, self.thief)
                    share.hold.wait(timeout=120)
            worker.sendall(length + header)
            forward = threading.Thread(target=_pump, args=(conn, worker), daemon=True)
            forward.start()
            _pump(worker, conn)  # the worker's reply, to the ClientApp
            forward.join(timeout=60)
        if misused is not None:
            _attempt(share.found, misuse_after, misused, self.identity, self.thief)


@dataclass
class Shared:
    """What the taps of one deployment share: the one misuse (``once``), its outcomes (``found``), what it
    waits for (``hold``), and what each offer is shown to (``on_offer``)."""

    on_offer: Callable[[TransportOffer], None]
    hold: threading.Event = field(default_factory=threading.Event)
    once: threading.Lock = field(default_factory=threading.Lock)
    found: dict = field(default_factory=dict)


def _attempt(found: dict, misuse: Callable[..., dict], offer: TransportOffer, *identities: Identity) -> None:
    """``misuse``'s outcomes into ``found``; an attempt that fails (the stream accepted it) goes there too, so
    that the test names it and the node's request is still relayed (else its round would wait out its timeout)."""
    try:
        found.update(misuse(offer, *identities))
    except Exception as err:
        found[misuse.__name__] = err


def _exactly(conn: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def _pump(source: socket.socket, sink: socket.socket) -> None:
    """Copy until ``source`` ends, then end ``sink``'s direction (the other one may still be open)."""
    try:
        while chunk := source.recv(1 << 20):
            sink.sendall(chunk)
    except OSError:
        pass
    try:
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def site_identity(credentials: Path, index: int) -> tuple[bytes, bytes]:
    """SuperNode ``index``'s client certificate and key, as ``tools.launch`` made them in ``credentials``."""
    return (credentials / f"supernode-{index}.pem").read_bytes(), (credentials / f"supernode-{index}.key").read_bytes()


def kinds(outcomes: dict[str, object]) -> dict[str, str]:
    """Each attempt's refusal kind, else the class of what it gave (``TransportError`` for what the service
    never saw, an ``AssertionError`` for what it accepted)."""
    return {name: str(o.kind) if isinstance(o, Refused) else type(o).__name__ for name, o in outcomes.items()}
