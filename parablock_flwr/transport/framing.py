"""A block record's bytes on the stream: its arrays' npy payloads (what Flower's ``Array.data`` holds, the
packed arrays of ``wire.py``) behind a small index, so that the receiver rebuilds exactly what Flower's
path would have delivered and checks it the same way (``wire.unpack``, the reply checks).

    4 bytes: the index's length (big-endian) | index: JSON [[array name, payload bytes], ...] | payloads

The receiver has checked the bytes' SHA-256 against the one in Flower's authenticated message before it
reads them here; the index is still read strictly (bounded, names and sizes checked, each payload a plain
npy array), since nothing read off a network is trusted to be well formed. numpy only: the node worker
and the server read it, and neither Flower nor torch is needed.

A record is framed as ``Buffers``, its parts in order (the index, then each payload's npy header and
values), never joined: the sender hashes them and cuts the stream's chunks from them, and the server reads
an upload's payloads where it landed (``unframe``; ``service.KeptUpload``), so that neither side copies a whole
record on its way.
"""

from __future__ import annotations

import bisect
import hashlib
import hmac
import json
import re
from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from ..messages import MessageError
from ..npy import HEAD_BYTES, NpyError, npy_header, npy_view

MAX_INDEX_BYTES = 64 * 1024
ARRAY_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class FramingError(ValueError):
    """Bytes that are not a framed record; the message is one line naming what is wrong."""


class Buffers:
    """A record's bytes as buffers in order (the module's docstring): their length, their SHA-256, the
    stream's chunks and any range, each read without joining the whole."""

    def __init__(self, parts: Iterable = ()) -> None:
        self.parts: list[memoryview] = []
        self._ends: list[int] = []  # each part's end offset, for ``read``
        for part in parts:
            self.append(part)

    def append(self, part) -> None:
        view = memoryview(part).cast("B")
        if view.nbytes:
            self.parts.append(view)
            self._ends.append(len(self) + view.nbytes)

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def sha256(self) -> str:
        digest = hashlib.sha256()
        for part in self.parts:
            digest.update(part)
        return digest.hexdigest()

    def chunks(self, size: int) -> Iterator[bytes]:
        """The bytes in chunks of ``size`` (the last one shorter), each copied once from the parts."""
        for start in range(0, len(self), size):
            yield self.read(start, min(start + size, len(self)))

    def read(self, start: int, stop: int) -> bytes:
        """Bytes ``start:stop`` (within the record) as new bytes: one copy, across parts where they span several."""
        first = bisect.bisect_right(self._ends, start)
        if start >= stop:
            return b""
        pieces, at = [], start
        for i in range(first, len(self.parts)):
            if at >= stop:
                break
            begin = self._ends[i] - self.parts[i].nbytes
            pieces.append(self.parts[i][at - begin : min(stop, self._ends[i]) - begin])
            at = min(stop, self._ends[i])
        return pieces[0].tobytes() if len(pieces) == 1 else b"".join(pieces)

    def tobytes(self) -> bytes:
        return b"".join(self.parts)


def frame(payloads: Mapping[str, object]) -> bytes:
    """One record's bytes: ``payloads`` maps each array's name to its npy payload (bytes-like, or an object
    with ``.data``, as Flower's ``Array``), copied once into the result."""
    return framed(payloads).tobytes()


def framed(payloads: Mapping[str, object]) -> Buffers:
    """``frame``'s bytes as ``Buffers`` of the payloads themselves: nothing copied. ``bytes`` and read-only views
    (of memory this app never writes again: the server's step where its pass wrote it, ``wire.encoding_payloads``)
    are taken as they are; any other payload (a mutable buffer) is copied first, so that what is hashed is what is
    sent."""

    def owned(p):
        data = getattr(p, "data", p)
        if isinstance(data, bytes) or (isinstance(data, memoryview) and data.readonly):
            return data
        return bytes(memoryview(data).cast("B"))

    return _joined({name: [owned(p)] for name, p in payloads.items()})


def framed_pieces(pieces: Mapping[str, list[np.ndarray]]) -> Buffers:
    """The record of the arrays ``wire.pack_pieces`` returns as 1-D pieces, as ``Buffers`` of the pieces' own
    memory: nothing copied (the sender cuts its chunks from them, ``Buffers.chunks``). The pieces must not
    change until the upload returns: they are hashed as they are sent."""
    buffers = {}
    for name, array_pieces in pieces.items():
        header = npy_header(array_pieces[0].dtype, (sum(p.size for p in array_pieces),))
        buffers[name] = [header, *(memoryview(np.ascontiguousarray(p)).cast("B") for p in array_pieces)]
    return _joined(buffers)


def _joined(buffers: Mapping[str, list]) -> Buffers:
    """The index of each array's name and size, then every array's buffers in order."""
    for name in buffers:
        if not ARRAY_NAME.fullmatch(name):
            raise FramingError(f"array name {name!r:.40}: expected 1-64 of A-Z a-z 0-9 _ . -")
    index = [[name, sum(memoryview(b).nbytes for b in parts)] for name, parts in buffers.items()]
    text = json.dumps(index, separators=(",", ":")).encode()
    return Buffers([len(text).to_bytes(4, "big") + text, *(b for parts in buffers.values() for b in parts)])


