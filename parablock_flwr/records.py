"""Conversions between Flower's ArrayRecord and the core's name->tensor dicts.

A record's tensors travel packed as ``wire.py`` says (one ``values`` array of the transfer dtype, its
``layout``, and int8's ``scales``); this module only adds Flower's records around those arrays, so
that the node worker, which never imports Flower, shares the encoding.

Each ``Array`` holds standard ``.npy`` bytes (what ``Array(ndarray)`` and ``Array.numpy()`` write and
read), built and read here with one copy: ``np.save`` into a ``BytesIO`` and ``np.load`` from one copy a
block-sized array three and two times, and on a machine short of memory bandwidth a 70 MB block's copies
cost more than Flower's own work on it (benchmarks/wire_pack.py).
"""

from __future__ import annotations

import io
import math

import numpy as np
from flwr.app import Array, ArrayRecord
from flwr.common.constant import SType

from .core import Tensors
from .wire import WIRE_DTYPES, WireError, pack_pieces, unpack

__all__ = ["WIRE_DTYPES", "WireError", "record_arrays", "to_record", "to_tensors"]

_FORMAT = np.lib.format


def to_array(pieces: list[np.ndarray]) -> Array:
    """The ``Array`` of the 1-D pieces joined (``Array(np.concatenate(pieces))``), each piece copied once
    into the payload: its npy header, then the pieces' bytes."""
    dtype, count = pieces[0].dtype, sum(p.size for p in pieces)
    header = io.BytesIO()
    _FORMAT.write_array_header_1_0(header, {"descr": _FORMAT.dtype_to_descr(dtype), "fortran_order": False,
                                            "shape": (count,)})  # fmt: skip
    data = b"".join([header.getvalue(), *(memoryview(np.ascontiguousarray(p)).cast("B") for p in pieces)])
    return Array(dtype=str(dtype), shape=(count,), stype=SType.NUMPY, data=data)


def from_array(array: Array, name: str) -> np.ndarray:
    """The array an ``Array``'s payload holds (its own npy header, not the Array's metadata), as a read-only
    view of the payload: nothing copied. Raises ``WireError`` for a payload that is not a plain npy array."""
    data = array.data
    stream = io.BytesIO(data)
    try:
        version = _FORMAT.read_magic(stream)
        read_header = _FORMAT.read_array_header_1_0 if version == (1, 0) else _FORMAT.read_array_header_2_0
        shape, fortran_order, dtype = read_header(stream, max_header_size=10_000)
    except Exception as err:  # a payload that is not an npy array: say so, never raise anything else
        raise WireError(f"unreadable array {name}: {type(err).__name__}") from None
    if dtype.hasobject or fortran_order:
        raise WireError(f"array {name}: dtype {dtype}, fortran order {fortran_order}; expected plain C-order numbers")
    offset, count = stream.tell(), math.prod(shape)
    if len(data) - offset != count * dtype.itemsize:
        raise WireError(f"array {name}: {len(data) - offset:,} payload bytes, expected {count * dtype.itemsize:,}")
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)


def record_arrays(record: ArrayRecord) -> dict[str, np.ndarray]:
    """The record's arrays, each read from its payload (``from_array``)."""
    return {name: from_array(array, name) for name, array in record.items()}


def to_tensors(record: ArrayRecord, expected=None, transfer_dtype: str | None = None) -> Tensors:
    """The fp32 tensors a packed record stands for (``wire.unpack``: ``expected`` names and shapes and the
    ``transfer_dtype`` are checked when given)."""
    return unpack(record_arrays(record), expected, transfer_dtype)


def to_record(tensors: Tensors, transfer_dtype: str = "fp32") -> ArrayRecord:
    """``tensors`` packed into one record of a few arrays (lossless for values already rounded)."""
    return ArrayRecord({name: to_array(pieces) for name, pieces in pack_pieces(tensors, transfer_dtype).items()})
