"""A block record's bytes on the stream: its arrays' npy payloads (what Flower's ``Array.data`` holds, the
packed arrays of ``wire.py``) behind a small index, so that the receiver rebuilds exactly what Flower's
path would have delivered and checks it the same way (``wire.unpack``, the reply checks).

    4 bytes: the index's length (big-endian) | index: JSON [[array name, payload bytes], ...] | payloads

The receiver has checked the bytes' SHA-256 against the one in Flower's authenticated message before it
reads them here; the index is still read strictly (bounded, names and sizes checked, each payload a plain
npy array), since nothing read off a network is trusted to be well formed. numpy only: the node worker
and the server read it, and neither Flower nor torch is needed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

import numpy as np

from ..npy import NpyError, npy_header, npy_view

MAX_INDEX_BYTES = 64 * 1024
ARRAY_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class FramingError(ValueError):
    """Bytes that are not a framed record; the message is one line naming what is wrong."""


def frame(payloads: Mapping[str, object]) -> bytes:
    """One record's bytes: ``payloads`` maps each array's name to its npy payload (bytes-like, or an object
    with ``.data``, as Flower's ``Array``), copied once into the result."""
    return _joined({name: [memoryview(getattr(p, "data", p)).cast("B")] for name, p in payloads.items()})


def frame_pieces(pieces: Mapping[str, list[np.ndarray]]) -> bytes:
    """``frame`` of the arrays ``wire.pack_pieces`` returns as 1-D pieces (joined, each array is one npy
    payload): the pieces are copied once, into the result, never joined on their own first."""
    buffers = {}
    for name, array_pieces in pieces.items():
        header = npy_header(array_pieces[0].dtype, (sum(p.size for p in array_pieces),))
        buffers[name] = [header, *(memoryview(np.ascontiguousarray(p)).cast("B") for p in array_pieces)]
    return _joined(buffers)


def _joined(buffers: Mapping[str, list]) -> bytes:
    """The index of each array's name and size, then every array's buffers in order, in one copy."""
    for name in buffers:
        if not ARRAY_NAME.fullmatch(name):
            raise FramingError(f"array name {name!r:.40}: expected 1-64 of A-Z a-z 0-9 _ . -")
    index = [
        [name, sum(len(b) if isinstance(b, bytes) else b.nbytes for b in parts)] for name, parts in buffers.items()
    ]
    text = json.dumps(index, separators=(",", ":")).encode()
    return b"".join([len(text).to_bytes(4, "big"), text, *(b for parts in buffers.values() for b in parts)])


def unframe(data: bytes | bytearray | memoryview, record: str) -> dict[str, memoryview]:
    """The npy payload of each array of a framed record (views of ``data``: nothing copied), each checked to
    be a plain npy array of the length its header says. Raises ``FramingError`` naming ``record``."""
    view = memoryview(data).cast("B")
    if view.nbytes < 4:
        raise FramingError(f"record {record}: {view.nbytes} bytes, shorter than its index length")
    length = int.from_bytes(view[:4], "big")
    if length > min(MAX_INDEX_BYTES, view.nbytes - 4):
        raise FramingError(f"record {record}: an index of {length} bytes; at most {MAX_INDEX_BYTES} and the record's")
    entries = _index(bytes(view[4 : 4 + length]), record)
    offset, out = 4 + length, {}
    for name, size in entries:
        if name in out:
            raise FramingError(f"record {record}: array {name} twice")
        out[name] = view[offset : offset + size]
        offset += size
    if offset != view.nbytes:
        raise FramingError(f"record {record}: {view.nbytes} bytes; its index accounts for {offset}")
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
