"""SHA-256 digests of ``x``: how the server and a client prove they hold the same bits.

Apart from the arithmetic because they serve the checks around it (the invariant check on a reply,
a checkpoint's digest, resume), not the algorithm itself.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from .algorithm import Tensors, read_chunks


def digest(params: Mapping[str, torch.Tensor], names: Iterable[str]) -> str:
    """SHA-256 over the named tensors' bytes, in the given order (read in place: ``tobytes()`` would copy
    the whole model first, on the server's critical path every round)."""
    h = hashlib.sha256()
    for n in names:
        h.update(n.encode())
        h.update(_c_order_buffer(params[n]))
    return h.hexdigest()


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 of one tensor's bytes (read in place)."""
    return hashlib.sha256(_c_order_buffer(tensor)).hexdigest()


def _c_order_buffer(tensor: torch.Tensor):
    """The tensor's bytes in C order, as a C-contiguous array whose buffer hashlib reads as it is."""
    return tensor.detach().cpu().contiguous().numpy()


class TensorHashes:
    """Each tensor's own SHA-256 (``tensor_sha256``), kept until its owner says a change moved it
    (``changed``). A copy of ``x`` (the server's, a node's replica) owns one, so that a digest of the
    model rehashes the block a round changed, not the model, whose bytes are many times a block's."""

    def __init__(self) -> None:
        self._hashes: dict[str, str] = {}

    def changed(self, names: Iterable[str]) -> None:
        """These tensors moved (a step was applied, values copied in): hash them again next time."""
        for n in names:
            self._hashes.pop(n, None)

    def of(self, params: Mapping[str, torch.Tensor], name: str) -> str:
        if name not in self._hashes:
            self._hashes[name] = tensor_sha256(params[name])
        return self._hashes[name]


class ModelDigest:
    """The digest of ``x`` each checkpoint stores: ``digest_after`` with no step, each tensor hashed
    again only after a step changed it (``changed``)."""

    def __init__(self, names: Iterable[str]):
        self.names = tuple(names)
        self._hashes = TensorHashes()

    def changed(self, names: Iterable[str]) -> None:
        self._hashes.changed(names)

    def __call__(self, params: Mapping[str, torch.Tensor]) -> str:
        return digest_after(params, self.names, hashes=self._hashes)


def digest_after(
    params: Mapping[str, torch.Tensor], names: Iterable[str], *steps: Tensors, hashes: TensorHashes | None = None
) -> str:
    """Digest of ``params`` with ``steps`` added in order, ``params`` left unchanged: SHA-256 over every
    named tensor's name and its own SHA-256, in order.

    Both sides of the invariant check use it: the server on ``x^{r-1} + Δ_i^r``, the client on its local
    model, so both perform the same float additions. Only the tensors a step touches are summed and
    hashed; the others' hashes come from ``hashes`` (the owner's cache of ``params``) when given, so a
    round's check costs a block's bytes, not the model's.
    """
    names, pool = tuple(names), _hashing_pool()
    touched = {n: [step for step in steps if n in step] for n in names}
    hash_of = hashes.of if hashes is not None else _sha256_of
    hashed = {n: pool.submit(summed_sha256, params[n], n, touched[n]) if touched[n] else pool.submit(hash_of, params, n)
              for n in names}  # fmt: skip
    h = hashlib.sha256()
    for n in names:
        h.update(n.encode())
        h.update(hashed[n].result().encode())
    return h.hexdigest()


# Values a digest's thread sums and hashes at a time on the host: not above torch's grain (``at::internal::GRAIN_SIZE``,
# 32768), so that each of its kernels runs on the calling thread alone and no OpenMP team is started (see
# ``_hashing_pool``); 128 KiB of fp32, in cache.
SUMMED_CHUNK_VALUES = 32 * 1024


def summed_sha256(tensor: torch.Tensor, name: str, steps: list[Tensors]) -> str:
    """``tensor_sha256(tensor + steps[0][name] + ...)``, chunk by chunk: each chunk of the sum is made (the very
    float additions of the whole tensor's, in order) and hashed while in cache. No block-sized tensor is written,
    and a step that reads from its encoding (a reply's payload, a node's sent update: ``read_chunks``) is never
    decoded whole. On a GPU each step is added whole, on the device, and the sum copied to the host once."""
    flat = tensor.detach().reshape(-1)
    on_host = flat.device.type == "cpu"
    chunk_buffer = torch.empty(SUMMED_CHUNK_VALUES) if on_host else None
    others = [step[name].reshape(-1) for step in steps[1:]]
    h, buffer, at = hashlib.sha256(), None, 0
    for chunk in read_chunks(steps[0], name, chunk_buffer):
        stop = at + chunk.numel()
        if buffer is None or buffer.numel() < chunk.numel():  # made once, its pages faulted once
            buffer = torch.empty(chunk.numel(), dtype=flat.dtype, device=flat.device)
        value = torch.add(flat[at:stop], chunk.to(device=flat.device, dtype=flat.dtype), out=buffer[: stop - at])
        for other in others:
            value += other[at:stop].to(device=flat.device, dtype=flat.dtype)
        h.update(_c_order_buffer(value))
        at = stop
    if at != flat.numel():
        raise ValueError(f"digest_after: {name}'s step holds {at:,} values, expected {flat.numel():,}")
    return h.hexdigest()


def _sha256_of(params: Mapping[str, torch.Tensor], name: str) -> str:
    return tensor_sha256(params[name])


@functools.cache
def _hashing_pool() -> ThreadPoolExecutor:
    """Threads that hash a model's tensors side by side (hashlib releases the GIL, and so do torch's kernels). They
    run no parallel torch kernel (``SUMMED_CHUNK_VALUES``): a thread that runs one starts an OpenMP team of its own,
    and once the process's OpenMP threads outnumber its cores every parallel kernel after it waits on its team
    asleep instead of spinning (the server's aggregation among them, for the rest of the process)."""
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="tensor-sha256")
