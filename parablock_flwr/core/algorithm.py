"""ParaBlock's arithmetic, line for line the spec's (docs/algorithm.md): updates, aggregate, global step,
the client's pending update, its start point and its correction.

Every copy of ``x`` (server, simulated clients, node workers, the plain-PyTorch reference) calls these
same functions, so that the same float operations in the same order keep them bit-identical.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from .. import kept_blocks

Tensors = dict[str, torch.Tensor]


def snapshot(params: Mapping[str, torch.Tensor], names: Iterable[str]) -> Tensors:
    """Detached fp32 copies of the named tensors (in kept memory: a block's, every round)."""
    return {n: kept_blocks.empty(params[n].shape, device=params[n].device).copy_(params[n].detach()) for n in names}


def delta(after: Mapping[str, torch.Tensor], before: Mapping[str, torch.Tensor]) -> Tensors:
    """``Δ = after - before`` in fp32: the optimizer's changes to a block (``after`` widened exactly into the
    result, then ``before`` subtracted in place: no other block-sized buffer)."""
    return {n: kept_blocks.empty(t.shape, device=t.device).copy_(after[n].detach()).sub_(t) for n, t in before.items()}


def aggregate(updates: Iterable[Tensors], weights: list[float], out: Tensors | None = None) -> Tensors:
    """``Δ̄ = Σ w_i Δ_i / Σ w_i``, computed as ``Σ (w_i / Σw) Δ_i`` in the given order.

    Normalising the weights first makes a single client's aggregate equal
    its update to the last bit (``1.0 * Δ == Δ``), which the tests rely on.
    ``updates`` may be a generator: only the running sum and the current
    update are held, however many clients there are. ``out``: tensors the sum
    is written into (the server's, prepared ahead: ``RoundBuffers``).
    """
    factors = mean_factors(weights)
    updates = iter(updates)
    into, out = out or {}, {}
    for i, factor in enumerate(factors):
        update = next(updates, None)
        if update is None:
            raise ValueError(f"aggregate: got {i} updates and {len(weights)} weights")
        for n in update:
            if i == 0:
                out[n] = scaled(update, n, factor, into.get(n))
            else:
                add_scaled(out[n], update, n, factor)
    if next(updates, None) is not None:
        raise ValueError(f"aggregate: got more updates than the {len(weights)} weights")
    return out


def mean_factors(weights: list[float]) -> list[float]:
    """Each update's factor in the weighted mean, ``w_i / Σ w``."""
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"aggregate: weights sum to {total}, expected > 0")
    return [w / total for w in weights]


