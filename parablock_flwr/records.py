"""Conversions between Flower's ArrayRecord and the core's name->tensor dicts.

The arrays themselves are encoded as ``wire.py`` says (fp32, fp16, or bf16 as int16
patterns); this module only adds Flower's records around them, so that the node worker,
which never imports Flower, shares the encoding.
"""

from __future__ import annotations

from flwr.app import Array, ArrayRecord

from .core import Tensors
from .wire import WIRE_DTYPES, decode, encode

__all__ = ["WIRE_DTYPES", "decode", "encode", "to_record", "to_tensors"]


def to_tensors(record: ArrayRecord) -> Tensors:
    """The record's arrays as tensors (``Array.numpy()`` deserialises into new memory: no copy needed)."""
    return {name: decode(array.numpy()) for name, array in record.items()}


def to_record(tensors: Tensors, transfer_dtype: str = "fp32") -> ArrayRecord:
    if transfer_dtype == "fp32":
        return ArrayRecord({name: t.detach().cpu().contiguous() for name, t in tensors.items()})
    return ArrayRecord({name: Array(encode(t, transfer_dtype)) for name, t in tensors.items()})
