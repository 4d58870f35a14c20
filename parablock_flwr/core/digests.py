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


def model_digest(
    params: Mapping[str, torch.Tensor],
    names: Iterable[str],
    pending: Mapping[str, torch.Tensor] | None = None,
    hashes: TensorHashes | None = None,
) -> str:
    """Digest of a model kept as ``params`` plus a pending update (ParaBlock's local model ``x^{r-1} + Δ_i^r``):
    SHA-256 over every named tensor's name, its own SHA-256 and, for a tensor the update holds, the update's
    (``update_sha256``, the tensor as it travelled). With no update it is the digest a checkpoint stores.

    Both sides of the invariant check use it: the node on its replica and its own update, the server on
    ``x^{r-1}`` and the reply's update. Equal digests mean equal parts, hence equal local models: both sides add
    them with the one float op (``apply_step``). So neither sums a block nor hashes it in fp32: the update is
    hashed in its encoding (int8: a quarter of its fp32 bytes), and ``x``'s tensors come from ``hashes`` (the
    owner's cache) when given, hashed again only after a step moved them. A round's check costs the reply's bytes
    on the server, not the model's or a block's fp32.
    """
    names, pending, pool = tuple(names), pending if pending is not None else {}, _hashing_pool()
    if stray := set(pending) - set(names):
        raise ValueError(f"model_digest: the update holds {min(stray)!r}, not a tensor of the model")
    hash_of = hashes.of if hashes is not None else _sha256_of
    own = {n: pool.submit(hash_of, params, n) for n in names}
    moved = {n: pool.submit(update_sha256, pending, n) for n in names if n in pending}
    h = hashlib.sha256()
    for n in names:
        h.update(n.encode())
        h.update(own[n].result().encode())
        if n in moved:
            h.update(b"+" + moved[n].result().encode())
    return h.hexdigest()


def update_sha256(update: Mapping[str, torch.Tensor], name: str) -> str:
    """SHA-256 of one tensor of an update as it travels: its encoding's bytes (the values in the transfer dtype,
    then int8's scales) where the mapping keeps one (``EncodedTensors``, ``wire.Decoded``), else its fp32 values'
    (an update in fp32 travels as it is). Read in place, never decoded."""
    encoded = getattr(update, "encoded", None)
    if encoded is None:
        return tensor_sha256(update[name].detach().to(torch.float32))
    h = hashlib.sha256()
    for part in encoded[name]:
        if part is not None:
            h.update(_c_order_buffer(part.reshape(-1).view(torch.uint8)))
    return h.hexdigest()


def _sha256_of(params: Mapping[str, torch.Tensor], name: str) -> str:
    return tensor_sha256(params[name])


@functools.cache
def _hashing_pool() -> ThreadPoolExecutor:
    """Threads that hash a model's tensors side by side (hashlib releases the GIL). They read tensors in place and
    run no torch kernel: a thread that runs a parallel one starts an OpenMP team of its own, and once the process's
    OpenMP threads outnumber its cores every parallel kernel after it waits on its team asleep instead of spinning
    (the server's aggregation among them, for the rest of the process)."""
    return ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="tensor-sha256")
