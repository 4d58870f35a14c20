"""Transfer precision: ``Δ_i`` and ``g`` travel rounded to the run's ``transfer-dtype``, and every copy
of ``x`` applies the rounded values.

Apart from the arithmetic because the rounding is a choice of how to send a step, not of which step to
take; ``wire.py`` encodes what these functions round, and int8's block size and scales are defined once, here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from .. import kept_blocks
from .algorithm import Tensors, all_finite, mean_factors, read_chunks

# int8 is symmetric and blockwise: ``quantize_int8`` (one fp32 power-of-two scale per INT8_BLOCK values).
TRANSFER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}
INT8_BLOCK = 256  # int8: values per scale, within one tensor (its flattened values; the last block may be short)


def int8_blocks(numel: int) -> int:
    """How many scales a tensor of ``numel`` values travels with in int8."""
    return -(-numel // INT8_BLOCK)


# A block's bytes are rounded in chunks of this many values (4 MiB of fp32) on a CPU: every pass of a
# chunk runs in the core's cache, so the several passes a rounding takes cost about one trip through
# memory, and no block-sized temporary is allocated (its pages first-touched) per round. A multiple of
# INT8_BLOCK, so that chunks cut no int8 block. On a GPU each tensor is one chunk: memory is fast there.
CHUNK_VALUES = 2**20
# The server's one pass (``applied_mean_step``) holds a chunk of each update, of the sum, of the step decoded and of
# its int8 work at once: half of ``CHUNK_VALUES`` was the fastest of 64 Ki to 1 Mi values on this project's 2-core
# VM (one thread, 1 and 3 replies; ``benchmarks.byte_legs`` sets the one pass beside the steps apart).
ONE_PASS_CHUNK_VALUES = CHUNK_VALUES // 2


def _flat_fp32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` flat in fp32: itself when it is, else an exact copy in kept memory (bf16 weights' updates)."""
    flat = tensor.detach().reshape(-1)
    return flat if flat.dtype == torch.float32 else kept_blocks.empty(flat.shape, device=flat.device).copy_(flat)


def _chunks(tensor: torch.Tensor):
    """The ``[start, stop)`` spans of a flat tensor's chunks (``CHUNK_VALUES``; whole on a GPU)."""
    n = tensor.numel()
    step = CHUNK_VALUES if tensor.device.type == "cpu" else max(n, 1)
    return [(i, min(n, i + step)) for i in range(0, n, step)]


def _int8_scales(blocks: torch.Tensor, work: torch.Tensor | None) -> torch.Tensor:
    """Each block's scale: the smallest power of two ``s >= max|v| / 127`` (0 for an all-zero block; a
    non-finite block keeps its non-finite bound, so that it is refused). With ``work`` (a buffer apart from
    ``blocks``, in cache) ``|v|`` goes there: its row-wise max is about three times faster than the row-wise
    min and max of ``v`` (without it, the same bound: max|v| is max(max, -min))."""
    if work is None:
        low, high = torch.aminmax(blocks, dim=1)
        bound = torch.maximum(high, -low) / 127
    else:
        bound = torch.abs(blocks, out=work[: blocks.numel()].view_as(blocks)).amax(dim=1) / 127
    mantissa, exponent = torch.frexp(bound)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two is its own scale
    scale = torch.pow(2.0, exponent.double()).float()  # exact in float64, then exactly representable
    scale = torch.where(bound > 0, scale, 0.0)
    return torch.where(bound.isfinite(), scale, bound)


def _quantize_into(values: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, work: torch.Tensor) -> None:
    """One chunk (whole int8 blocks, but for a tensor's last) of fp32 ``values`` into ``q`` and ``scales``,
    through ``work`` (a buffer of at least the chunk's padded size)."""
    n = values.numel()
    padded = int8_blocks(n) * INT8_BLOCK
    if padded != n:  # the tensor's short last block, zero-padded
        work[n:padded].zero_()
        work[:n].copy_(values)
        values = work[:padded]
    blocks = values.view(-1, INT8_BLOCK)
    scales.copy_(_int8_scales(blocks, work if padded == n else None))  # (padded: the values are in work)
    divisor = torch.where(scales > 0, scales, 1.0)[:, None]
    scaled = work[:padded].view(-1, INT8_BLOCK)
    torch.div(blocks, divisor, out=scaled)
    scaled.round_().clamp_(-127, 127).nan_to_num_(0.0)
    q.copy_(scaled.view(-1)[:n])


