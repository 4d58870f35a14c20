"""How a set of tensors travels as a few numpy arrays (no Flower here: the node worker imports it).

A record's tensors travel packed, not one array per tensor: Flower stores, hashes, pushes and pulls
every ``Array`` as an object of its own, so a block of dozens of tensors (a full model: hundreds)
cost dozens of round trips. A packed record is

- ``values``: every tensor's values, flattened and concatenated in the layout's order, as one 1-D
  array of the transfer dtype (``WIRE_DTYPES``: fp32, fp16; bf16, which numpy lacks, as its raw
  16-bit patterns in ``int16``; int8);
- ``layout``: the names and shapes, UTF-8 JSON ``[[name, [d0, d1, ...]], ...]`` in a ``uint8`` array;
- ``scales`` (int8 only): one fp32 scale per ``core.INT8_BLOCK`` values of each tensor.

``unpack`` trusts nothing a record declares: the layout is parsed and bounded, the payload's own
dtype and size (not its metadata) are checked against the layout (and against the receiver's
expected names and shapes when it has them), int8 scales are checked before use; a malformed
record raises ``WireError`` with a one-line reason. The receiver needs no setting to decode:
the payload's dtype says how.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

import numpy as np
import torch

from .core import INT8_BLOCK, TRANSFER_DTYPES, Tensors, dequantize_int8, int8_blocks, quantize_int8

# The payload dtype each transfer precision uses on the wire, from core.TRANSFER_DTYPES (the one table):
# the same dtype in numpy, but bf16 (which numpy lacks) as its raw 16-bit patterns.
WIRE_DTYPES = {
    name: np.dtype(np.int16) if dtype == torch.bfloat16 else np.dtype(str(dtype).removeprefix("torch."))
    for name, dtype in TRANSFER_DTYPES.items()
}
_TRANSFER_OF = {dtype: name for name, dtype in WIRE_DTYPES.items()}
VALUES, LAYOUT, SCALES = "values", "layout", "scales"
# A layout entry is about 60 bytes: 16 MiB holds some 250,000 tensors, far above any model's.
MAX_LAYOUT_BYTES = 16 * 1024 * 1024
# The largest int8 scale whose dequantised values (|q| <= 127) stay finite in fp32.
MAX_INT8_SCALE = float(np.finfo(np.float32).max) / 127


class WireError(ValueError):
    """A packed record refused; the message is one line naming the bad value and what was expected."""


def pack(tensors: Mapping[str, torch.Tensor], transfer_dtype: str = "fp32") -> dict[str, np.ndarray]:
    """The arrays that carry ``tensors`` (lossless for values already ``core.round_for_transfer``-ed)."""
    flat = [t.detach().reshape(-1).cpu() for t in tensors.values()]
    layout = json.dumps([[name, list(t.shape)] for name, t in tensors.items()]).encode()
    arrays = {LAYOUT: np.frombuffer(layout, dtype=np.uint8)}
    if transfer_dtype == "int8":
        quantised = [quantize_int8(t) for t in flat]
        arrays[VALUES] = _cat([q for q, _ in quantised], torch.int8).numpy()
        arrays[SCALES] = _cat([s for _, s in quantised], torch.float32).numpy()
        return arrays
    values = _cat([t.to(TRANSFER_DTYPES[transfer_dtype]) for t in flat], TRANSFER_DTYPES[transfer_dtype])
    arrays[VALUES] = values.view(torch.int16).numpy() if transfer_dtype == "bf16" else values.numpy()
    return arrays


def _cat(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)


def unpack(
    arrays: Mapping[str, np.ndarray],
    expected: Mapping[str, tuple[int, ...]] | None = None,
    transfer_dtype: str | None = None,
) -> Tensors:
    """The fp32 tensors a packed record stands for, in ``expected``'s order when given (else the layout's).

    ``expected``: the names and shapes the receiver knows the record must hold; ``transfer_dtype``: the
    payload dtype it must travel in. Raises ``WireError`` for a record refused."""
    if not {VALUES, LAYOUT} <= set(arrays) <= {VALUES, LAYOUT, SCALES}:
        raise WireError(f"record arrays {sorted(arrays)[:4]}: expected {VALUES}, {LAYOUT} (and {SCALES} for int8)")
    layout = read_layout(arrays[LAYOUT])
    if expected is not None:
        check_layout(layout, expected)
        layout = {name: tuple(expected[name]) for name in expected}
    values = arrays[VALUES]
    if not isinstance(values, np.ndarray) or values.dtype not in _TRANSFER_OF or values.ndim != 1:
        found = f"{getattr(values, 'dtype', type(values).__name__)} {getattr(values, 'shape', '')}"
        raise WireError(f"values: {found}; expected a 1-D array of {', '.join(map(str, _TRANSFER_OF))}")
    dtype = _TRANSFER_OF[values.dtype]
    if transfer_dtype is not None and dtype != transfer_dtype:
        raise WireError(
            f"wrong dtype for values: {values.dtype}, expected {WIRE_DTYPES[transfer_dtype]} "
            f"(transfer-dtype={transfer_dtype})"
        )
    sizes = [math.prod(shape) for shape in layout.values()]
    if values.size != sum(sizes):
        raise WireError(f"values: {values.size:,} numbers, expected {sum(sizes):,} ({len(sizes)} tensors' shapes)")
    flat = _decode_values(values, dtype, sizes, arrays.get(SCALES))
    return {name: t.view(shape) for (name, shape), t in zip(layout.items(), torch.split(flat, sizes))}


def read_layout(array: np.ndarray) -> dict[str, tuple[int, ...]]:
    """The names and shapes a record declares, each checked."""
    if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 1:
        raise WireError(f"layout: {getattr(array, 'dtype', type(array).__name__)}; expected 1-D uint8 (UTF-8 JSON)")
    if array.size > MAX_LAYOUT_BYTES:
        raise WireError(f"layout of {array.size:,} bytes; expected at most {MAX_LAYOUT_BYTES:,}")
    try:
        entries = json.loads(array.tobytes())
    except (ValueError, RecursionError) as err:
        raise WireError(f"layout is not JSON ({type(err).__name__}); expected [[name, shape], ...]") from None
    layout: dict[str, tuple[int, ...]] = {}
    for entry in entries if isinstance(entries, list) else [entries]:
        ok = isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], list)
        if not ok or not all(type(d) is int and d >= 0 for d in entry[1]) or len(entry[1]) > 32:
            raise WireError(f"layout entry {entry!r:.80}: expected [name, [non-negative ints]]")
        if entry[0] in layout:
            raise WireError(f"layout names {entry[0]!r:.80} twice; expected unique names")
        layout[entry[0]] = tuple(entry[1])
    return layout


def check_layout(layout: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]) -> None:
    """The declared names and shapes are the expected ones (any order)."""
    if set(layout) != set(expected):
        missing, extra = sorted(set(expected) - set(layout)), sorted(set(layout) - set(expected))
        raise WireError(f"wrong parameters: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, shape in expected.items():
        if layout[name] != tuple(shape):
            raise WireError(f"wrong shape for {name}: {layout[name]}, expected {tuple(shape)}")


def _decode_values(values: np.ndarray, dtype: str, sizes: list[int], scales) -> torch.Tensor:
    """The flat fp32 values (a bf16/fp16/int8 payload converted: new memory; fp32: the payload's own)."""
    # A payload read from a socket is read-only (torch wants writable memory): fp32 is copied once then.
    t = torch.from_numpy(values if values.flags.writeable else values.copy())
    if dtype != "int8":
        if scales is not None:
            raise WireError(f"scales with transfer-dtype={dtype}: expected them with int8 only")
        return t.view(torch.bfloat16).float() if dtype == "bf16" else t.float()
    scales = check_scales(scales, sum(int8_blocks(n) for n in sizes))
    parts = torch.split(t, sizes)
    per_tensor = torch.split(scales, [int8_blocks(n) for n in sizes])
    return _cat([dequantize_int8(p, s) for p, s in zip(parts, per_tensor)], torch.float32)


def check_scales(scales, count: int) -> torch.Tensor:
    """int8's scales, checked: fp32, one per ``INT8_BLOCK`` values of each tensor, each 0 or a power of
    two (the sender's rounding, ``core.quantize_int8``) no larger than ``MAX_INT8_SCALE``."""
    if scales is None:
        raise WireError(f"int8 values without {SCALES}: expected one fp32 scale per {INT8_BLOCK} values")
    if not isinstance(scales, np.ndarray) or scales.dtype != np.float32 or scales.ndim != 1:
        found = f"{getattr(scales, 'dtype', type(scales).__name__)} {getattr(scales, 'shape', '')}"
        raise WireError(f"scales: {found}; expected a 1-D float32 array")
    if scales.size != count:
        raise WireError(f"scales: {scales.size:,}, expected {count:,} (one per {INT8_BLOCK} values of each tensor)")
    bad = ~(np.isfinite(scales) & (scales >= 0) & (scales <= MAX_INT8_SCALE))
    mantissa, _ = np.frexp(scales)
    bad |= (scales != 0) & (mantissa != 0.5)
    if bad.any():
        value = scales[np.argmax(bad)]
        raise WireError(f"int8 scale {value!r}: expected 0 or a power of two in (0, {MAX_INT8_SCALE:.3g}]")
    return torch.from_numpy(scales.copy())


def payload_bytes(tensors: Mapping[str, torch.Tensor], transfer_dtype: str) -> int:
    """The bytes of ``values`` and ``scales`` that ``pack`` makes (the layout aside)."""
    sizes = [t.numel() for t in tensors.values()]
    scales = sum(int8_blocks(n) for n in sizes) * 4 if transfer_dtype == "int8" else 0
    return sum(sizes) * WIRE_DTYPES[transfer_dtype].itemsize + scales
