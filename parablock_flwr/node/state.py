"""What a node keeps between rounds (``NodeState``), and the part of it that must outlive its process
(``ResidualStore``: the error-feedback residuals of ``transfer-dtype``).

A node's state is its own pending update (ParaBlock's ``Δ_i^r`` on ``x^{r-1}``), its residuals by block,
and the last round it finished. The pending update needs no disk: a resumed server hands it back from
its checkpoint. The residuals do: the server never sees them, yet round R+1 sends
``round(Δ + e)``, so a resume that starts them empty diverges from the uninterrupted run.

``ResidualStore`` is a folder per node (simulation: ``RUN_DIR/node-state/partition-P``; deployment: the
worker's ``--state-dir``, else ``SOCKET.state``, then ``partition-P``). Each round that rounds an update
writes the new residual of its block as ``r{round}-b{block}.safetensors`` (fsync of the file, rename, fsync of
the folder; an update rounded ahead of its message has its residual's bytes written and fsynced then, under a
staged name, and its round does the rename; a staged file is gone by the first store write after its own
ended); a full sync writes ``r{round}-reset``. The residuals *as of* round R are, per block, the newest file
at or before R and after the newest reset at or before R: a node that already answered R+1 (or R+2) when the
server died still resumes from R's. A few rounds back are kept, plus each block's newest older file: the
folder holds at most ``blocks + KEEP_ROUNDS`` files, besides those staged since its last write.

``PendingStore`` keeps a virtual node's pending update in the same folder between its rounds, in the
simulation only: one Ray actor serves many virtual nodes, and an update held in memory for each of them
(``context.state``, which Flower keeps in its own process for every node) makes the run's memory grow
with the number of clients. On disk it is one file per node, ``pending.safetensors``, in the dtype it
travelled in (int8 and its scales: a quarter of fp32), read back bit for bit by whichever actor serves
the node next.
"""

from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ..core import EncodedTensors, PendingUpdate, Tensors
from ..durable import fsync_path, make_dirs, replace_file
from ..tensor_file import write_tensors
from ..wire import pack_pieces, round_and_pack, unpack

KEEP_ROUNDS = 4  # a checkpoint is at most 2 rounds behind what a node answered: room to spare
_FILE = re.compile(r"r(\d+)-(b(\d+)\.safetensors|reset)$")
_STAGED = re.compile(r"\.r\d+-b\d+\.safetensors\.[0-9a-f]+\.early\.tmp$")  # ``staged_name``'s


@dataclass
class NodeState:
    """One node's state between two of its rounds (the node runtime, ``node.Node``, changes it)."""

    # Simulation keeps its last round in Flower's ``context.state`` (``client_apps/inline.py``), here.
    CONTEXT_RECORD: ClassVar[str] = "node-state"
    LAST_ROUND: ClassVar[str] = "last-round"

    pending: PendingUpdate | None = None  # its own update not yet in the global model
    residuals: dict[int, Tensors] = field(default_factory=dict)  # transfer-dtype's error feedback, by block
    last_round: int = 0  # the last round it answered (0: none yet in this run)