def quantize_int8(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8, round to nearest: the flattened values in blocks of ``INT8_BLOCK``, each with
    the smallest power-of-two fp32 scale ``s >= max|v| / 127`` (0 for an all-zero block).

    Power-of-two scales make ``q * s`` exact and the rounding idempotent: quantising dequantised values
    gives back the same ``q`` and ``s`` (``max|q|`` is then in [64, 127], which picks the same ``s``), so
    the server can round ``g``, apply it, and encode it again for the wire without changing a bit.
    Chunk by chunk (``CHUNK_VALUES``): the same bits as the whole tensor at once, blocks being independent.
    """
    flat = _flat_fp32(tensor)
    n = flat.numel()
    q = kept_blocks.empty(n, dtype=torch.int8, device=flat.device)
    scales = kept_blocks.empty(int8_blocks(n), dtype=torch.float32, device=flat.device)
    spans = _chunks(flat)
    work = kept_blocks.empty(int8_blocks(spans[0][1]) * INT8_BLOCK if spans else 0, device=flat.device)
    for i, j in spans:
        _quantize_into(flat[i:j], q[i:j], scales[i // INT8_BLOCK : int8_blocks(j)], work)
    return q, scales


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The flat fp32 values ``q * s`` (each exact: ``s`` is a power of two), in the result (``out`` when given, of
    ``q``'s size): ``q`` widened into it, then scaled in place, the scales broadcast over each block (no block-sized
    temporary, no copy of the scales)."""
    n = q.numel()
    full = n // INT8_BLOCK * INT8_BLOCK
    out = kept_blocks.empty(n, dtype=torch.float32, device=q.device) if out is None else out
    # Widened into ``out`` first (exact), then scaled there: the product of int8 and fp32 would widen into a
    # temporary of its own, mapped afresh (its pages faulted in) for every chunk of a mapping's size or more.
    out.copy_(q)
    out[:full].view(-1, INT8_BLOCK).mul_(scale[: full // INT8_BLOCK, None])
    if full < n:  # the tensor's short last block
        out[full:].mul_(scale[full // INT8_BLOCK])
    return out


def decoded_chunks(
    values: torch.Tensor, scales: torch.Tensor | None, buffer: torch.Tensor | None = None
) -> Iterator[torch.Tensor]:
    """An encoding's flat fp32 values (int8's ``q * s``, bf16, fp16; fp32's own, read only), chunk after chunk,
    each decoded into ``buffer`` (fp32, a multiple of ``INT8_BLOCK`` values; default ``CHUNK_VALUES``, whole on a
    GPU) and overwritten by the next: a reader of the encoding holds no tensor-sized fp32 memory."""
    n = values.numel()
    step = buffer.numel() if buffer is not None else (CHUNK_VALUES if values.device.type == "cpu" else max(n, 1))
    if buffer is None and values.dtype != torch.float32:
        buffer = kept_blocks.empty(min(n, step), device=values.device)
    for i in range(0, n, step):
        j = min(n, i + step)
        if values.dtype == torch.float32:
            yield values[i:j]
        elif scales is not None:
            yield dequantize_int8(values[i:j], scales[i // INT8_BLOCK : int8_blocks(j)], out=buffer[: j - i])
        else:
            yield buffer[: j - i].copy_(values[i:j])


def encoded_sum_of_squares(
    values: torch.Tensor, scales: torch.Tensor | None, buffer: torch.Tensor | None = None
) -> float:
    """``Σ v²`` of the decoded values in float64 (``inf`` or ``nan`` when one is not finite), read from the
    encoding. int8's from its integers: each block's ``Σ q²`` is an integer below 2**24 (at most
    ``INT8_BLOCK * 127²``), so fp32 holds it exactly in any order, and ``s²`` is a power of two: one cheap pass
    over the int8 bytes, no value decoded, in chunks of ``CHUNK_VALUES`` (not ``buffer``'s, sized for decoding in
    cache: larger chunks take fewer of Python's turns). Other dtypes decoded chunk by chunk into ``buffer``
    (``decoded_chunks``)."""
    if scales is None:
        chunks = decoded_chunks(values, None, buffer)
        return sum(float(torch.linalg.vector_norm(c, dtype=torch.float64)) ** 2 for c in chunks)
    n, total = values.numel(), 0.0
    squares = kept_blocks.empty(min(n, CHUNK_VALUES), device=values.device)
    for i, j in _chunks(values):
        chunk = squares[: j - i].copy_(values[i:j])
        chunk.mul_(chunk)
        full = (j - i) // INT8_BLOCK * INT8_BLOCK
        block_sums = chunk[:full].view(-1, INT8_BLOCK).sum(1).double()
        block_scales = scales[i // INT8_BLOCK : (i + full) // INT8_BLOCK].double()
        total += float(torch.dot(block_sums, block_scales * block_scales))
        if full < j - i:  # the tensor's short last block
            total += float(chunk[full:].sum(dtype=torch.float64)) * float(scales[int8_blocks(j) - 1]) ** 2
    return total


def round_for_transfer(tensors: Tensors, transfer_dtype: str) -> Tensors:
    """The values as they will arrive, in fp32: exactly representable in ``transfer_dtype``.

    The server applies the rounded ``g`` it sends, so every copy of ``x`` stays identical.
    """
    if transfer_dtype == "fp32":
        return tensors
    if transfer_dtype == "int8":
        return {n: dequantize_int8(*quantize_int8(t)).view(t.shape) for n, t in tensors.items()}
    dtype = TRANSFER_DTYPES[transfer_dtype]
    return {n: t.to(dtype).to(torch.float32) for n, t in tensors.items()}


# A tensor as it travels: its flat values in the transfer dtype (int8's q, bf16, fp16, or fp32 itself) and,
# for int8, its scales (``quantize_int8``). ``wire.pack_pieces`` writes the wire's arrays from it.
Encoded = dict[str, tuple[torch.Tensor, torch.Tensor | None]]


class EncodedTensors(Mapping[str, torch.Tensor]):
    """Rounded tensors kept as they travel (``Encoded``: int8's values and scales, bf16, fp16) and decoded in fp32
    on each access, one tensor at a time. Decoding rounded values is exact, so each access gives the very bits that
    were sent. A ParaBlock node keeps its pending update ``Δ_i^r`` so between rounds: a quarter (int8) or half of a
    block's fp32 bytes, held while the next block trains, and the same memory its upload reads."""

    def __init__(self, encoded: Encoded, shapes: Mapping[str, torch.Size]):
        self.encoded, self.shapes = encoded, dict(shapes)

    def __getitem__(self, name: str) -> torch.Tensor:
        values, scales = self.encoded[name]
        flat = dequantize_int8(values, scales) if scales is not None else values.to(torch.float32)
        return flat.view(self.shapes[name])

    def chunks(self, name: str, buffer: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
        """The tensor's flat fp32 values chunk by chunk (``decoded_chunks``, into ``buffer`` when given): what
        reads it once, in order (a digest, an addition) holds no fp32 copy of it."""
        return decoded_chunks(*self.encoded[name], buffer)

    def sum_of_squares(self, name: str) -> float:
        return encoded_sum_of_squares(*self.encoded[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __contains__(self, name: object) -> bool:  # (Mapping's would decode the tensor)
        return name in self.shapes

    def travels_as(self, transfer_dtype: str) -> bool:
        """Whether its encoding is ``transfer_dtype``'s: then it is packed as it is, never converted again."""
        return all(v.dtype == TRANSFER_DTYPES[transfer_dtype] for v, _ in self.encoded.values())

    def __len__(self) -> int:
        return len(self.shapes)


def kept_encoded(sent: Tensors, encoded: Encoded | None) -> Mapping[str, torch.Tensor]:
    """``sent`` as a node keeps it across rounds: from its encoding (``EncodedTensors``) when it has one, else
    (fp32 transfer: the values travel as they are) ``sent`` itself."""
    if encoded is None or isinstance(sent, EncodedTensors):
        return sent
    return EncodedTensors(encoded, {n: t.shape for n, t in sent.items()})


def encode(tensors: Tensors, transfer_dtype: str) -> Encoded:
    """Each tensor's values as they travel (lossless for values already rounded: what the node keeps is
    what arrives), converted where the tensor is: a GPU node casts or quantises on the device."""
    out: Encoded = {}
    for n, t in tensors.items():
        flat = t.detach().reshape(-1)
        if transfer_dtype == "int8":
            out[n] = quantize_int8(flat)
        else:
            out[n] = (flat.to(TRANSFER_DTYPES[transfer_dtype]), None)
    return out


def round_with_feedback(update: Tensors, residual: Tensors | None, transfer_dtype: str) -> tuple[Tensors, Tensors]:
    """Error feedback: ``sent = round(Δ + e)``, ``e' = Δ + e − sent``.

    A client sends (and keeps as its pending update) exactly ``sent``, so the invariant
    ``y = x^{r-1} + sent`` stays bit-exact; what rounding dropped, ``e'``, is added to its
    next update of the same block instead of being lost.
    """
    sent, kept, _ = round_with_feedback_encoded(update, residual, transfer_dtype)
    return sent, kept


def round_with_feedback_encoded(
    update: Tensors, residual: Tensors | None, transfer_dtype: str
) -> tuple[Tensors, Tensors, Encoded]:
    """``round_with_feedback``, and ``sent`` as it travels (``encode``'s values, from the same conversion: a
    node that packs its update does not quantise it a second time). Each tensor chunk by chunk, where its
    update is (``_feedback_tensor``): the node's per-byte work of a round, at about memory speed."""
    sent: Tensors = {}
    kept: Tensors = {}
    encoded: Encoded = {}
    for n, t in update.items():
        sent[n], kept[n], encoded[n] = _feedback_tensor(t, residual[n] if residual else None, transfer_dtype)
    if transfer_dtype != "fp32":  # sent as it travels, decoded when read: no fp32 block of it is written
        sent = EncodedTensors(encoded, {n: t.shape for n, t in update.items()})
    return sent, kept, encoded


def _feedback_tensor(
    update: torch.Tensor, residual: torch.Tensor | None, transfer_dtype: str
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor | None]]:
    """One tensor's ``sent`` (fp32 only: else None, the encoding stands for it), ``e'`` and encoding. ``e'`` is
    computed in the buffer that first holds ``Δ + e`` (no further block-sized buffer), ``sent`` decoded from
    its encoding one chunk at a time through the cache (``decoded``: a chunk-sized buffer)."""
    flat = _flat_fp32(update)
    n, device = flat.numel(), flat.device
    spans = _chunks(flat)
    kept = kept_blocks.empty(n, device=device)
    sent = kept_blocks.empty(n, device=device) if transfer_dtype == "fp32" else None
    decoded = kept_blocks.empty(spans[0][1] if spans and sent is None else 0, device=device)
    extra = residual.detach().reshape(-1).to(device=device, dtype=torch.float32) if residual is not None else None
    work = None
    if transfer_dtype == "int8":
        values = kept_blocks.empty(n, dtype=torch.int8, device=device)
        scales = kept_blocks.empty(int8_blocks(n), device=device)
        work = kept_blocks.empty(int8_blocks(spans[0][1]) * INT8_BLOCK if spans else 0, device=device)
    elif transfer_dtype == "fp32":
        values, scales = sent, None
    else:
        values, scales = kept_blocks.empty(n, dtype=TRANSFER_DTYPES[transfer_dtype], device=device), None
    for i, j in spans:
        corrected = kept[i:j]
        if extra is None:
            corrected.copy_(flat[i:j])
        else:
            torch.add(flat[i:j], extra[i:j], out=corrected)
        corrected.sub_(encoded_chunk(corrected, (values, scales), i, j, work, decoded))  # fp32: into sent itself
    sent = sent.view(update.shape) if sent is not None else None
    return sent, kept.view(update.shape), (values, scales)


def encoded_chunk(
    values: torch.Tensor, encoding: tuple[torch.Tensor, torch.Tensor | None], i: int, j: int,
    work: torch.Tensor | None, decoded: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Values ``[i, j)`` of a tensor (fp32: a chunk of whole int8 blocks but for the tensor's last) rounded into
    their slots of the tensor's ``encoding`` (``empty_encoding``), and their fp32 values as they travel: decoded
    into ``decoded`` (a chunk-sized buffer), or fp32's own slots. ``work``: int8's, as ``quantize_int8``'s."""
    travelling, scales = encoding
    if scales is not None:
        _quantize_into(values, travelling[i:j], scales[i // INT8_BLOCK : int8_blocks(j)], work)
        return dequantize_int8(travelling[i:j], scales[i // INT8_BLOCK : int8_blocks(j)], out=decoded[: j - i])
    travelling[i:j].copy_(values)  # bf16, fp16: rounded to nearest
    return travelling[i:j] if travelling.dtype == torch.float32 else decoded[: j - i].copy_(travelling[i:j])


def _clipped(chunk: torch.Tensor, scale: float | None, buffer: torch.Tensor) -> torch.Tensor:
    """``clip``'s ``Δ_i · scale`` of one chunk, into ``buffer`` (read before the next update's overwrites it)."""
    return chunk if scale is None else torch.mul(chunk.to(buffer.device), scale, out=buffer[: chunk.numel()])


def empty_encoding(numel: int, transfer_dtype: str, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A tensor's encoding to be filled (``encoded_chunk``): its values in ``transfer_dtype`` and int8's scales."""
    values = kept_blocks.empty(numel, dtype=TRANSFER_DTYPES[transfer_dtype], device=device)
    return values, kept_blocks.empty(int8_blocks(numel), device=device) if transfer_dtype == "int8" else None


@torch.no_grad()
def applied_mean_step(
    updates: Sequence[Mapping[str, torch.Tensor]], weights: list[float], server_lr: float,
    x: Mapping[str, torch.Tensor], transfer_dtype: str, out: Mapping[str, torch.Tensor] | None = None,
    clip_scales: Sequence[float | None] | None = None, noise: Mapping[str, torch.Tensor] | None = None,
    noise_std: float = 0.0, encoded_into: Encoded | None = None,
) -> tuple[Encoded, Tensors, str | None]:  # fmt: skip
    """The server's round over a block in one pass: ``g = round(η_s Σ (w_i / Σw) Δ_i)`` as it travels, and
    ``x + g`` in new storage (``out``'s tensors, where given), chunk by chunk through the cache, so that neither
    the mean nor the step is written as an fp32 block. The same float operations as ``aggregate``,
    ``global_step``, ``encode`` and ``added`` one after another, each elementwise (int8's blocks whole in each
    chunk): the same bits. Every update is read at once, so all of them are in memory. With differential
    privacy, ``clip_scales`` (``clip_scale`` of each update; None: inside the ball) and ``noise`` (``gaussian``'s,
    times ``noise_std``) are ``clip`` and ``add_noise`` in the same pass, with the same operations. The step's
    encoding is written into ``encoded_into``'s tensors where given (where it travels from; on ``x``'s device).
    Returns the step's encoding, ``x``'s new tensors (in the updates' order) and the first of them with a value
    that is not finite (None: none)."""
    factors = mean_factors(weights)
    clip_scales = list(clip_scales) if clip_scales is not None else [None] * len(updates)
    if not len(updates) == len(factors) == len(clip_scales):
        raise ValueError(f"applied_mean_step: got {len(updates)} updates, {len(factors)} weights and "
                         f"{len(clip_scales)} clip scales")  # fmt: skip
    encoded: Encoded = {}
    new: Tensors = {}
    not_finite = None
    for name in updates[0]:
        flat_x = x[name].detach().reshape(-1)
        n, device = flat_x.numel(), flat_x.device
        width = max(min(n, ONE_PASS_CHUNK_VALUES) if device.type == "cpu" else n, 1)
        total, decoded = kept_blocks.empty(width, device=device), kept_blocks.empty(width, device=device)
        work = kept_blocks.empty(int8_blocks(width) * INT8_BLOCK, device=device) if transfer_dtype == "int8" else None
        encoded[name] = encoded_into[name] if encoded_into is not None else empty_encoding(n, transfer_dtype, device)
        target = (out or {}).get(name)
        new[name] = kept_blocks.empty(x[name].shape, dtype=flat_x.dtype, device=device) if target is None else target
        flat_new, at = new[name].view(-1), 0
        readers = [read_chunks(u, name, kept_blocks.empty(width, device=device)) for u in updates]
        clipped = kept_blocks.empty(width if any(s is not None for s in clip_scales) else 0, device=device)
        flat_noise = noise[name].reshape(-1) if noise is not None else None
        for chunks in zip(*readers, strict=True) if n else ():
            stop = at + chunks[0].numel()
            mean = torch.mul(_clipped(chunks[0], clip_scales[0], clipped), factors[0], out=total[: stop - at])
            for chunk, factor, scale in zip(chunks[1:], factors[1:], clip_scales[1:]):
                mean.add_(_clipped(chunk, scale, clipped).to(device=device, dtype=mean.dtype), alpha=factor)
            if flat_noise is not None:
                mean.add_(flat_noise[at:stop].to(device=device), alpha=noise_std)
            if server_lr != 1.0:
                mean.mul_(server_lr)
            step = encoded_chunk(mean, encoded[name], at, stop, work, decoded)
            torch.add(flat_x[at:stop], step.to(dtype=flat_x.dtype), out=flat_new[at:stop])
            if not_finite is None and not all_finite(flat_new[at:stop]):
                not_finite = name
            at = stop
        if at != n:
            raise ValueError(f"{name}: the updates' chunks hold {at:,} values, expected {n:,}")
    return encoded, new, not_finite
