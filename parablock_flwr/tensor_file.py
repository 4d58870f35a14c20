"""Safetensors files written past the page cache: a node's residual (its block in fp32, every round), the server's
step log and snapshots, a virtual node's pending update.

``safetensors``' ``save_file`` writes through the page cache: the kernel copies every byte into cache pages it
makes, and ``fsync`` then writes them out. For a residual (944 MB of fp32 beside a 236 MB int8 block) that copy
cost the worker about a CPU second a round on one core (22 % of its cycles in ``perf`` beside the stand-in), for
a file only a resume ever reads. ``write_tensors`` writes the same format with ``O_DIRECT``: the tensors pass
through a small page-aligned buffer at memory speed and the disk reads them from it, so ``fsync`` has only the
device to flush. Where the file system refuses ``O_DIRECT`` (tmpfs) or its alignment, the same bytes go through
the page cache.

The header is the format's own (an 8-byte length, then JSON giving each tensor's dtype, shape and byte range, and
the file's metadata), padded with spaces, as the format allows, so that the data starts on a page; ``safetensors``
reads the file back (``load_file``, ``safe_open``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import struct
import threading
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

PAGE = 4096  # O_DIRECT's alignment of memory, offset and length: a multiple of any disk's logical block
STAGING_BYTES = 8 << 20  # what passes through one aligned buffer per write (the disk's pace from 4 MiB up)
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip

_idle_staging: list[mmap.mmap] = []  # page-aligned buffers between writes (one per writer at once)
_staging_lock = threading.Lock()


def write_tensors(path: Path | str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None):
    """``tensors`` (host or device; views of one array too) as a safetensors file at ``path``, fsynced: what
    ``safetensors.torch.save_file`` and an ``fsync`` leave, without the page cache's copy. Raises ``ValueError``
    for a dtype the format lacks, naming the tensor."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    sources, offset = [], 0
    for name, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"tensor {name}: dtype {tensor.dtype}; expected one of {list(SAFETENSORS_DTYPES)}")
        data = tensor.reshape(-1).view(torch.uint8).numpy()  # its bytes (numpy has no bf16)
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + data.nbytes]}  # fmt: skip
        sources.append(data)
        offset += data.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % PAGE)  # the data on a page
    head = struct.pack("<Q", len(text)) + text
    _write_durably(Path(path), [np.frombuffer(head, dtype=np.uint8), *sources])


def _write_durably(path: Path, sources: list[np.ndarray]) -> None:
    """The bytes of ``sources`` one after the other in a new file at ``path``, fsynced: whole pages from an aligned
    buffer (the last one padded, then the file cut to its length)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | os.O_DIRECT, 0o666)
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        fd = os.open(path, flags, 0o666)  # a file system without O_DIRECT (tmpfs)
    staging = _take_staging()
    try:
        buffer, filled, written = np.frombuffer(staging, dtype=np.uint8), 0, 0
        for source in sources:
            at = 0
            while at < source.nbytes:
                n = min(source.nbytes - at, STAGING_BYTES - filled)
                buffer[filled : filled + n] = source[at : at + n]
                filled, at = filled + n, at + n
                if filled == STAGING_BYTES:
                    _pwrite_all(fd, memoryview(staging), written)
                    filled, written = 0, written + STAGING_BYTES
        if filled:
            whole = -(-filled // PAGE) * PAGE
            buffer[filled:whole] = 0
            _pwrite_all(fd, memoryview(staging)[:whole], written)
            written += filled
        del buffer
        os.ftruncate(fd, written)
        os.fsync(fd)
    finally:
        os.close(fd)
        _give_back_staging(staging)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """All of ``data`` at ``offset``; a file system that refuses this alignment for O_DIRECT gets the rest
    through the page cache."""
    while data.nbytes:
        try:
            n = os.pwrite(fd, data, offset)
        except OSError as err:
            mode = fcntl.fcntl(fd, fcntl.F_GETFL)
            if err.errno != errno.EINVAL or not mode & os.O_DIRECT:
                raise
            fcntl.fcntl(fd, fcntl.F_SETFL, mode & ~os.O_DIRECT)
            continue
        if n <= 0:
            raise OSError(errno.EIO, f"wrote {n} of {data.nbytes} bytes at offset {offset}")
        data, offset = data[n:], offset + n


def _take_staging() -> mmap.mmap:
    with _staging_lock:
        if _idle_staging:
            return _idle_staging.pop()
    return mmap.mmap(-1, STAGING_BYTES)  # anonymous: page-aligned


def _give_back_staging(staging: mmap.mmap) -> None:
    with _staging_lock:
        _idle_staging.append(staging)
