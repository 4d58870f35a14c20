"""Flower's ``Array`` payloads are ``.npy`` bytes (what ``Array(ndarray)`` writes and ``Array.numpy()``
reads); this module reads and writes them without copying the values.

numpy only, no torch and no Flower: the ClientApp relay, which must start in about a second, and
``records.py`` share it. ``Array.numpy()`` copies a payload into a new array, and ``Array(ndarray)``
copies an array through a ``BytesIO``: each copy costs a pass over the block's memory and adds the
block's size to the process's peak memory.
"""

from __future__ import annotations

import io
import math

import numpy as np

_FORMAT = np.lib.format
MAX_HEADER = 10_000  # an npy header's dict, at most (numpy's own default bound)
HEAD_BYTES = 12 + MAX_HEADER  # magic, version and header length (format 2.0: 12 bytes), then the header


class NpyError(ValueError):
    """A payload that is not a plain npy array; the message is one line naming it."""


def npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """The npy header (format 1.0) that ``np.save`` writes before a C-order array of ``dtype`` and ``shape``."""
    header = io.BytesIO()
    _FORMAT.write_array_header_1_0(header, {"descr": _FORMAT.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
                                            "shape": tuple(shape)})  # fmt: skip
    return header.getvalue()


def npy_view(data: bytes, name: str) -> np.ndarray:
    """The array an npy payload holds (its own header, not what anything else declares about it), as a
    read-only view of ``data``: nothing copied. Raises ``NpyError`` for a payload that is not a plain
    C-order npy array of numbers, or whose length is not what its header says."""
    data = memoryview(data).cast("B")
    stream = io.BytesIO(data[:HEAD_BYTES].tobytes())  # the header only: a payload is never copied
    try:
        version = _FORMAT.read_magic(stream)
        read_header = _FORMAT.read_array_header_1_0 if version == (1, 0) else _FORMAT.read_array_header_2_0
        shape, fortran_order, dtype = read_header(stream, max_header_size=MAX_HEADER)
    except Exception as err:  # a payload that is not an npy array: say so, never raise anything else
        raise NpyError(f"unreadable array {name}: {type(err).__name__}") from None
    if dtype.hasobject or fortran_order:
        raise NpyError(f"array {name}: dtype {dtype}, fortran order {fortran_order}; expected plain C-order numbers")
    offset, count = stream.tell(), math.prod(shape)
    if data.nbytes - offset != count * dtype.itemsize:
        raise NpyError(f"array {name}: {data.nbytes - offset:,} payload bytes, expected {count * dtype.itemsize:,}")
    return np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(shape)
