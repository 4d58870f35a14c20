"""The local IPC between a per-message ClientApp and its node worker (no torch here).

One frame = 8-byte big-endian header length, a JSON header (with the sender's
``versions.PROTOCOL_VERSION``: another one is refused), then the raw
bytes of each array in header order. Arrays are numpy buffers, sent without
pickle: a 15 MB block crosses a Unix socket in tens of milliseconds. A sender
may give a 1-D array as its pieces (``wire.pack_pieces``: one per tensor), which
go to the socket one after another: the receiver reads one array, and the
sender never joins a block-sized copy of them.

The receiver trusts nothing a frame declares: the header's length is bounded,
every array's dtype, shape and name are checked, and the sum of the declared
array sizes is compared with the receiver's bound before a single array byte is
read. Each array is then built from the bytes actually read (a frame that ends
early is refused), so memory grows only with what a peer really sends, up to
the bound. Every refusal is a ``ProtocolError`` with a one-line reason.
"""

from __future__ import annotations

import asyncio
import json
import math
import mmap
import socket
import struct
from collections.abc import Callable, Collection

import numpy as np

from ..messages import PROTOCOL_KEY
from ..versions import PROTOCOL_VERSION, mismatch

_LEN = struct.Struct(">Q")
# A header holds the run config and one entry per array (name, dtype, shape: about 150 bytes), so
# 4 MiB holds some 25,000 arrays: far above a full sync of any model this project trains.
MAX_HEADER_BYTES = 4 * 1024 * 1024
# What travels: each record packed (wire.py) as its values (fp32, fp16, bf16 as int16, int8: wire.WIRE_DTYPES),
# its layout (uint8 JSON) and int8's fp32 scales, relayed as "record/values" etc.; and any other plain number type.
ARRAY_DTYPES = frozenset(("float32", "float16", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"))
MAX_ARRAY_ELEMENTS = 2**50
MAX_ARRAY_DIMS = 32

# The receiver's bound on a frame's array bytes, given its header: (bytes, where the bound comes from).
ArrayLimit = Callable[[dict], tuple[int, str]]
# What a receiver wants in front of each array's bytes, given its dtype and shape (npy.npy_header).
Prefix = Callable[[np.dtype, tuple[int, ...]], bytes]


class UntrustedWorker(Exception):
    """The process listening on the worker's socket runs as a uid the relay does not trust: nothing was sent."""

    def __init__(self, pid: int, uid: int):
        super().__init__(f"pid {pid}, uid {uid}")
        self.pid, self.uid = pid, uid


class ProtocolError(ValueError):
    """A frame refused before (or instead of) allocating what it declares; the message is one line."""


# An array to send: one numpy array, or the 1-D pieces (one dtype) of one, sent in order without joining them.
Sendable = np.ndarray | list[np.ndarray]


def _frame(header: dict, arrays: dict[str, Sendable] | None) -> list[bytes | memoryview]:
    """The buffers of one frame: length, JSON header (with each array's name, dtype, shape), arrays."""
    pieces = {name: a if isinstance(a, list) else [a] for name, a in (arrays or {}).items()}
    specs = []
    for name, parts in pieces.items():
        dtypes = {p.dtype for p in parts}
        if len(parts) > 1 and (len(dtypes) != 1 or any(p.ndim != 1 for p in parts)):
            raise ValueError(f"array {name!r}: pieces of {sorted(map(str, dtypes))}; expected 1-D pieces of one dtype")
        shape = list(parts[0].shape) if len(parts) == 1 else [sum(p.size for p in parts)]
        specs.append({"name": name, "dtype": str(parts[0].dtype), "shape": shape})
    raw = json.dumps(dict(header, arrays=specs, **{PROTOCOL_KEY: PROTOCOL_VERSION})).encode()
    buffers = (memoryview(np.ascontiguousarray(p)).cast("B") for parts in pieces.values() for p in parts)
    return [_LEN.pack(len(raw)) + raw, *(b for b in buffers if b.nbytes)]


async def send(writer: asyncio.StreamWriter, header: dict, arrays: dict[str, Sendable] | None = None) -> None:
    for buffer in _frame(header, arrays):
        writer.write(buffer)
    await writer.drain()


async def recv(
    reader: asyncio.StreamReader | SocketReader, limit: ArrayLimit | None = None, prefix: Prefix | None = None
) -> tuple[dict, dict[str, np.ndarray | bytes]]:
    """One frame. ``limit`` bounds the sum of its arrays' bytes (the worker's side; ``None``: the reply
    a ClientApp reads from its own node's worker). Raises ``ProtocolError`` for a frame refused, and
    ``asyncio.IncompleteReadError`` when the peer sent nothing at all (it connected and left).

    Each array is a read-only numpy view of the memory its bytes were read into (``_read_array``); with
    ``prefix`` (a ``SocketReader`` only), it is instead ``bytes``: ``prefix(dtype, shape)`` followed by the
    array's bytes, which the socket writes straight behind the prefix (the ClientApp's reply: an npy payload
    for Flower's ``Array``)."""
    (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if size > MAX_HEADER_BYTES:
        raise ProtocolError(f"header of {size:,} bytes; expected at most {MAX_HEADER_BYTES:,}")
    header = _parse_header(await _read(reader, size, "the header"))
    peer, here = ("the ClientApp", "this node worker") if limit is not None else ("the node worker", "this ClientApp")
    if (problem := mismatch(header, PROTOCOL_KEY, peer, here)) is not None:
        raise ProtocolError(problem)  # before any array is read: a peer of another release is not parsed
    header.pop(PROTOCOL_KEY)
    specs = [_array_spec(i, spec) for i, spec in enumerate(header.pop("arrays"))]
    if len({name for name, _, _ in specs}) != len(specs):
        raise ProtocolError("the header names an array twice; expected unique names")
    declared = sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in specs)
    if limit is not None:
        bound, source = limit(header)
        if declared > bound:
            raise ProtocolError(
                f"message declares {declared:,} bytes of arrays; this worker accepts at most {bound:,} ({source})"
            )
    arrays = {}
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        if prefix is None:
            arrays[name] = await _read_array(reader, dtype, shape, nbytes, f"array {name!r}")
        else:
            arrays[name] = await _read_behind(reader, prefix(dtype, shape), nbytes, f"array {name!r}")
    return header, arrays


async def _read_array(
    reader: asyncio.StreamReader | SocketReader, dtype: np.dtype, shape: tuple[int, ...], nbytes: int, what: str
) -> np.ndarray:
    """Exactly ``nbytes`` read into an anonymous mapping, as a read-only array of ``dtype`` and ``shape``.
    The bytes are copied into place as they arrive, a socket buffer at a time (while they are in the
    CPU's cache): ``StreamReader.readexactly`` would first gather the whole array in a buffer of its own,
    then copy it out, two more passes over memory. The mapping's pages exist once written, so memory grows
    only with what the peer sends."""
    if nbytes == 0:
        array = np.empty(shape, dtype)
    else:
        buffer = _mapping(nbytes, nbytes, what)
        with memoryview(buffer) as view:
            await _fill(reader, view, what)
        array = np.frombuffer(buffer, dtype=dtype).reshape(shape)
    array.flags.writeable = False
    return array


def _mapping(size: int, nbytes: int, what: str) -> mmap.mmap:
    """An anonymous mapping of ``size`` bytes, for ``what`` (``nbytes`` of it declared by the peer)."""
    try:
        return mmap.mmap(-1, size)
    except (OSError, OverflowError, ValueError):
        raise ProtocolError(f"{what} declares {nbytes:,} bytes; more than this machine can map") from None


async def _fill(reader: asyncio.StreamReader | SocketReader, view: memoryview, what: str) -> None:
    """``view`` filled from the frame; ``ProtocolError`` if the frame ends first."""
    got = 0
    try:
        if isinstance(reader, SocketReader):
            await reader.readinto(view)
            return
        while got < len(view):  # what the StreamReader holds, a socket read at a time
            chunk = await reader.read(len(view) - got)
            if not chunk:
                raise asyncio.IncompleteReadError(b"", len(view))
            view[got : got + len(chunk)] = chunk
            got += len(chunk)
    except asyncio.IncompleteReadError as err:
        got = got or len(err.partial)
        raise ProtocolError(f"the frame ended after {got:,} of the {len(view):,} bytes of {what}") from None


async def _read_behind(reader: SocketReader, prefix: bytes, nbytes: int, what: str) -> bytes:
    """``prefix`` then exactly ``nbytes`` read into the buffer behind it, as ``bytes``: one copy, because
    Flower's ``Array`` takes ``bytes`` and no Python code fills a ``bytes`` in place. The buffer is an
    anonymous mapping, whose pages exist once written: memory grows only with what the peer sends,
    whatever its header declares."""
    buffer = _mapping(len(prefix) + nbytes, nbytes, what)
    buffer[: len(prefix)] = prefix
    with memoryview(buffer) as view:
        await _fill(reader, view[len(prefix) :], what)
        return bytes(view)


async def _read(reader: asyncio.StreamReader | SocketReader, nbytes: int, what: str) -> bytes:
    """Exactly ``nbytes`` (bytes accumulate as they arrive: nothing is allocated up front)."""
    try:
        return await reader.readexactly(nbytes)
    except asyncio.IncompleteReadError as err:
        raise ProtocolError(f"the frame ended after {len(err.partial):,} of the {nbytes:,} bytes of {what}") from None


def _parse_header(raw: bytes) -> dict:
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ProtocolError(f"header is not JSON ({type(err).__name__}); expected a JSON object") from None
    if not isinstance(header, dict) or not isinstance(header.get("arrays"), list):
        raise ProtocolError("header is not a JSON object with an 'arrays' list")
    return header


def _array_spec(index: int, spec) -> tuple[str, np.dtype, tuple[int, ...]]:
    """``(name, dtype, shape)`` of one declared array, each checked, with a one-line refusal."""
    if not isinstance(spec, dict):
        raise ProtocolError(f"array {index}: {type(spec).__name__}; expected an object with name, dtype, shape")
    name, dtype, shape = spec.get("name"), spec.get("dtype"), spec.get("shape")
    if not isinstance(name, str):
        raise ProtocolError(f"array {index}: name {name!r:.60}; expected a string")
    if dtype not in ARRAY_DTYPES:
        raise ProtocolError(
            f"array {name!r:.80}: dtype {dtype!r:.40}; expected one of {', '.join(sorted(ARRAY_DTYPES))}"
        )
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_ARRAY_DIMS
        or not all(type(d) is int and d >= 0 for d in shape)  # bool is not a dimension
        # huge dimensions beside a 0 declare no bytes, but numpy cannot shape them
        or math.prod(d for d in shape if d) >= MAX_ARRAY_ELEMENTS
    ):
        raise ProtocolError(
            f"array {name!r:.80}: shape {shape!r:.80}; expected a list of at most {MAX_ARRAY_DIMS} "
            f"non-negative integers whose non-zero product is below 2**50"
        )
    return name, np.dtype(dtype), tuple(shape)


async def request(
    socket_path: str,
    header: dict,
    arrays: dict[str, Sendable] | None = None,
    timeout_s: float | None = None,
    prefix: Prefix | None = None,
    on_sent: Callable[[], None] | None = None,
    worker_uids: Collection[int] | None = None,
) -> tuple[dict, dict[str, np.ndarray | bytes]]:
    """One request/response over a fresh connection to the worker (``prefix``: as ``recv`` says;
    ``on_sent``: called once the request's last byte is written, for the relay's timeline;
    ``worker_uids``: the uids the listening process may run as, checked (``SO_PEERCRED``) before a
    byte is sent, ``UntrustedWorker`` otherwise).

    The arrays go to the socket as they are (a memoryview of each, never joined: an array that is a
    view of a Flower payload is not copied), and the reply is read straight from the socket.

    A worker that refuses a request (its peer check, or a frame over its bound) answers one error
    frame and closes without reading the rest, so sending fails; its answer is still read and
    returned (from the socket itself: a stream transport would drop it with the connection)."""
    loop = asyncio.get_running_loop()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.setblocking(False)
        await loop.sock_connect(sock, socket_path)
        if worker_uids is not None:
            pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid not in worker_uids:
                raise UntrustedWorker(pid, uid)
        try:
            for buffer in _frame(header, arrays):
                await loop.sock_sendall(sock, buffer)
        except (BrokenPipeError, ConnectionResetError):
            return await asyncio.wait_for(_answer_before_close(loop, sock), timeout_s)
        if on_sent is not None:
            on_sent()
        return await asyncio.wait_for(recv(SocketReader(loop, sock), prefix=prefix), timeout_s)


class SocketReader:
    """A frame's bytes straight from a non-blocking socket: ``readinto`` lets the kernel write an array's
    bytes where they will stay (a StreamReader gathers them in a buffer of its own and copies them out)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket):
        self.loop, self.sock = loop, sock

    async def readinto(self, view: memoryview) -> None:
        """Fill ``view``; ``asyncio.IncompleteReadError`` if the peer closes first."""
        got = 0
        while got < len(view):
            n = await self.loop.sock_recv_into(self.sock, view[got:])
            if n == 0:
                raise asyncio.IncompleteReadError(bytes(view[:got]), len(view))  # copied only when it fails
            got += n

    async def readexactly(self, nbytes: int) -> bytes:
        """Exactly ``nbytes``, gathered as they arrive (as ``StreamReader.readexactly``: nothing is
        allocated for what a header only declares)."""
        buffer = bytearray()
        while len(buffer) < nbytes:
            chunk = await self.loop.sock_recv(self.sock, min(nbytes - len(buffer), 2**20))
            if not chunk:
                raise asyncio.IncompleteReadError(bytes(buffer), nbytes)
            buffer += chunk
        return bytes(buffer)


async def _answer_before_close(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> tuple[dict, dict]:
    """The (small) frame a worker sent before closing a connection it refused."""
    received = bytearray()
    while len(received) <= _LEN.size + MAX_HEADER_BYTES:
        try:
            chunk = await loop.sock_recv(sock, 65536)
        except ConnectionResetError:  # reported once what was queued has been read
            chunk = b""
        if not chunk:
            break
        received += chunk
    reader = asyncio.StreamReader()
    reader.feed_data(bytes(received))
    reader.feed_eof()
    return await recv(reader)
