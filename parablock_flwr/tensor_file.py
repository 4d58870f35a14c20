"""Block-sized files written past the page cache, every round: a node's residual (its block in fp32), the server's
step log and snapshots, a virtual node's pending update (``write_tensors``: safetensors files), and the clients'
pending updates staged for the checkpoint (``append_pieces``).

``safetensors``' ``save_file`` writes through the page cache: the kernel copies every byte into cache pages it
makes, and ``fsync`` then writes them out. For a residual (944 MB of fp32 beside a 236 MB int8 block) that copy
cost the worker about a CPU second a round on one core (22 % of its cycles in a ``perf`` probe beside the
stand-in), for a file only a resume ever reads. Here the bytes go with ``O_DIRECT``: they pass through a small
page-aligned buffer at memory speed and the disk reads them from it, so ``fsync`` has only the device to flush.
Where the file system refuses ``O_DIRECT`` (tmpfs before Linux 6.6) or its alignment, the same bytes go through
the page cache.

A safetensors header is the format's own (an 8-byte length, then JSON giving each tensor's dtype, shape and byte
range, and the file's metadata), padded with spaces, as the format allows, so that the data starts on a page;
``safetensors`` reads the file back (``load_file``, ``safe_open``).
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

# O_DIRECT's alignment of memory, offset and length: a multiple of the logical block of the disks in use (512 or
# 4096 bytes); one whose block is larger refuses it, and the bytes then go through the page cache.
DIRECT_ALIGNMENT = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux's; elsewhere every write goes through the page cache
IN_MEMORY_FILE_SYSTEMS = {"tmpfs", "ramfs"}  # their files are page-cache pages, whatever the open's flags
STAGING_BYTES = 8 << 20  # what passes through one aligned buffer per write (the disk's pace from 4 MiB up)
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip

_idle_staging: list[mmap.mmap] = []  # page-aligned buffers between writes (one per writer at once)
_staging_lock = threading.Lock()


def write_tensors(
    path: Path | str, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> None:
    """``tensors`` (host or device; views of one array too) as a safetensors file at ``path``, fsynced: what
    ``safetensors.torch.save_file`` and an ``fsync`` leave, without the page cache's copy. Raises ``ValueError``
    before writing for a dtype this writer does not name (those a run writes: ``SAFETENSORS_DTYPES``), naming the
    tensor, or metadata that is not text (safetensors would refuse the file only when it is read)."""
    if metadata and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError(f"metadata {dict(metadata)!r}: expected text keys and values")
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
    text += b" " * (-(8 + len(text)) % DIRECT_ALIGNMENT)  # the data on a page
    head = struct.pack("<Q", len(text)) + text
    _write_file(Path(path), [np.frombuffer(head, dtype=np.uint8), *sources])


def append_pieces(path: Path | str, pieces: Mapping[str, list[np.ndarray]]) -> dict[str, int]:
    """Each key's 1-D parts, one after the other, appended to ``path`` past the page cache, each key's from a page
    of its own (the gaps are zeros); where each key's bytes start. One writer at a time (the checkpoint's staged
    pending updates: ``checkpoint.stage_pending``, on the server's one staging thread). Not fsynced: its caller
    makes the whole folder durable."""
    fd = _open_direct(path, os.O_WRONLY | os.O_CREAT)
    try:
        at, offsets = os.fstat(fd).st_size, {}
        for key, parts in pieces.items():
            offsets[key] = at = -(-at // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT
            at += _write_pages(fd, [memoryview(np.ascontiguousarray(p)).cast("B") for p in parts], at)
    finally:
        os.close(fd)
    return offsets


def _write_file(path: Path, sources: list[np.ndarray]) -> None:
    """The bytes of ``sources`` one after the other in a new file at ``path``, fsynced (the last page's padding cut
    off)."""
    fd = _open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.ftruncate(fd, _write_pages(fd, sources, 0))
        os.fsync(fd)
    finally:
        os.close(fd)


def takes_direct_io(folder: Path | str) -> bool:
    """Whether a file written in ``folder`` bypasses the page cache: its file system opens files with ``O_DIRECT``
    (a probe file made and removed there) and keeps them on a device, not in memory (tmpfs takes ``O_DIRECT``
    from Linux 6.6, but its files are the page cache)."""
    probe = Path(folder) / f".direct-io-probe-{os.getpid()}-{threading.get_ident()}"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | O_DIRECT, 0o600))
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise
        return False
    finally:
        probe.unlink(missing_ok=True)
    return bool(O_DIRECT) and file_system(folder) not in IN_MEMORY_FILE_SYSTEMS


def file_system(folder: Path | str) -> str | None:
    """The type of the file system ``folder`` is on, from ``/proc/self/mountinfo`` (None where it cannot say)."""
    device = os.stat(folder).st_dev
    wanted = f"{os.major(device)}:{os.minor(device)}"
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()  # ... major:minor (third) ... - fstype source options
                if fields[2] == wanted and "-" in fields:
                    return fields[fields.index("-") + 1]
    except OSError:
        pass
    return None


def _open_direct(path: Path | str, flags: int) -> int:
    """``path`` opened with ``O_DIRECT``, or without it on a file system that refuses it (tmpfs before Linux 6.6)."""
    flags |= os.O_CLOEXEC
    try:
        return os.open(path, flags | O_DIRECT, 0o666)
    except OSError as err:
        if err.errno != errno.EINVAL or not O_DIRECT:
            raise
        return os.open(path, flags, 0o666)


def _write_pages(fd: int, sources: list, offset: int) -> int:
    """The bytes of ``sources`` (arrays or byte views) one after the other from ``offset`` (a page's start), whole
    pages through an aligned staging buffer, the last one padded with zeros; the bytes of ``sources``."""
    staging = _take_staging()
    try:
        buffer, filled, written = np.frombuffer(staging, dtype=np.uint8), 0, 0
        for source in sources:
            source, at = np.frombuffer(source, dtype=np.uint8), 0
            while at < source.nbytes:
                n = min(source.nbytes - at, STAGING_BYTES - filled)
                buffer[filled : filled + n] = source[at : at + n]
                filled, at = filled + n, at + n
                if filled == STAGING_BYTES:
                    _pwrite_all(fd, memoryview(staging), offset + written)
                    filled, written = 0, written + STAGING_BYTES
        if filled:
            whole = -(-filled // DIRECT_ALIGNMENT) * DIRECT_ALIGNMENT
            buffer[filled:whole] = 0
            _pwrite_all(fd, memoryview(staging)[:whole], offset + written)
            written += filled
        del buffer
        return written
    finally:
        _give_back_staging(staging)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """All of ``data`` at ``offset``; a file system that refuses this alignment for O_DIRECT gets the rest
    through the page cache."""
    while data.nbytes:
        try:
            n = os.pwrite(fd, data, offset)
        except OSError as err:
            mode = fcntl.fcntl(fd, fcntl.F_GETFL)
            if err.errno != errno.EINVAL or not mode & O_DIRECT:
                raise
            fcntl.fcntl(fd, fcntl.F_SETFL, mode & ~O_DIRECT)
            continue
        if n <= 0:
            raise OSError(errno.EIO, f"wrote {n} of {data.nbytes} bytes at offset {offset}")
        data, offset = data[n:], offset + n


def _take_staging() -> mmap.mmap:
    with _staging_lock:
        if _idle_staging:
            return _idle_staging.pop()
    return mmap.mmap(-1, STAGING_BYTES, flags=mmap.MAP_PRIVATE)  # anonymous: page-aligned; a forked child's own


def _give_back_staging(staging: mmap.mmap) -> None:
    with _staging_lock:
        _idle_staging.append(staging)
