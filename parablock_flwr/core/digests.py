"""SHA-256 digests of ``x``: how the server and a client prove they hold the same bits.

Apart from the arithmetic because they serve the checks around it (the invariant check on a reply,
a checkpoint's digest, resume), not the algorithm itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch

from .algorithm import Tensors


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


class ModelDigest:
    """The digest of ``x`` each checkpoint stores: SHA-256 over every named tensor's name and its own
    SHA-256, in order. Each tensor is hashed again only after a step changed it (``changed``), so a
    round's checkpoint hashes the round's block, not the model, whose bytes are many times a block's."""

    def __init__(self, names: Iterable[str]):
        self.names = tuple(names)
        self._hashes: dict[str, str] = {}

    def changed(self, names: Iterable[str]) -> None:
        """These tensors moved (a step was applied): hash them again next time."""
        for n in names:
            self._hashes.pop(n, None)

    def __call__(self, params: Mapping[str, torch.Tensor]) -> str:
        h = hashlib.sha256()
        for n in self.names:
            if n not in self._hashes:
                self._hashes[n] = tensor_sha256(params[n])
            h.update(n.encode())
            h.update(self._hashes[n].encode())
        return h.hexdigest()


def digest_after(params: Mapping[str, torch.Tensor], names: Iterable[str], *steps: Tensors) -> str:
    """Digest of ``params`` with ``steps`` added in order, ``params`` left unchanged.

    Both sides of the invariant check use it: the server on ``x^{r-1} + Δ_i^r``,
    the client on its local model, so both perform the same float additions.
    """
    names = tuple(names)
    view: dict[str, torch.Tensor] = {n: params[n] for n in names}
    for step in steps:
        for n, t in step.items():
            view[n] = view[n].detach() + t.to(device=view[n].device, dtype=view[n].dtype)
    return digest(view, names)
