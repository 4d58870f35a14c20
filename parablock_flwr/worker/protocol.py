"""The local IPC between a per-message ClientApp and its node worker (no torch here).

One frame = 8-byte big-endian header length, a JSON header, then the raw
bytes of each array in header order. Arrays are numpy buffers, sent without
pickle: a 15 MB block crosses a Unix socket in tens of milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import struct

import numpy as np

_LEN = struct.Struct(">Q")
MAX_HEADER = 16 * 1024 * 1024


async def send(writer: asyncio.StreamWriter, header: dict, arrays: dict[str, np.ndarray] | None = None) -> None:
    arrays = arrays or {}
    header = dict(
        header, arrays=[{"name": n, "dtype": str(a.dtype), "shape": list(a.shape)} for n, a in arrays.items()]
    )
    raw = json.dumps(header).encode()
    writer.write(_LEN.pack(len(raw)) + raw)
    for a in arrays.values():
        writer.write(memoryview(np.ascontiguousarray(a)).cast("B"))
    await writer.drain()


async def recv(reader: asyncio.StreamReader) -> tuple[dict, dict[str, np.ndarray]]:
    (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if size > MAX_HEADER:
        raise ValueError(f"IPC header of {size} bytes, expected at most {MAX_HEADER}")
    header = json.loads(await reader.readexactly(size))
    arrays = {}
    for spec in header.pop("arrays"):
        dtype, shape = np.dtype(spec["dtype"]), tuple(spec["shape"])
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        arrays[spec["name"]] = np.frombuffer(await reader.readexactly(nbytes), dtype=dtype).reshape(shape)
    return header, arrays


async def request(
    socket_path: str, header: dict, arrays: dict[str, np.ndarray] | None = None, timeout_s: float | None = None
) -> tuple[dict, dict[str, np.ndarray]]:
    """One request/response over a fresh connection to the worker."""
    reader, writer = await asyncio.open_unix_connection(socket_path, limit=2**26)
    try:
        await send(writer, header, arrays)
        return await asyncio.wait_for(recv(reader), timeout_s)
    finally:
        writer.close()
        await writer.wait_closed()