def scaled(
    update: Mapping[str, torch.Tensor], name: str, factor: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``factor * update[name]`` in new storage (``out``, when given). An update that reads in chunks
    (``wire.Decoded``: ``chunks`` and ``shapes``) is scaled chunk by chunk into it, decoded nowhere else: the
    same bits (one product per value)."""
    if not hasattr(update, "chunks"):
        if out is None:
            return factor * update[name]
        if out.shape != update[name].shape:  # torch.mul would resize ``out``, a round's buffer, silently
            raise ValueError(f"{name}: the update's shape is {tuple(update[name].shape)}, expected {tuple(out.shape)}")
        return torch.mul(update[name], factor, out=out)
    out = kept_blocks.empty(update.shapes[name]) if out is None else out
    flat, at = out.view(-1), 0
    for chunk in update.chunks(name):
        torch.mul(chunk, factor, out=flat[at : at + chunk.numel()])
        at += chunk.numel()
    if at != out.numel():  # ``out`` may be a round's buffer, uninitialised: every value must be written
        raise ValueError(f"{name}: the update's chunks hold {at:,} values, expected {out.numel():,}")
    return out


def add_scaled(into: torch.Tensor, update: Mapping[str, torch.Tensor], name: str, factor: float = 1.0) -> None:
    """In place: ``into += factor * update[name]``. An update that came as its encoding is read chunk by chunk
    (``read_encoded``), never decoded whole. One fused op per value, as adding the whole tensor does: the same
    bits (each chunk cast to ``into``'s device and dtype first, as ``apply_step`` casts a whole step)."""
    if not read_encoded(update, name, into) or not into.is_contiguous():
        into.add_(update[name].to(device=into.device, dtype=into.dtype), alpha=factor)
        return
    flat, at = into.view(-1), 0
    for chunk in update.chunks(name):
        flat[at : at + chunk.numel()].add_(chunk.to(device=into.device, dtype=into.dtype), alpha=factor)
        at += chunk.numel()
    if at != into.numel():
        raise ValueError(f"{name}: the update's chunks hold {at:,} values, expected {into.numel():,}")


def read_encoded(update: Mapping[str, torch.Tensor], name: str, like: torch.Tensor) -> bool:
    """Whether ``update[name]`` is read from its encoding (``wire.Decoded``, ``EncodedTensors``: ``chunks`` and
    ``shapes``), its shape checked against ``like``'s first: a step of another layout changes nothing."""
    if not hasattr(update, "chunks"):
        return False
    if tuple(update.shapes[name]) != tuple(like.shape):
        raise ValueError(f"{name}: the update's shape is {tuple(update.shapes[name])}, expected {tuple(like.shape)}")
    return True


def read_chunks(
    tensors: Mapping[str, torch.Tensor], name: str, buffer: torch.Tensor | None = None
) -> Iterator[torch.Tensor]:
    """A tensor's flat fp32 values, chunk by chunk, each overwritten by the next: a mapping that reads its
    tensors from their encoding (``wire.Decoded``, ``EncodedTensors``: a ``chunks`` method) decodes them a chunk
    at a time, never a tensor whole; any other gives the tensor whole. ``buffer`` (fp32, a multiple of
    ``INT8_BLOCK`` values): chunks of its size, decoded into it (any tensor: views of it that size)."""
    if hasattr(tensors, "chunks"):
        return tensors.chunks(name, buffer)
    flat = tensors[name].reshape(-1)
    step = buffer.numel() if buffer is not None else max(flat.numel(), 1)
    return (flat[i : i + step] for i in range(0, max(flat.numel(), 1), step))


def sum_of_squares(tensors: Mapping[str, torch.Tensor], name: str) -> float:
    """``Σ v²`` over a tensor's values, in float64 (not finite when a value is not): from its encoding where
    the mapping has one (``sum_of_squares``: int8's from its integers and scales, without decoding), else
    chunk by chunk (``read_chunks``)."""
    if hasattr(tensors, "sum_of_squares"):
        return tensors.sum_of_squares(name)
    return sum(float(torch.linalg.vector_norm(c, dtype=torch.float64)) ** 2 for c in read_chunks(tensors, name))


def global_step(mean_update: Tensors, server_lr: float) -> Tensors:
    """``g = η_s Δ̄`` (exact when η_s = 1: ``Δ̄``'s own tensors, not a copy of the block)."""
    if server_lr == 1.0:
        return dict(mean_update)
    return {n: server_lr * t for n, t in mean_update.items()}


@torch.no_grad()
def apply_step(params: Mapping[str, torch.Tensor], step: Mapping[str, torch.Tensor]) -> None:
    """In place: ``x[b] += g`` (or ``y[b] += Δ``), the one float op every copy uses. A step that came as its
    encoding (``wire.Decoded``, ``EncodedTensors``) is read chunk by chunk into the sum (``add_scaled``), never
    decoded whole into fresh memory: a node's replica takes each round's step at about memory speed."""
    for n in step:  # every shape checked before any tensor moves
        read_encoded(step, n, params[n])
    for n in step:
        add_scaled(params[n], step, n)


@torch.no_grad()
def apply_step_keeping(params: Mapping[str, torch.Tensor], step: Mapping[str, torch.Tensor]) -> Tensors:
    """``apply_step``'s float op into new storage, which each tensor then takes (``.data``: the same
    tensor and parameter objects, so a model holding them sees the new values); returns the replaced
    tensors, ``x^{r-1}[b]``, uncopied. The server keeps them for a full sync without a copy of the
    block between the last reply and the next message."""
    before: Tensors = {}
    encoded = {n: read_encoded(step, n, params[n]) for n in step}  # every shape checked before any tensor moves
    for n in step:
        before[n] = params[n].detach()
        if encoded[n]:
            params[n].data = added(before[n], step.chunks(n))
        else:
            params[n].data = before[n] + step[n].to(device=before[n].device, dtype=before[n].dtype)
    return before


@torch.no_grad()
def added(
    x: torch.Tensor, step_chunks: Iterable[torch.Tensor], out: torch.Tensor | None = None, finite_only: bool = False
) -> torch.Tensor | None:
    """``x + g`` in new storage (``out``, when given), ``g`` read as consecutive flat chunks (each added as it comes,
    in cache): ``apply_step``'s float op, element by element, so the bits are the same as adding ``g`` whole.
    ``finite_only``: None as soon as a value of the sum is not finite, each chunk checked as it is written (in
    cache: no second pass over the block)."""
    out = kept_blocks.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    flat_x, flat_out, at = x.reshape(-1), out.view(-1), 0
    for chunk in step_chunks:
        stop = at + chunk.numel()
        torch.add(flat_x[at:stop], chunk.to(device=x.device, dtype=x.dtype), out=flat_out[at:stop])
        if finite_only and not all_finite(flat_out[at:stop]):
            return None
        at = stop
    if at != x.numel():
        raise ValueError(f"added: the step's chunks hold {at:,} values, expected {x.numel():,}")
    return out


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite, from the tensor's minimum and maximum: one pass that allocates nothing (a
    NaN anywhere makes both NaN, an infinity is the minimum or the maximum), where ``torch.isfinite(t).all()``
    writes a mask as large as the tensor."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) and torch.isfinite(high))


@dataclass
class PendingUpdate:
    """A ParaBlock client's own update not yet folded into the global model.

    The client's local model is ``y = x^{base_version}`` with
    ``y[block] += delta``. After the correction of round r,
    ``base_version = r - 1`` and ``delta = Δ_i^r``: the spec's invariant.
    """

    block: int
    base_version: int
    delta: Mapping[str, torch.Tensor]  # read, never written in place (a node's: ``EncodedTensors``)


def parablock_base(pending: PendingUpdate | None, server_round: int) -> tuple[int, PendingUpdate | None]:
    """Which model round r's computation starts from.

    Normally ``y = x^{r-2} + Δ_i^{r-1}`` (the stale start that lets the
    client compute while round r-1's exchange is in flight). A client with
    no usable pending update (round 1, or it missed round r-1) is
    resynchronised: it starts from ``x^{r-1}`` with nothing pending, which
    is exactly a sequential-BCD round.
    """
    if pending is not None and pending.base_version == server_round - 2:
        return server_round - 2, pending
    return server_round - 1, None


@torch.no_grad()
def correct_in_place(params: Mapping[str, torch.Tensor], before: Tensors, step: Tensors, own_update: Tensors) -> None:
    """The ``on-receipt`` correction, applied to a model in the middle of training.

    ``y[b_{r-1}] += η_s Δ̄^{r-1} − Δ_i^{r-1}`` on the live parameters. If the
    block being trained is that block too, its ``before`` snapshot moves by the
    same amount so that ``Δ_i^r`` keeps counting only the optimizer's changes.
    Not bit-exact (float sums in another order): the deterministic mode corrects
    at the end instead (``strategies.ParaBlockClient.correct``).
    """
    for n, g in step.items():
        change = g - own_update[n]
        params[n].add_(change.to(device=params[n].device, dtype=params[n].dtype))
        if n in before:
            before[n].add_(change.to(before[n].device))


def uncorrected_offset(offset: Tensors, own_update: Tensors, steps: Iterable[Tensors]) -> Tensors:
    """``correction = "none"``: a client model that never takes in the aggregate, ``y = x^v + offset``,
    after its own update and written on a version ``len(steps)`` newer: ``offset + Δ_i − Σ g``."""
    out = dict(offset)
    for n, t in own_update.items():
        out[n] = out[n] + t if n in out else t.clone()
    for step in steps:
        for n, g in step.items():
            out[n] = out[n] - g if n in out else -g
    return out
