"""The fp32 buffers a round's aggregation writes: the sum of the updates and the new ``x[b_r]``.

Each is a block, taken from the pages ``kept_blocks`` kept from the last round where it has them; where not
(the first round, a block of another size), the first touch of a fresh page costs the kernel about as much as
the aggregation's own work on it (more while the step log's writes fill the page cache). Taken (and, fresh,
written once) on a thread of their own while the round's replies are outstanding, they take no page fault between
the last reply and the next message (the critical path). A round that finds none ready allocates its own.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .. import core, kept_blocks


class RoundBuffers:
    """Round r's sum and new ``x[b_r]``, prepared ahead (``prepare``) and taken once (``take``)."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="round-buffers")
        self._ready: dict[int, Future] = {}

    def prepare(self, server_round: int, like: core.Tensors, sums: bool = True) -> None:
        """Start making round r's buffers, one pair per tensor of ``like`` (its shapes, dtypes and device); without
        ``sums`` (a round whose mean is never written whole: ``FedBCD.step_in_one_pass``), the new ``x`` alone. Any
        other round's are dropped."""
        ready = self._ready.get(server_round) or self._thread.submit(touched_pairs, like, sums)
        self._ready = {server_round: ready}

    def take(self, server_round: int) -> tuple[core.Tensors, core.Tensors]:
        """Round r's (sum, new x) buffers, waited for; empty when none were prepared (or taken already)."""
        future = self._ready.pop(server_round, None)
        return future.result() if future is not None else ({}, {})


def touched_pairs(like: core.Tensors, sums: bool = True) -> tuple[core.Tensors, core.Tensors]:
    """Two new tensors like each of ``like`` (contiguous, uninitialised: the aggregation writes every value),
    every page faulted in (``kept_blocks.empty``'s ``touched``: a buffer the pool kept from the last round is not
    written again); without ``sums``, the first are not made (empty)."""

    def touched(t: torch.Tensor) -> torch.Tensor:
        return kept_blocks.empty(t.shape, dtype=t.dtype, device=t.device, touched=True)

    new_x = {n: touched(t) for n, t in like.items()}
    return ({n: touched(t) for n, t in like.items()} if sums else {}), new_x
