"""The fp32 buffers a round's aggregation writes: the sum of the updates and the new ``x[b_r]``.

The first touch of a fresh page costs the kernel about as much as the aggregation's own work on it (more in a VM
that hands freed pages back to its host, and while durable writes fill the page cache). So each round's buffers
are made in the memory of what the strategy has retired (``retire``: the last round's sum once its step is
applied, ``x``'s values once no full sync can send them), where nothing else holds it; the rest is allocated and
touched on a thread of its own while the round's replies are outstanding. Either way the critical path, from the
last reply to the next message, takes no page fault. A round that finds none ready allocates its own.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .. import core


class RoundBuffers:
    """Round r's sum and new ``x[b_r]``, prepared ahead (``prepare``) and taken once (``take``)."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="round-buffers")
        self._ready: dict[int, Future] = {}
        self._retired: list[torch.Tensor] = []

    def retire(self, tensors: Iterable[torch.Tensor]) -> None:
        """Host tensors the strategy reads no more: the next ``prepare`` makes its buffers in their memory where
        nothing else holds it (``held_elsewhere``) and drops the rest. Device memory is left to the device's
        caching allocator, which reuses it already."""
        self._retired += [t for t in tensors if t.device.type == "cpu"]

    def prepare(self, server_round: int, like: core.Tensors) -> None:
        """Start making round r's buffers, one pair per tensor of ``like`` (its shapes, dtypes and device); any
        other round's are dropped."""
        retired, self._retired = self._retired, []
        made = self._ready.get(server_round) or self._thread.submit(touched_pairs, like, retired)
        self._ready = {server_round: made}

    def take(self, server_round: int) -> tuple[core.Tensors, core.Tensors]:
        """Round r's (sum, new x) buffers, waited for; empty when none were prepared (or taken already)."""
        future = self._ready.pop(server_round, None)
        return future.result() if future is not None else ({}, {})


def touched_pairs(like: core.Tensors, retired: list[torch.Tensor] | None = None) -> tuple[core.Tensors, core.Tensors]:
    """Two tensors like each of ``like`` (contiguous, every page touched): a retired tensor of as many values of
    its dtype on its device that nothing else holds (its values left as they are: the aggregation overwrites
    them), else new zeros. ``retired`` is emptied: what no buffer takes is freed here."""
    retired = retired if retired is not None else []
    pairs = tuple({n: made_in(retired, t) for n, t in like.items()} for _ in range(2))
    retired.clear()
    return pairs[0], pairs[1]


def made_in(retired: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """A retired tensor that fits ``like``, taken out of ``retired`` and shaped as it, else new zeros (no torch
    kernel either way: this runs on the buffers' thread)."""
    for i in range(len(retired)):  # (by index: a name bound to an entry would count as a holder)
        if fits(retired[i], like) and not held_elsewhere(retired, i):
            taken = retired.pop(i)  # its memory shaped as ``like`` by a tensor of its own, not a view that keeps
            out = torch.empty(0, dtype=taken.dtype, device=taken.device)  # ``taken`` (a holder) as its base
            return out.set_(taken.untyped_storage(), taken.storage_offset(), like.shape)
    return zeros_here(like)


def fits(t: torch.Tensor, like: torch.Tensor) -> bool:
    return t.is_contiguous() and (t.numel(), t.dtype, t.device) == (like.numel(), like.dtype, like.device)


def held_elsewhere(retired: list[torch.Tensor], i: int) -> bool:
    """Whether anything but ``retired`` holds the tensor ``retired[i]``: a name, a dict (a step waiting for the
    step log, a subclass that kept a round's mean), a task's arguments, a numpy array made from it. A view made of
    it and kept is not seen: what the strategy retires, it has handed to nothing that keeps one (FedBCD.combine)."""
    return sys.getrefcount(retired[i]) > 2  # the list's entry and getrefcount's own argument


def zeros_here(like: torch.Tensor) -> torch.Tensor:
    """Zeros shaped as ``like``, written on the host by numpy's single-threaded fill, not a torch kernel: this
    thread must start no OpenMP team of its own (once the process's OpenMP threads outnumber its cores, every
    parallel kernel waits on its team asleep: the round's aggregation, on the main thread, among them)."""
    out = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if out.device.type == "cpu":
        out.view(-1).view(torch.uint8).numpy().fill(0)
    else:
        out.zero_()  # a device kernel, queued: no host threads
    return out
