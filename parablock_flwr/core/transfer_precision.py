"""Transfer precision: ``Δ_i`` and ``g`` travel rounded to the run's ``transfer-dtype``, and every copy
of ``x`` applies the rounded values.

Apart from the arithmetic because the rounding is a choice of how to send a step, not of which step to
take; ``wire.py`` encodes what these functions round, and int8's block size and scales are defined once, here.
"""

from __future__ import annotations

import torch

from .algorithm import Tensors

# int8 is symmetric and blockwise: ``quantize_int8`` (one fp32 power-of-two scale per INT8_BLOCK values).
TRANSFER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}
INT8_BLOCK = 256  # int8: values per scale, within one tensor (its flattened values; the last block may be short)


def int8_blocks(numel: int) -> int:
    """How many scales a tensor of ``numel`` values travels with in int8."""
    return -(-numel // INT8_BLOCK)


def quantize_int8(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8, round to nearest: the flattened values in blocks of ``INT8_BLOCK``, each with
    the smallest power-of-two fp32 scale ``s >= max|v| / 127`` (0 for an all-zero block).

    Power-of-two scales make ``q * s`` exact and the rounding idempotent: quantising dequantised values
    gives back the same ``q`` and ``s`` (``max|q|`` is then in [64, 127], which picks the same ``s``), so
    the server can round ``g``, apply it, and encode it again for the wire without changing a bit.
    """
    # Few passes and fresh buffers over the block: the server quantises it on its critical path.
    # max|v| is max(max, -min), without |v|'s copy.
    flat = tensor.detach().reshape(-1).float()
    n = flat.numel()
    padded = int8_blocks(n) * INT8_BLOCK
    blocks = (flat if padded == n else torch.nn.functional.pad(flat, (0, padded - n))).view(-1, INT8_BLOCK)
    low, high = torch.aminmax(blocks, dim=1)
    bound = torch.maximum(high, -low) / 127
    mantissa, exponent = torch.frexp(bound)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two is its own scale
    scale = torch.pow(2.0, exponent.double()).float()  # exact in float64, then exactly representable
    scale = torch.where(bound > 0, scale, 0.0)
    scale = torch.where(bound.isfinite(), scale, bound)  # a non-finite block keeps its scale: it is refused
    divisor = torch.where(scale > 0, scale, 1.0)[:, None]
    q = torch.div(blocks, divisor).round_().clamp_(-127, 127).nan_to_num_(0.0).to(torch.int8)
    return q.view(-1)[:n], scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The flat fp32 values ``q * s`` (each exact: ``s`` is a power of two), written once into the
    result (the scales are broadcast over each block, not repeated into a block-sized copy)."""
    n = q.numel()
    full = n // INT8_BLOCK * INT8_BLOCK
    out = torch.empty(n, dtype=torch.float32, device=q.device)
    torch.mul(q[:full].view(-1, INT8_BLOCK), scale[: full // INT8_BLOCK, None], out=out[:full].view(-1, INT8_BLOCK))
    if full < n:  # the tensor's short last block
        torch.mul(q[full:], scale[full // INT8_BLOCK], out=out[full:])
    return out


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


def round_with_feedback(update: Tensors, residual: Tensors | None, transfer_dtype: str) -> tuple[Tensors, Tensors]:
    """Error feedback: ``sent = round(Δ + e)``, ``e' = Δ + e − sent``.

    A client sends (and keeps as its pending update) exactly ``sent``, so the invariant
    ``y = x^{r-1} + sent`` stays bit-exact; what rounding dropped, ``e'``, is added to its
    next update of the same block instead of being lost.
    """
    corrected = {n: t + residual[n] for n, t in update.items()} if residual else update
    sent = round_for_transfer(corrected, transfer_dtype)
    return sent, {n: corrected[n] - sent[n] for n in corrected}