def unframe(data: bytes | bytearray | memoryview, record: str) -> dict[str, memoryview]:
    """The npy payload of each array of a framed record (views of ``data``: nothing copied), each checked to
    be a plain npy array of the length its header says. Raises ``FramingError`` naming ``record``."""
    view = memoryview(data).cast("B")
    entries = _entries(view.nbytes, lambda start, stop: bytes(view[start:stop]), record)
    return _checked({name: view[start:stop] for name, start, stop in entries}, record)


def landed_far_enough(data: memoryview, landed: int, record: str, last: str) -> dict[str, memoryview] | None:
    """``unframe``'s payloads of a record whose declared bytes are ``data`` while only the first ``landed`` of them
    have landed: once its index, every payload but the last, and the last's npy header have, where the last is the
    array ``last`` (a packed record's ``values``, which a reader reads chunk by chunk as they land:
    ``wire.LandingArrays``; every other array is read whole, so it must have landed whole); None before, and for a
    record whose arrays come in another order (it is read once it has landed whole). Raises ``FramingError`` for an
    index that is not one (the claim refuses the whole record then)."""
    view = memoryview(data).cast("B")
    if landed < 4 or landed < 4 + int.from_bytes(view[:4], "big"):
        return None
    entries = _entries(view.nbytes, lambda start, stop: bytes(view[start:stop]), record)
    if not entries or entries[-1][0] != last:
        return None
    *before, (_, start, stop) = entries
    if landed < max([start + min(HEAD_BYTES, stop - start), *(end for *_, end in before)]):
        return None
    return _checked({name: view[start:stop] for name, start, stop in entries}, record)


def payloads(data, record: str) -> dict[str, bytes]:
    """``unframe``'s payloads as bytes of their own (what Flower's ``Array.data`` holds), each copied once from
    ``data``: bytes-like, or anything with ``len`` and ``read(start, stop)`` as ``Buffers`` (an upload the server
    received into a file, ``service.SpillFile``). Raises ``FramingError`` naming ``record``."""
    if isinstance(data, bytes | bytearray | memoryview):
        data = Buffers([data])
    entries = _entries(len(data), data.read, record)
    return _checked({name: data.read(start, stop) for name, start, stop in entries}, record)


def _entries(nbytes: int, read, record: str) -> list[tuple[str, int, int]]:
    """Each array's name and the offsets of its payload, from the index ``read(start, stop)`` gives; the
    payloads must fill the record exactly."""
    if nbytes < 4:
        raise FramingError(f"record {record}: {nbytes} bytes, shorter than its index length")
    length = int.from_bytes(read(0, 4), "big")
    if length > min(MAX_INDEX_BYTES, nbytes - 4):
        raise FramingError(f"record {record}: an index of {length} bytes; at most {MAX_INDEX_BYTES} and the record's")
    offset, out, seen = 4 + length, [], set()
    for name, size in _index(read(4, 4 + length), record):
        if name in seen:
            raise FramingError(f"record {record}: array {name} twice")
        seen.add(name)
        out.append((name, offset, offset + size))
        offset += size
    if offset != nbytes:
        raise FramingError(f"record {record}: {nbytes} bytes; its index accounts for {offset}")
    return out


def _checked(out: dict, record: str) -> dict:
    for name, payload in out.items():
        try:
            npy_view(payload, f"{record}/{name}")
        except NpyError as err:
            raise FramingError(str(err)) from None
    return out


def arrays(data: bytes | bytearray | memoryview, record: str) -> dict[str, np.ndarray]:
    """A framed record's arrays, as read-only views of ``data`` (the form ``wire.unpack`` reads)."""
    return {name: npy_view(payload, f"{record}/{name}") for name, payload in unframe(data, record).items()}


def _index(text: bytes, record: str) -> list[tuple[str, int]]:
    try:
        entries = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise FramingError(f"record {record}: its index is not UTF-8 JSON") from None
    if not isinstance(entries, list):
        raise FramingError(f"record {record}: its index is a JSON {type(entries).__name__}; expected a list")
    for entry in entries:
        ok = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)
        if not (ok and ARRAY_NAME.fullmatch(entry[0]) and type(entry[1]) is int and entry[1] >= 0):
            raise FramingError(f"record {record}: index entry {entry!r:.40}; expected [array name, bytes]")
    return [(name, size) for name, size in entries]


# ------------------------------------------------------------------ a message's content, sealed
TAG_BYTES = 32  # HMAC-SHA256


def seal(key: bytes, content: bytes) -> bytes:
    """``content`` behind its HMAC-SHA256 under ``key``, which reached the node in Flower's authenticated
    message: the content is then as authentic as that message, over TLS or not."""
    return hmac.digest(key, content, "sha256") + content


def unseal(key: bytes, data: bytes | bytearray) -> bytes:
    """The content ``seal`` wrote under ``key``; ``MessageError`` when its HMAC is not the key's."""
    tag, content = bytes(data[:TAG_BYTES]), bytes(data[TAG_BYTES:])
    if len(data) < TAG_BYTES or not hmac.compare_digest(tag, hmac.digest(key, content, "sha256")):
        raise MessageError("message content on the stream: its HMAC is not the one the message's key gives")
    return content
