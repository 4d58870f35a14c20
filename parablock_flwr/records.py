"""Conversions between Flower's ArrayRecord and the core's name->tensor dicts.

A record's tensors travel packed as ``wire.py`` says (one ``values`` array of the transfer dtype, its
``layout``, and int8's ``scales``); this module only adds Flower's records around those arrays, so
that the node worker, which never imports Flower, shares the encoding.

Each ``Array`` holds standard ``.npy`` bytes (what ``Array(ndarray)`` and ``Array.numpy()`` write and
read), built and read here with one copy: ``np.save`` into a ``BytesIO`` and ``np.load`` from one copy a
block-sized array three and two times, which on a machine short of memory bandwidth cost more than
Flower's own work on a block. The npy reading and writing is
``npy.py``'s, which the torch-free ClientApp relay shares. A record whose payloads already lie in memory as npy
(the server's step where its pass wrote it, an upload where it landed) gets ``Array``s that view them, no copy
(``payloads_record``), and ``bytes`` of them only where Flower's own path serialises it (``flower_ready``).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, Message
from flwr.common.constant import SType

from .core import Tensors
from .npy import NpyError, npy_header, npy_view
from .wire import WIRE_DTYPES, WireError, pack_pieces, unpack

__all__ = ["WIRE_DTYPES", "WireError", "flower_ready", "payloads_record", "pieces_record", "record_arrays",
           "to_record", "to_tensors"]  # fmt: skip


def to_array(pieces: list[np.ndarray]) -> Array:
    """The ``Array`` of the 1-D pieces joined (``Array(np.concatenate(pieces))``), each piece copied once
    into the payload: its npy header, then the pieces' bytes."""
    dtype, count = pieces[0].dtype, sum(p.size for p in pieces)
    data = b"".join([npy_header(dtype, (count,)), *(memoryview(np.ascontiguousarray(p)).cast("B") for p in pieces)])
    return Array(dtype=str(dtype), shape=(count,), stype=SType.NUMPY, data=data)


def from_array(array: Array, name: str) -> np.ndarray:
    """The array an ``Array``'s payload holds (its own npy header, not the Array's metadata), as a read-only
    view of the payload: nothing copied. Raises ``WireError`` for a payload that is not a plain npy array."""
    try:
        return npy_view(array.data, name)
    except NpyError as err:
        raise WireError(str(err)) from None


def record_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    """The record's arrays, each read from its payload (``from_array``)."""
    return {name: from_array(array, name) for name, array in record.items()}


def to_tensors(
    record: ArrayRecord, expected=None, transfer_dtype: str | None = None, read_only: bool = False, lazy: bool = False
) -> Tensors:
    """The fp32 tensors a packed record stands for (``wire.unpack``: ``expected`` names and shapes and the
    ``transfer_dtype`` are checked when given; ``read_only``: fp32 values may be views of the payload; ``lazy``:
    each decoded when read, ``wire.Decoded``)."""
    return unpack(record_arrays(record), expected, transfer_dtype, read_only, lazy)


def to_record(tensors: Tensors, transfer_dtype: str = "fp32") -> ArrayRecord:
    """``tensors`` packed into one record of a few arrays (lossless for values already rounded)."""
    return pieces_record(pack_pieces(tensors, transfer_dtype))


def pieces_record(pieces: dict[str, list[np.ndarray]]) -> ArrayRecord:
    """The record of ``wire.pack_pieces``'s (or ``wire.round_and_pack``'s) pieces, each array joined once."""
    return ArrayRecord({name: to_array(array_pieces) for name, array_pieces in pieces.items()})


def payloads_record(payloads: Mapping[str, memoryview | bytes]) -> ArrayRecord:
    """The record of npy payloads as they lie (``wire.encoding_payloads``' once filled, an upload's where it
    landed): each ``Array`` over its payload, nothing copied (``payload_array``). It is filled item by item: the
    ``ArrayRecord`` constructor makes each ``Array`` again."""
    record = ArrayRecord()
    for name, payload in payloads.items():
        record[name] = payload_array(payload, name)
    return record


def payload_array(payload: memoryview | bytes, name: str) -> Array:
    """Flower's ``Array`` of an npy payload as it lies (a read-only view of kept memory, or bytes), checked to be
    a plain npy array. The view is set after the constructor, which takes ``bytes`` only: copied into ``bytes``, a
    block would cost a pass into new memory on the critical path. What reads ``Array.data`` in this app
    (``from_array``, ``Array.numpy``, ``len``, the stream's framing) takes any buffer; Flower's own path takes
    ``bytes`` (``flower_ready``)."""
    view = npy_view(payload, name)
    array = Array(dtype=str(view.dtype), shape=view.shape, stype=SType.NUMPY, data=b"")
    array.data = payload
    return array


def flower_ready(message: Message) -> Message:
    """``message`` as Flower's own path takes it (its protobuf, Ray's pickling): the payload of an ``Array`` that
    is a view (``payload_array``'s) becomes ``bytes`` of its own, the copy it would have cost anyway."""
    for record in message.content.array_records.values():
        for name in record:
            if not isinstance(record[name].data, bytes):
                record[name].data = bytes(record[name].data)
    return message
