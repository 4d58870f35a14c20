"""The node side of the stream service: upload a record, download a published one.

A node gets its capability (a Ticket) and, for a download, the record's size and SHA-256 from
Flower's message; it checks both before it hands the bytes on.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import grpc

from parablock_flwr import kept_blocks
from parablock_flwr.transport.capabilities import Direction, RefusalKind, Refused, Ticket
from parablock_flwr.transport.framing import Buffers
from parablock_flwr.transport.headers import encode_header
from parablock_flwr.transport.service import CHUNK_BYTES, DOWNLOAD, KEEPALIVE_S, UPLOAD, channel_options


class TransportError(Exception):
    """The stream failed for a reason that is not a refusal (unreachable, broken): the caller falls back.
    ``code``: gRPC's status code name (``UNAVAILABLE``: the service could not be reached, TLS included)."""

    def __init__(self, text: str, code: str = ""):
        super().__init__(text)
        self.code = code


def _identity(b):
    return b


class TransportClient:
    """A channel to the stream service: TLS with the operator's CA (a file, or its PEM bytes as a node gets
    them in Flower's message), or plaintext with ``insecure=True``; a call that moves no bytes is pinged
    every ``keepalive_s`` and ends when the service does not answer (``service.channel_options``).
    ``identity``: the node's client certificate and key (PEM bytes), for a service that requires mutual TLS."""

    def __init__(
        self,
        address: str,
        ca_file: Path | None = None,
        insecure: bool = False,
        timeout_s: float | None = None,
        ca_pem: bytes | None = None,
        connect_timeout_s: float | None = None,
        keepalive_s: float = KEEPALIVE_S,
        identity: tuple[bytes, bytes] | None = None,
    ):
        if insecure and identity is not None:
            raise ValueError("a client certificate with insecure=True; mutual TLS needs TLS")
        if insecure == (ca_file is not None or bool(ca_pem)) or (ca_file is not None and ca_pem):
            raise ValueError(
                f"ca_file={ca_file!r}, ca_pem given: {bool(ca_pem)}, insecure={insecure}; give one CA (file or PEM) "
                f"for TLS, or insecure=True"
            )
        options = channel_options(keepalive_s)
        if connect_timeout_s is not None:  # gRPC's connection attempt lasts at least this (default 20 s)
            options.append(("grpc.min_reconnect_backoff_ms", max(1, int(connect_timeout_s * 1000))))
        if insecure:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            root = ca_pem if ca_pem else Path(ca_file).read_bytes()
            cert, key = identity or (None, None)
            credentials = grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=cert)
            self._channel = grpc.secure_channel(address, credentials, options=options)
        self.timeout_s = timeout_s  # each call's deadline (None: none)
        self._upload = self._channel.stream_unary(UPLOAD, request_serializer=_identity, response_deserializer=_identity)
        self._download = self._channel.unary_stream(
            DOWNLOAD, request_serializer=_identity, response_deserializer=_identity
        )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def upload(self, ticket: Ticket, data: Buffers | bytes | bytearray | memoryview, sha256: str | None = None) -> str:
        """Send ``data`` under ``ticket`` (``Buffers``: its chunks cut from the parts, never joined); its SHA-256
        (hex: what the Flower reply will carry). Without ``sha256`` the bytes are hashed as they are sent and
        the digest follows them (the header declares none), so that the first chunk leaves at once; with it,
        the header declares it."""
        if ticket.direction is not Direction.UPLOAD:
            raise ValueError(f"a {ticket.direction} ticket for upload; expected an upload ticket")
        data = data if isinstance(data, Buffers) else Buffers([data])
        digest = hashlib.sha256()

        def messages():
            yield encode_header(ticket, len(data), sha256 or "")
            for chunk in data.chunks(CHUNK_BYTES):
                if not sha256:
                    digest.update(chunk)
                yield chunk
            if not sha256:
                yield digest.hexdigest().encode()

        self._call(lambda: self._upload(messages(), timeout=self.timeout_s))
        return sha256 or digest.hexdigest()

    def download(self, ticket: Ticket, size: int, sha256: str) -> memoryview:
        """The record ``ticket`` names, checked against ``size`` and ``sha256`` from Flower's message, in memory
        kept across rounds (``kept_blocks``: a block's pages already faulted in, not made afresh each round)."""
        if ticket.direction is not Direction.DOWNLOAD:
            raise ValueError(f"a {ticket.direction} ticket for download; expected a download ticket")

        def receive() -> memoryview:
            data, digest, got = kept_blocks.host_bytes(size), hashlib.sha256(), 0
            for chunk in self._download(encode_header(ticket), timeout=self.timeout_s):
                if got + len(chunk) > size:
                    raise TransportError(f"record {ticket.record!r}: more than the announced {size} bytes")
                data[got : got + len(chunk)] = chunk
                digest.update(chunk)
                got += len(chunk)
            if got != size:
                raise TransportError(f"record {ticket.record!r}: {got} bytes; announced {size}")
            if not hmac.compare_digest(digest.hexdigest(), sha256):
                raise TransportError(f"record {ticket.record!r}: SHA-256 differs from the announced one")
            return data

        return self._call(receive)

    def download_unannounced(
        self, ticket: Ticket, max_size: int, expected_size: int = 0
    ) -> tuple[bytearray | memoryview, str]:
        """The record ``ticket`` names, before Flower's message announces its size and SHA-256 (a download
        issued a round ahead, which waits on the server until the record is published): its bytes, at most
        ``max_size``, and their SHA-256 (hex). The caller uses them only when they equal the announcement.

        ``expected_size``: the size the record most likely has (a step's: the node's own update of that block,
        the same arrays in the same dtype). Its bytes are received into kept memory of that size
        (``kept_blocks``: faulted in once, not afresh each round; taken when the first byte comes, once the
        round before has given its own back), and one that turns out larger moves to a buffer that grows as it
        comes. Never one of ``max_size`` (a step in fp32, four times an int8 one): it would take the pool's
        room for the round's other buffers."""
        if ticket.direction is not Direction.DOWNLOAD:
            raise ValueError(f"a {ticket.direction} ticket for download; expected a download ticket")

        def receive() -> tuple[bytearray | memoryview, str]:
            kept, grown, got, digest = None, bytearray(), 0, hashlib.sha256()
            for chunk in self._download(encode_header(ticket), timeout=self.timeout_s):
                end = got + len(chunk)
                if end > max_size:
                    raise TransportError(f"record {ticket.record!r}: more than the bound of {max_size} bytes")
                if kept is None and not grown and 0 < expected_size <= max_size:
                    kept = kept_blocks.host_bytes(expected_size)
                if kept is not None and end <= len(kept):
                    kept[got:end] = chunk
                else:
                    if kept is not None:  # larger than expected: what came so far moves to the growing buffer
                        grown, kept = bytearray(kept[:got]), None
                    grown += chunk
                digest.update(chunk)
                got = end
            return (kept[:got] if kept is not None else grown), digest.hexdigest()

        return self._call(receive)

    @staticmethod
    def _call(fn):
        """Run a call; a refusal comes back as Refused (its kind parsed from the details), anything
        else as TransportError."""
        try:
            return fn()
        except grpc.RpcError as error:
            details = error.details() or ""
            prefix, _, rest = details.partition(": ")
            kind = prefix.removeprefix("refused ")
            if prefix.startswith("refused ") and kind in RefusalKind.__members__.values():
                raise Refused(RefusalKind(kind), rest) from None
            raise TransportError(f"{error.code().name}: {details}", error.code().name) from None
