"""A round's accepted updates on disk until they are combined, so that the server holds one at a time.

Replies arrive in any order and are checked as they come, but the float sum of the aggregate must run in
partition order to be deterministic: every accepted update waits until the round's last reply. Held in
memory, they make the server's memory grow with the number of sampled clients (a thousand of them,
a thousand blocks). Here each waits as the packed arrays it arrived in (``wire.py``: int8 and its scales
are a quarter of fp32), appended to one file,
``RUN_DIR/round-updates.bin``, emptied when a round starts and once it is combined; ``take`` reads one
back and decodes it exactly as the check did. It is scratch space: nothing reads it after the round, so
it is not fsynced (a restarted server re-runs the round).

The first ``IN_MEMORY`` updates of a round stay in memory instead: a deployment of a few sites never
writes and reads its blocks back between the round's last reply and its step (the critical path); only
a round of more clients than that, a simulation's, spills the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from ..core import Tensors
from ..wire import unpack

FILE = "round-updates.bin"
IN_MEMORY = 8  # updates a round holds in memory before it spills the rest


class UpdateSpill:
    """Packed updates by key (a node id), appended to one file and read back one at a time."""

    def __init__(self, run_dir: Path | str, in_memory: int = IN_MEMORY):
        self.path = Path(run_dir) / FILE
        self.in_memory = in_memory
        self._held: dict[int, Mapping[str, np.ndarray]] = {}  # key -> the packed arrays, in memory
        self._index: dict[int, list[tuple[str, np.dtype, int, int]]] = {}  # key -> (array, dtype, offset, count)

    def start(self) -> None:
        """A new round (or the round combined): drop what is kept."""
        self._held.clear()
        self._index.clear()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_bytes(b"")

    def put(self, key: int, arrays: Mapping[str, np.ndarray]) -> None:
        """Keep ``arrays`` (a packed record, already checked) for ``take``: in memory while the round holds
        fewer than ``in_memory``, else appended to the file."""
        if len(self._held) < self.in_memory:
            self._held[key] = arrays
            return
        entries = []
        with open(self.path, "ab") as f:
            for name, array in arrays.items():
                entries.append((name, array.dtype, f.tell(), array.size))
                f.write(memoryview(np.ascontiguousarray(array)).cast("B"))
        self._index[key] = entries

    def fingerprint(self, key: int) -> tuple | None:
        """``fingerprint`` of the arrays kept in memory under ``key`` (None: none, or in the file)."""
        held = self._held.get(key)
        return fingerprint(held) if held is not None else None

    def take(self, key: int, shapes: Mapping[str, tuple[int, ...]]) -> Tensors:
        """The tensors kept under ``key``, in ``shapes``' order, each decoded to fp32 when read (``wire.Decoded``:
        the aggregate reads the first update in chunks into its sum, decoding no block apart from it); the entry
        is forgotten."""
        if key in self._held:
            return unpack(self._held.pop(key), shapes, lazy=True)
        arrays = {
            name: np.fromfile(self.path, dtype=dtype, count=count, offset=offset)
            for name, dtype, offset, count in self._index.pop(key)
        }
        return unpack(arrays, shapes, lazy=True)


def fingerprint(arrays: Mapping[str, np.ndarray]) -> tuple:
    """Where each packed array's bytes lie: (name, address, size, dtype, shape, read-only). Two read-only updates
    with one fingerprint, both alive, read the same memory, so they hold the same values: an upload's payloads are
    read-only (bytes, or views of the kept memory it landed in), never written once they arrived (a buffer's
    address is taken again once it is free, by design in kept memory: the pass ahead holds what it read until it
    is compared). A pass run on one stands for the other (``FedBCD.pass_run_ahead``)."""
    return tuple(
        (name, array.__array_interface__["data"][0], array.nbytes, array.dtype.str, array.shape, array.flags.writeable)
        for name, array in arrays.items()
    )
