"""Host buffers of a block's size, kept across rounds.

A round makes its block-sized buffers on both sides (the server's sum and new ``x[b]``, a node's snapshot, update,
residual and encoding, a record's bytes received) and frees them before the next round. A page given back to the
system costs a fault, zeroed, when the next round touches it again, and far more on a virtual machine whose
balloon hands freed pages to its host (docs/results/fresh_memory.md).

``empty`` and ``host_bytes`` serve such buffers from memory the process keeps, as a device's caching allocator
does: when the last tensor, array or memoryview over a buffer goes, the memory goes back to this pool, not to the
system, and the next buffer of the same byte size takes it, already faulted in. The pool adds nothing to what the
process holds at its peak: a buffer of a size the pool lacks is made only after idle buffers of at least its size
(the longest idle first) are given back; and what lies unused from one ``trim`` to the next (called once a round)
is given back too.

Torch-free at import (the ClientApp's transport imports it and never loads torch); ``empty`` imports torch.
"""

from __future__ import annotations

import math
import queue
import threading
import weakref
from typing import TYPE_CHECKING

import numpy as np

from .memory import LARGE_BUFFER_BYTES

if TYPE_CHECKING:
    import torch

# From the size up that the process maps afresh for each buffer; smaller ones the heap serves again in place.
KEPT_FROM_BYTES = LARGE_BUFFER_BYTES
ALIGN = 64  # bytes: a cache line, as torch aligns its own host buffers (numpy's large ones start 16 bytes in)


class KeptBlocks:
    """A pool of host buffers by byte size: ``host_bytes`` (and ``empty``) take one or make it; the end of the last
    thing over it gives it back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[np.ndarray] = []  # buffers nothing holds, the longest idle first
        self._returned: set[int] = set()  # ids of buffers given back since the last trim
        # A buffer's end may come in a garbage collection inside this class's own locked code, in the same thread:
        # it is only queued (``SimpleQueue.put`` is safe there) and taken in under the lock.
        self._back: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        self.made = self.reused = 0  # buffers allocated anew, and served from the pool (for tests)

    def host_bytes(self, nbytes: int) -> memoryview:
        """``nbytes`` uninitialised bytes, kept from ``KEPT_FROM_BYTES`` up: back in the pool when the last
        memoryview, array (``np.frombuffer``) or tensor over them goes."""
        return memoryview(self._holder(nbytes))

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype | None = None, touched: bool = False) -> torch.Tensor:
        """An uninitialised host tensor (as ``torch.empty``; fp32 by default), contiguous, in kept memory from
        ``KEPT_FROM_BYTES`` up. ``touched``: every page faulted in before it is returned: a buffer made afresh is
        written once (zeros, by numpy's single-threaded fill: no torch kernel, so a helper thread starts no OpenMP
        team); one the pool kept was touched already and is not written again (a pass over a block for nothing)."""
        import torch

        dtype = torch.float32 if dtype is None else dtype
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < KEPT_FROM_BYTES:  # the heap's, as torch's own
            out = torch.empty(shape, dtype=dtype)
            if touched:
                out.view(-1).view(torch.uint8).numpy().fill(0)
            return out
        return torch.from_numpy(self._holder(nbytes, touched)).view(dtype).view(shape)

    def _holder(self, nbytes: int, touched: bool = False) -> np.ndarray:
        """A uint8 array of ``nbytes`` that whatever uses the bytes must hold (a tensor from it, a memoryview of
        it): a view of it made by numpy holds the buffer below, not it, so it is never handed out bare.
        ``touched``: a buffer made afresh is written once (``empty``)."""
        if nbytes < KEPT_FROM_BYTES:
            return np.empty(nbytes, dtype=np.uint8)
        with self._lock:
            self._take_back()
            buffer = next((b for b in reversed(self._idle) if b.nbytes == nbytes), None)
            if buffer is not None:
                self._idle = [b for b in self._idle if b is not buffer]
                self._returned.discard(id(buffer))
                self.reused += 1
            else:
                self._make_room(nbytes)
                self.made += 1
        if buffer is None:
            raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
            start = -raw.ctypes.data % ALIGN
            buffer = raw[start : start + nbytes]
            if touched:
                buffer.fill(0)
        holder = buffer[:]
        weakref.finalize(holder, self._back.put, buffer)
        return holder

    def _take_back(self) -> None:
        """Into the idle list: the buffers queued by their give-back since the last call (under the lock)."""
        while True:
            try:
                buffer = self._back.get_nowait()
            except queue.Empty:
                return
            self._idle.append(buffer)
            self._returned.add(id(buffer))

    def _make_room(self, nbytes: int) -> None:
        """Before a new buffer: give back idle buffers of at least ``nbytes`` (under the lock), the longest idle
        first, so that the pool never holds memory beside what the process would have made anyway."""
        freed = 0
        while self._idle and freed < nbytes:
            buffer = self._idle.pop(0)
            self._returned.discard(id(buffer))
            freed += buffer.nbytes

    def trim(self) -> int:
        """Give the system back every buffer that lay unused since the last trim (call once a round); the bytes
        given back."""
        with self._lock:
            self._take_back()
            kept = [b for b in self._idle if id(b) in self._returned]
            dropped = sum(b.nbytes for b in self._idle) - sum(b.nbytes for b in kept)
            self._idle = kept
            self._returned = set()
        return dropped

    def clear(self) -> int:
        """Give the system back every idle buffer (a new run starts: none of the last one's sizes may recur); the
        bytes given back."""
        with self._lock:
            self._take_back()
            dropped = sum(b.nbytes for b in self._idle)
            self._idle, self._returned = [], set()
        return dropped

    def idle_bytes(self) -> int:
        """What the pool holds that nothing uses."""
        with self._lock:
            self._take_back()
            return sum(b.nbytes for b in self._idle)


KEPT = KeptBlocks()  # the process's pool: every module's block-sized host buffers share it
host_bytes = KEPT.host_bytes


def empty(shape, dtype: torch.dtype | None = None, device=None, touched: bool = False) -> torch.Tensor:
    """``torch.empty`` (fp32 by default), from the process's pool on the host (a device's own caching allocator
    keeps its memory); ``touched``: as ``KeptBlocks.empty``'s (on the host only: a device has no page to fault)."""
    import torch

    if device is not None and torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=dtype or torch.float32, device=device)
    return KEPT.empty(tuple(shape) if not isinstance(shape, int) else (shape,), dtype, touched)
