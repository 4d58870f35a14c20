"""Conversions between Flower's ArrayRecord and the core's name->tensor dicts.

A record's tensors travel packed as ``wire.py`` says (one ``values`` array of the transfer dtype, its
``layout``, and int8's ``scales``); this module only adds Flower's records around those arrays, so
that the node worker, which never imports Flower, shares the encoding.
"""

from __future__ import annotations

from flwr.app import Array, ArrayRecord

from .core import Tensors
from .wire import WIRE_DTYPES, WireError, pack, unpack

__all__ = ["WIRE_DTYPES", "WireError", "record_arrays", "to_record", "to_tensors"]


def record_arrays(record: ArrayRecord) -> dict:
    """The record's arrays, each deserialised once (``Array.numpy()``: new memory, the payload's own
    dtype and shape, whatever its metadata declares). Raises ``WireError`` for one that is unreadable."""
    arrays = {}
    for name, array in record.items():
        try:
            arrays[name] = array.numpy()
        except Exception as err:  # a payload that is not a valid array: say so, never raise anything else
            raise WireError(f"unreadable array {name}: {type(err).__name__}") from None
    return arrays


def to_tensors(record: ArrayRecord, expected=None, transfer_dtype: str | None = None) -> Tensors:
    """The fp32 tensors a packed record stands for (``wire.unpack``: ``expected`` names and shapes and the
    ``transfer_dtype`` are checked when given)."""
    return unpack(record_arrays(record), expected, transfer_dtype)


def to_record(tensors: Tensors, transfer_dtype: str = "fp32") -> ArrayRecord:
    """``tensors`` packed into one record of a few arrays (lossless for values already rounded)."""
    return ArrayRecord({name: Array(array) for name, array in pack(tensors, transfer_dtype).items()})
