"""How a set of tensors travels as a few numpy arrays (no Flower here: the node worker imports it).

A record's tensors travel packed, not one array per tensor: Flower stores, hashes, pushes and pulls
every ``Array`` as an object of its own, so a block of dozens of tensors (a full model: hundreds)
cost dozens of round trips. A packed record is, in this order (the order its bytes travel in, so that a
receiver can decode the values chunk by chunk as they land: ``LandingArrays``)

- ``layout``: the names and shapes, UTF-8 JSON ``[[name, [d0, d1, ...]], ...]`` in a ``uint8`` array;
- ``scales`` (int8 only): one fp32 scale per ``core.INT8_BLOCK`` values of each tensor;
- ``values``: every tensor's values, flattened and concatenated in the layout's order, as one 1-D
  array of the transfer dtype (``WIRE_DTYPES``: fp32, fp16; bf16, which numpy lacks, as its raw
  16-bit patterns in ``int16``; int8).

``unpack`` trusts nothing a record declares: the layout is parsed and bounded, the payload's own
dtype and size (not its metadata) are checked against the layout (and against the receiver's
expected names and shapes when it has them), int8 scales are checked before use; a malformed
record raises ``WireError`` with a one-line reason. The receiver needs no setting to decode:
the payload's dtype says how.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterator, Mapping

import numpy as np
import torch

from . import kept_blocks
from .core import (
    INT8_BLOCK,
    TRANSFER_DTYPES,
    Encoded,
    EncodedTensors,
    decoded_chunks,
    dequantize_int8,
    encode,
    encoded_sum_of_squares,
    int8_blocks,
)
from .npy import npy_header

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
# Values a chunked read (``Payload.chunks``) decodes at a time: 256 KiB of fp32, under the allocator's mapping
# threshold (``memory.map_large_buffers``: 1 MiB), so its buffer and float64's temporaries come from the heap
# and stay in cache, never faulted in afresh.
READ_CHUNK_VALUES = 64 * 1024
# Values decoded per wait while a record still lands (``LandingArrays``): 4 MiB of int8, a few of the stream's chunks,
# so that the pass waits a few hundred times for a block, not once per chunk it decodes.
LANDING_PIECE_VALUES = 4 * 1024 * 1024


class WireError(ValueError):
    """A packed record refused; the message is one line naming the bad value and what was expected."""


def pack(tensors: Mapping[str, torch.Tensor], transfer_dtype: str = "fp32") -> dict[str, np.ndarray]:
    """The arrays that carry ``tensors`` (lossless for values already ``core.round_for_transfer``-ed)."""
    return join_pieces(pack_pieces(tensors, transfer_dtype))


def join_pieces(pieces: Mapping[str, list[np.ndarray]]) -> dict[str, np.ndarray]:
    """``pack_pieces``'s pieces as the arrays they stand for (``pack``'s)."""
    return {name: join(array_pieces) for name, array_pieces in pieces.items()}


def pack_pieces(
    tensors: Mapping[str, torch.Tensor], transfer_dtype: str = "fp32", encoded: Encoded | None = None
) -> dict[str, list[np.ndarray]]:
    """``pack``'s arrays as the 1-D pieces that, joined, make each: ``values`` and ``scales`` one per tensor
    (an fp32 tensor's own memory: nothing copied yet). A writer that copies them once into its own buffer
    (``records.to_record``) never builds the block-sized array in between. ``encoded``: the tensors already
    as they travel (``core.round_with_feedback_encoded``: a node's update), not converted again."""
    # Converted where the tensor is, then moved: a GPU node quantises or casts its update on the device
    # and copies a quarter (int8) or half (bf16) of the fp32 bytes to the host, not all of them to convert
    # there. Lossless on any device for values already rounded (what the node keeps is what arrives).
    if encoded is None:  # a node's kept update travels as it was encoded (in this dtype), not converted again
        own = isinstance(tensors, (EncodedTensors, Decoded)) and tensors.travels_as(transfer_dtype)
        encoded = tensors.encoded if own else encode(tensors, transfer_dtype)
    kept = isinstance(tensors, (EncodedTensors, Decoded))  # (their ``items()`` would decode every tensor)
    shapes = tensors.shapes if kept else {n: t.shape for n, t in tensors.items()}
    pieces = {LAYOUT: [np.frombuffer(layout_bytes(shapes), dtype=np.uint8)]}
    if transfer_dtype == "int8":  # before the values: a receiver decodes each chunk of them as it lands
        pieces[SCALES] = [encoded[name][1].cpu().numpy() for name in tensors] or [np.zeros(0, np.float32)]
    values = [encoded[name][0].cpu() for name in tensors]
    bf16 = transfer_dtype == "bf16"
    pieces[VALUES] = [v.view(torch.int16).numpy() if bf16 else v.numpy() for v in values]
    pieces[VALUES] = pieces[VALUES] or [np.zeros(0, WIRE_DTYPES[transfer_dtype])]
    return pieces


def layout_bytes(shapes: Mapping[str, tuple[int, ...]]) -> bytes:
    """A packed record's ``layout`` array's bytes: the names and shapes, in order."""
    return json.dumps([[name, list(shape)] for name, shape in shapes.items()]).encode()


def encoding_payloads(
    shapes: Mapping[str, tuple[int, ...]], transfer_dtype: str
) -> tuple[Encoded, dict[str, memoryview]]:
    """A block's encoding to be written where it travels from (``core.applied_mean_step``'s ``encoded_into``: the
    server's step). Each array of its packed record (``pack_pieces``'s layout, int8's scales and values) is one npy
    payload in kept memory, its header then its values; each tensor's values and scales are views of their place
    in it. Returns those views, to fill, and the payloads (array name -> its npy bytes, read-only), which once the
    views are filled are the record as it is: nothing joined (``records.payloads_record``). Joined into fresh memory,
    the step cost a pass over the block between the last reply and the next message."""
    counts = [math.prod(shape) for shape in shapes.values()]
    blocks = [int8_blocks(count) if transfer_dtype == "int8" else 0 for count in counts]
    layout = np.frombuffer(layout_bytes(shapes), dtype=np.uint8)
    payloads: dict[str, memoryview] = {}  # in ``pack_pieces``' order: the framed record's bytes are the same
    _payload(payloads, LAYOUT, layout.dtype, layout.size)[:] = layout
    scales = _payload(payloads, SCALES, np.dtype(np.float32), sum(blocks)) if transfer_dtype == "int8" else None
    values = _payload(payloads, VALUES, WIRE_DTYPES[transfer_dtype], sum(counts))
    encoded, at, scales_at = {}, 0, 0
    for name, count, tensor_blocks in zip(shapes, counts, blocks):
        tensor_values = torch.from_numpy(values[at : at + count])
        if transfer_dtype == "bf16":
            tensor_values = tensor_values.view(torch.bfloat16)
        tensor_scales = torch.from_numpy(scales[scales_at : scales_at + tensor_blocks]) if scales is not None else None
        encoded[name] = (tensor_values, tensor_scales)
        at, scales_at = at + count, scales_at + tensor_blocks
    return encoded, payloads


def _payload(payloads: dict[str, memoryview], name: str, dtype: np.dtype, count: int) -> np.ndarray:
    """An npy payload of ``count`` values of ``dtype`` in kept memory, its header written: into ``payloads`` as a
    read-only view of all its bytes; returned, the writable array of its values (a view of the kept memory's own
    memoryview, which holds that memory as long as the array lives: ``kept_blocks``)."""
    header = npy_header(dtype, (count,))  # its length a multiple of 64: the values start aligned as the memory does
    memory = kept_blocks.KEPT.host_bytes(len(header) + count * dtype.itemsize)
    memory[: len(header)] = header
    payloads[name] = memory.toreadonly()
    return np.frombuffer(memory, dtype=dtype, count=count, offset=len(header))


def kept_dtype(tensors: Mapping[str, torch.Tensor]) -> str:
    """The transfer dtype that tensors kept as they travel are encoded in (a ``Decoded``'s, an ``EncodedTensors``'),
    else fp32: packed in it, they are written as they are, nothing converted."""
    if isinstance(tensors, (EncodedTensors, Decoded)):
        return next((dtype for dtype in TRANSFER_DTYPES if tensors.travels_as(dtype)), "fp32")
    return "fp32"


def round_and_pack(
    tensors: Mapping[str, torch.Tensor], transfer_dtype: str = "fp32", lazy: bool = False
) -> tuple[Mapping[str, torch.Tensor], dict[str, list[np.ndarray]]]:
    """``core.round_for_transfer(tensors)`` and ``pack_pieces`` of it, from one conversion: the fp32
    values as they will arrive, read back from the pieces that carry them. The server's step is
    rounded, applied and sent every round between the last reply and the next message; rounding it
    and then encoding it converted the block twice (int8: quantised it twice). ``lazy``: the values as a
    ``Decoded`` over the pieces, each tensor decoded when read (the server applies its step chunk by chunk,
    writing no fp32 copy of it on the critical path)."""
    pieces = pack_pieces(tensors, transfer_dtype)
    if transfer_dtype == "fp32":
        return dict(tensors), pieces
    rounded = read_pieces(pieces, {name: tuple(tensor.shape) for name, tensor in tensors.items()}, transfer_dtype)
    return (rounded if lazy else dict(rounded.items())), pieces


def pack_encoded(
    encoded: Encoded, shapes: Mapping[str, tuple[int, ...]], transfer_dtype: str
) -> tuple[Mapping[str, torch.Tensor], dict[str, list[np.ndarray]]]:
    """``round_and_pack(lazy=True)``'s two results for a step already encoded (``core.applied_mean_step``'s):
    its values as a receiver reads them (fp32's own memory, to be read only: it may be the very bytes sent,
    ``encoding_payloads``), and the pieces that carry them. Raises
    ``WireError`` where a receiver would refuse them (an int8 scale past ``MAX_INT8_SCALE``)."""
    pieces = pack_pieces(EncodedTensors(encoded, shapes), transfer_dtype)  # as it is: it travels so already
    if transfer_dtype == "fp32":
        return {name: encoded[name][0].view(shape) for name, shape in shapes.items()}, pieces
    return read_pieces(pieces, shapes, transfer_dtype), pieces


def read_pieces(
    pieces: Mapping[str, list[np.ndarray]], shapes: Mapping[str, tuple[int, ...]], transfer_dtype: str
) -> Decoded:
    """The fp32 values ``pack_pieces``'s pieces carry, each tensor decoded as a receiver decodes it (its int8
    scales checked) when read."""
    parts = {}
    for i, (name, shape) in enumerate(shapes.items()):
        scales = pieces[SCALES][i] if transfer_dtype == "int8" else None
        (decode,) = _decoders(pieces[VALUES][i], transfer_dtype, [math.prod(shape)], scales)
        parts[name] = (tuple(shape), decode)
    return Decoded(parts)


def join(pieces: list[np.ndarray]) -> np.ndarray:
    """The pieces in one new array (never a tensor's own memory: the array outlives the call)."""
    return np.concatenate(pieces)


class LandingArrays(dict):
    """A packed record's arrays (name -> read-only array) over memory its bytes are still landing in: its layout and
    scales have landed, its values may not have (the last on the wire: ``pack_pieces``). ``wait_until(address)``
    returns once every byte below ``address`` has landed, and raises where they never will. ``unpack`` reads it as
    any record, and its ``Decoded`` decodes each piece of the values once it has landed: the server's pass over a
    round's updates runs as they arrive (``FedBCD.prepare_pass_ahead``)."""

    def __init__(self, arrays: Mapping[str, np.ndarray], wait_until) -> None:
        super().__init__(arrays)
        self.wait_until = wait_until


def unpack(
    arrays: Mapping[str, np.ndarray],
    expected: Mapping[str, tuple[int, ...]] | None = None,
    transfer_dtype: str | None = None,
    read_only: bool = False,
    lazy: bool = False,
) -> Mapping[str, torch.Tensor]:
    """The fp32 tensors a packed record stands for, in ``expected``'s order when given (else the layout's).

    ``expected``: the names and shapes the receiver knows the record must hold; ``transfer_dtype``: the
    payload dtype it must travel in. Raises ``WireError`` for a record refused. No arrays at all stand for
    no tensors (the server's first global step is an empty record). ``read_only``: fp32 values may be
    views of a read-only payload, which the caller only reads (the server's checks of a reply: its values
    are decoded once, when they are combined). ``lazy``: everything is checked now, but each tensor is decoded to
    fp32 only when read, again at each read (``Decoded``): a node keeps the round's global step as it came, not a
    block in fp32 beside the next block's training."""
    if not arrays:
        check_layout({}, expected or {})
        return {}
    if not {VALUES, LAYOUT} <= set(arrays) <= {VALUES, LAYOUT, SCALES}:
        raise WireError(f"record arrays {sorted(arrays)[:4]}: expected {VALUES}, {LAYOUT} (and {SCALES} for int8)")
    layout = read_layout(arrays[LAYOUT])
    if expected is not None:
        check_layout(layout, expected)  # the same names and shapes: the values are cut in the layout's order
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
    wait_until = arrays.wait_until if isinstance(arrays, LandingArrays) else None
    decoders = _decoders(values, dtype, sizes, arrays.get(SCALES), read_only, wait_until)
    if lazy:
        out = Decoded({name: (shape, d) for (name, shape), d in zip(layout.items(), decoders)})
        return out if expected is None else Decoded({name: out.parts[name] for name in expected})
    out = {name: d().view(shape) for (name, shape), d in zip(layout.items(), decoders)}
    return out if expected is None else {name: out[name] for name in expected}


class Decoded(Mapping[str, torch.Tensor]):
    """A checked record's tensors, each decoded to fp32 when read (``unpack(lazy=True)``), from the payload it
    came in: a quarter (int8) or half (bf16, fp16) of the fp32 bytes held, and one tensor's fp32 at a time."""

    def __init__(self, parts: dict[str, tuple[tuple[int, ...], Payload]]):
        self.parts = parts

    def __getitem__(self, name: str) -> torch.Tensor:
        shape, decode = self.parts[name]
        return decode().view(shape)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, (shape, _) in self.parts.items()}

    def chunks(self, name: str, buffer: torch.Tensor | None = None) -> Iterator[torch.Tensor]:
        """The tensor's flat fp32 values chunk by chunk from its payload (``Payload.chunks``), each in ``buffer``
        (default: ``READ_CHUNK_VALUES``) and overwritten by the next: no tensor-sized memory."""
        return self.parts[name][1].chunks(torch.empty(READ_CHUNK_VALUES) if buffer is None else buffer)

    @property
    def encoded(self) -> Encoded:
        """Each tensor as it came (its payload's values, int8's scales): what packs it again as it is (once landed)."""
        for _, payload in self.parts.values():
            payload.landed(payload.values.numel())
        return {name: (payload.values, payload.scales) for name, (_, payload) in self.parts.items()}

    def travels_as(self, transfer_dtype: str) -> bool:
        """Whether it came in ``transfer_dtype`` (``EncodedTensors.travels_as``)."""
        return all(payload.dtype == transfer_dtype for _, payload in self.parts.values())

    def sum_of_squares(self, name: str) -> float:
        """The tensor's ``Σ v²`` in float64, from its payload (``Payload.sum_of_squares``)."""
        return self.parts[name][1].sum_of_squares(torch.empty(READ_CHUNK_VALUES))

    def __iter__(self) -> Iterator[str]:
        return iter(self.parts)

    def __contains__(self, name: object) -> bool:  # (Mapping's would decode the tensor)
        return name in self.parts

    def __len__(self) -> int:
        return len(self.parts)


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


def _decoders(
    values: np.ndarray, dtype: str, sizes: list[int], scales, read_only: bool = False, wait_until=None
) -> list[Payload]:
    """For each tensor, its ``Payload``: what gives its flat fp32 values (``wait_until``: a ``LandingArrays``' own,
    while the values land). The scales are checked here, before any is used."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        parts = torch.split(torch.from_numpy(values), sizes)
    if dtype == "int8":
        scales = check_scales(scales, sum(int8_blocks(n) for n in sizes))
        per_tensor = torch.split(scales, [int8_blocks(n) for n in sizes])
        return [Payload(p, "int8", s, wait_until=wait_until) for p, s in zip(parts, per_tensor)]
    if scales is not None:
        raise WireError(f"scales with transfer-dtype={dtype}: expected them with int8 only")
    if dtype == "bf16":
        return [Payload(p.view(torch.bfloat16), dtype, wait_until=wait_until) for p in parts]
    shared = dtype == "fp32" and (values.flags.writeable or read_only)
    return [Payload(p, dtype, shared=shared, wait_until=wait_until) for p in parts]


class Payload:
    """One tensor's flat values as they came (int8's q and scales, bf16, fp16, fp32) and how to read them in fp32.

    Called, it gives them in new memory of its own (a read-only payload, from a socket or a Flower ``Array``, is
    read, not shared; a writable fp32 payload is shared, and so is a read-only one when the caller only reads).
    One allocation per tensor, not one block-sized buffer. ``chunks`` reads them without any tensor-sized
    memory: a check that only reads (a reply's norm) writes no block in fp32, whose fresh pages cost more
    than the decode on the server's critical path."""

    def __init__(
        self, values: torch.Tensor, dtype: str, scales: torch.Tensor | None = None, shared: bool = False,
        wait_until=None,
    ):  # fmt: skip
        self.values, self.dtype, self.scales, self.shared = values, dtype, scales, shared
        self.wait_until = wait_until  # while the values land: returns once the bytes below an address have

    def __call__(self) -> torch.Tensor:
        self.landed(self.values.numel())
        if self.dtype == "int8":
            return dequantize_int8(self.values, self.scales)
        if self.dtype == "fp32":
            return self.values.detach() if self.shared else self.values.clone()  # detach: the same memory
        return self.values.float()

    def chunks(self, buffer: torch.Tensor) -> Iterator[torch.Tensor]:
        """The fp32 values, chunk after chunk, each in ``buffer`` (fp32, a multiple of ``INT8_BLOCK`` values;
        overwritten by the next chunk) or, in fp32, the payload itself (read only). While the values land, a piece
        of ``LANDING_PIECE_VALUES`` (whole chunks) is decoded once its bytes have: the same chunks, as they land."""
        if self.wait_until is None:
            return decoded_chunks(self.values, self.scales, buffer)
        return self._chunks_as_they_land(buffer)

    def _chunks_as_they_land(self, buffer: torch.Tensor) -> Iterator[torch.Tensor]:
        """``decoded_chunks``' chunks, a piece at a time once it has landed. A piece is whole chunks (each whole
        int8 blocks), so the chunks are the very ones of a payload that came whole: the server's pass reads the
        updates' chunks side by side (``zip(strict=True)``), landed or landing, and sums the same floats."""
        n, step = self.values.numel(), buffer.numel()
        piece = max(step, LANDING_PIECE_VALUES // step * step)  # whole chunks, each whole int8 blocks
        for start in range(0, n, piece):
            stop = min(n, start + piece)
            self.landed(stop)
            scales = self.scales[start // INT8_BLOCK : int8_blocks(stop)] if self.scales is not None else None
            yield from decoded_chunks(self.values[start:stop], scales, buffer)

    def landed(self, count: int) -> None:
        """Returns once the first ``count`` values have landed (at once for a payload that came whole)."""
        if self.wait_until is not None and count:
            self.wait_until(self.values.data_ptr() + count * self.values.element_size())

    def sum_of_squares(self, buffer: torch.Tensor) -> float:
        """``Σ v²`` in float64, read from the payload (``core.encoded_sum_of_squares``: int8's without decoding)."""
        self.landed(self.values.numel())
        return encoded_sum_of_squares(self.values, self.scales, buffer)


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
        value = float(scales[np.argmax(bad)])
        raise WireError(f"int8 scale {value!r}: expected 0 or a power of two in (0, {MAX_INT8_SCALE:.3g}]")
    return torch.from_numpy(scales.copy())


def payload_bytes(tensors: Mapping[str, torch.Tensor], transfer_dtype: str) -> int:
    """The bytes of ``values`` and ``scales`` that ``pack`` makes (the layout aside)."""
    shapes = getattr(tensors, "shapes", None)  # Decoded, EncodedTensors: counted without decoding
    sizes = [math.prod(s) for s in shapes.values()] if shapes is not None else [t.numel() for t in tensors.values()]
    scales = sum(int8_blocks(n) for n in sizes) * 4 if transfer_dtype == "int8" else 0
    return sum(sizes) * WIRE_DTYPES[transfer_dtype].itemsize + scales
