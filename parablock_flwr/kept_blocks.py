"""Host buffers of a block's size, kept across rounds.

A round makes its block-sized buffers afresh on both sides (the server's sum and new ``x[b]``, a node's residual
and encoding) and frees them before the next round. A page given back to the system costs a fault, zeroed, when
the next round touches it again, and far more on a virtual machine whose balloon hands freed pages to its host
(docs/results/fresh_memory.md: a 944 MB block made fresh in 0.6-1.9 s there, against 0.04 s to write one kept).

``empty`` serves such buffers from memory the process keeps, as a device's caching allocator does: when the last
tensor over a buffer goes (its storage freed, whatever holds it), the memory goes back to this pool, not to the
system, and the next buffer of the same byte size takes it, already faulted in. What lies unused from one
``trim`` to the next (called once a round) is given back, so the pool holds at most what one round freed.
"""

from __future__ import annotations

import math
import threading
import weakref

import numpy as np
import torch

from .memory import LARGE_BUFFER_BYTES

# From the size up that the process maps afresh for each buffer; smaller ones the heap serves again in place.
KEPT_FROM_BYTES = LARGE_BUFFER_BYTES


class KeptBlocks:
    """A pool of host buffers by byte size; ``empty`` takes one (or makes it), its tensors' end gives it back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[int, list[np.ndarray]] = {}  # byte size -> buffers no tensor holds, newest last
        self._returned: set[int] = set()  # ids of buffers given back since the last trim
        self.made = self.reused = 0  # buffers allocated anew, and served from the pool (for logs and tests)

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised host tensor (as ``torch.empty``), contiguous, in kept memory from
        ``KEPT_FROM_BYTES`` up."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < KEPT_FROM_BYTES:
            return torch.empty(shape, dtype=dtype)
        return torch.from_numpy(self.host_bytes(nbytes)).view(dtype).view(shape)

    def host_bytes(self, nbytes: int) -> np.ndarray:
        """``nbytes`` uninitialised bytes (a uint8 array), kept from ``KEPT_FROM_BYTES`` up: back in the pool when
        the last array, memoryview or tensor over them goes."""
        if nbytes < KEPT_FROM_BYTES:
            return np.empty(nbytes, dtype=np.uint8)
        with self._lock:
            idle = self._idle.get(nbytes)
            buffer = idle.pop() if idle else None
            self._returned.discard(id(buffer))
        if buffer is None:
            buffer, self.made = np.empty(nbytes, dtype=np.uint8), self.made + 1
        else:
            self.reused += 1
        holder = buffer[:]  # a view whatever uses the bytes holds: when it goes, ``buffer`` comes back
        weakref.finalize(holder, self._give_back, buffer)
        return holder

    def _give_back(self, buffer: np.ndarray) -> None:
        with self._lock:
            self._idle.setdefault(buffer.nbytes, []).append(buffer)
            self._returned.add(id(buffer))

    def trim(self) -> int:
        """Give the system back every buffer that lay unused since the last trim (call once a round); the bytes
        given back."""
        with self._lock:
            dropped = 0
            for nbytes, idle in list(self._idle.items()):
                kept = [b for b in idle if id(b) in self._returned]
                dropped += nbytes * (len(idle) - len(kept))
                if kept:
                    self._idle[nbytes] = kept
                else:
                    del self._idle[nbytes]
            self._returned.clear()
        return dropped

    def idle_bytes(self) -> int:
        """What the pool holds that no tensor uses."""
        with self._lock:
            return sum(nbytes * len(idle) for nbytes, idle in self._idle.items())


KEPT = KeptBlocks()  # the process's pool: every module's block-sized host buffers share it
host_bytes = KEPT.host_bytes


def empty(shape, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """``torch.empty``, from the process's pool on the host (a device's own caching allocator keeps its memory)."""
    if torch.device(device).type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    return KEPT.empty(tuple(shape) if not isinstance(shape, int) else (shape,), dtype)