class ResidualStore:
    """A node's residuals by round, written durably; read back as of any recent round."""

    def __init__(self, folder: Path | str):
        self.dir = Path(folder)

    def _entries(self) -> list[tuple[int, int | None, Path]]:
        """(round, block or None for a reset, path), oldest first."""
        if not self.dir.is_dir():
            return []
        out = []
        for path in self.dir.iterdir():
            if m := _FILE.match(path.name):
                out.append((int(m[1]), int(m[3]) if m[3] is not None else None, path))
        return sorted(out, key=lambda e: (e[0], -1 if e[1] is None else e[1]))

    def _write(self, name: str, tensors: Tensors | None) -> None:
        make_dirs(self.dir, 0o700)  # the node's own, as its socket; each new folder's parent fsynced
        final, tmp = self.dir / name, self.dir / f".{name}.tmp"
        _write_durably(tmp, tensors)
        os.replace(tmp, final)
        fsync_path(self.dir)

    def save(self, server_round: int, block: int, residual: Tensors) -> None:
        """Block ``block``'s residual after round ``server_round``."""
        self._write(_residual_name(server_round, block), residual)
        self._prune(server_round)

    def staged_name(self, server_round: int, block: int) -> Path:
        """A fresh name for ``stage``, unique: two stagings never write one file."""
        return self.dir / f".{_residual_name(server_round, block)}.{uuid.uuid4().hex}.early.tmp"

    def stage(self, path: Path, residual: Tensors) -> None:
        """``save``'s write (the bytes, fsynced) at ``path`` (``staged_name``: a name no reader takes), before
        the round is answered; ``commit`` makes it the round's with a rename. A node whose update was rounded
        ahead of its message writes its residual then, beside the upload, so that its reply waits for no
        block-sized write. One never committed is removed by the first store write after it ended (``_prune``)."""
        make_dirs(self.dir, 0o700)
        _write_durably(path, residual)

    def commit(self, path: Path, server_round: int, block: int) -> None:
        """The residual staged at ``path`` becomes block ``block``'s after round ``server_round`` (``save``'s
        outcome)."""
        os.replace(path, self.dir / _residual_name(server_round, block))
        fsync_path(self.dir)
        self._prune(server_round)

    def reset(self, server_round: int) -> None:
        """A full sync in round ``server_round`` dropped every residual."""
        self._write(f"r{server_round:05d}-reset", None)
        self._prune(server_round)

    def as_of(self, server_round: int, only: int | None = None) -> dict[int, Tensors]:
        """Each block's residual as it was after round ``server_round`` (``only``: that block's alone,
        the others not read)."""
        newest: dict[int, Path] = {}
        for rnd, block, path in self._entries():
            if rnd > server_round:
                break
            if block is None:
                newest.clear()
            else:
                newest[block] = path
        return {block: load_file(str(path)) for block, path in newest.items() if only in (None, block)}

    def restart_at(self, server_round: int, residuals: dict[int, Tensors]) -> None:
        """This store now holds exactly ``residuals`` as of round ``server_round`` (a resumed run's start)."""
        self.clear()
        self.reset(server_round)
        for block, residual in sorted(residuals.items()):
            self.save(server_round, block, residual)

    def clear(self) -> None:
        """Remove this store's own files (and a write's leftover temporary), never the folder nor anything
        else in it: whatever a path names, the node removes nothing it did not write."""
        if not self.dir.is_dir():
            return
        for path in self.dir.iterdir():
            name = path.name.removeprefix(".").removesuffix(".tmp")
            if (_FILE.match(name) or _STAGED.match(path.name)) and path.is_file() and not path.is_symlink():
                path.unlink()
        fsync_path(self.dir)

    def begin(self, run_id: int) -> None:
        """Mark this store as run ``run_id``'s (durably): a node restarted later in the same run goes on
        from its newest residuals instead of starting the run again. An earlier run's mark is removed."""
        self._write(f"run-{run_id}", None)
        for path in self.dir.glob("run-*"):
            if path.name != f"run-{run_id}" and path.is_file() and not path.is_symlink():
                path.unlink()

    def begun(self, run_id: int) -> bool:
        """Whether run ``run_id`` has already started on this store (this node is a restarted process)."""
        return (self.dir / f"run-{run_id}").is_file()

    def _prune(self, newest_round: int) -> None:
        """Drop what no ``as_of(R)`` for ``R >= newest_round - KEEP_ROUNDS`` reads, and every staged residual
        left (its round took another, or failed): the store writes one round at a time, and a staging starts
        only after the round before it was answered, so none of them is still to be committed."""
        horizon = newest_round - KEEP_ROUNDS
        old = [e for e in self._entries() if e[0] <= horizon]
        keep: dict[int | None, Path] = {}
        for _, block, path in old:  # oldest first: the last one seen of each kind wins
            if block is None:
                keep = {None: path}  # a reset supersedes everything before it
            else:
                keep[block] = path
        for _, _, path in old:
            if path not in keep.values():
                path.unlink(missing_ok=True)
        for path in self.dir.iterdir():
            if _STAGED.match(path.name):
                path.unlink(missing_ok=True)


def _residual_name(server_round: int, block: int) -> str:
    return f"r{server_round:05d}-b{block}.safetensors"


def _write_durably(path: Path, tensors: Tensors | None) -> None:
    """``tensors`` (None: an empty file) written to ``path`` and fsynced, past the page cache (``write_tensors``:
    a block's residual in fp32, every round)."""
    if tensors is not None:
        write_tensors(path, tensors)
        return
    path.write_bytes(b"")
    with open(path, "rb") as f:
        os.fsync(f.fileno())


class PendingStore:
    """A virtual node's pending update between its rounds, durably in one file (see the module's docstring)."""

    NAME = "pending.safetensors"
    # The file's metadata (a file format of the node's own, not a message): its keys are named here.
    BLOCK, BASE_VERSION = "block", "base-version"

    def __init__(self, folder: Path | str):
        self.path = Path(folder) / self.NAME

    def save(self, pending: PendingUpdate | None, transfer_dtype: str) -> None:
        """Keep ``pending`` (None: remove it), in ``transfer_dtype`` where that holds its values exactly (a
        sent update: ParaBlock keeps what it sent), else in fp32 (the ``correction = "none"`` ablation's
        offset, a sum of several)."""
        if pending is None:
            if self.path.exists():
                self.path.unlink()
                fsync_path(self.path.parent)
            return
        delta = pending.delta
        if isinstance(delta, EncodedTensors) and delta.travels_as(transfer_dtype):
            pieces = pack_pieces(delta, transfer_dtype)  # kept as it was sent: packed from its encoding, as it is
        else:
            rounded, pieces = round_and_pack(delta, transfer_dtype)
            if any(not torch.equal(rounded[n], t) for n, t in delta.items()):
                pieces = pack_pieces(delta, "fp32")
        arrays = {name: torch.from_numpy(np.concatenate(parts)) for name, parts in pieces.items()}
        meta = {self.BLOCK: str(pending.block), self.BASE_VERSION: str(pending.base_version)}
        make_dirs(self.path.parent, 0o700)  # the node's own; each new folder's parent fsynced
        replace_file(self.path, lambda tmp: write_tensors(tmp, arrays, meta))

    def load(self) -> PendingUpdate | None:
        """The pending update last saved, as fp32 tensors (None: none kept)."""
        if not self.path.exists():
            return None
        with safe_open(str(self.path), framework="numpy") as f:
            meta = f.metadata()
            arrays = {name: f.get_tensor(name) for name in f.keys()}
        return PendingUpdate(int(meta[self.BLOCK]), int(meta[self.BASE_VERSION]), unpack(arrays))
