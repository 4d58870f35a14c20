"""What a node keeps between rounds (``NodeState``), and the part of it that must outlive its process
(``ResidualStore``: the error-feedback residuals of ``transfer-dtype``).

A node's state is its own pending update (ParaBlock's ``Δ_i^r`` on ``x^{r-1}``), its residuals by block,
and the last round it finished. The pending update needs no disk: a resumed server hands it back from
its checkpoint. The residuals do: the server never sees them, yet round R+1 sends
``round(Δ + e)``, so a resume that starts them empty diverges from the uninterrupted run.

``ResidualStore`` is a folder per node (simulation: ``RUN_DIR/node-state/partition-P``; deployment: the
node config's ``state-dir``, else ``SOCKET.state``, then ``partition-P``). Each round that rounds an
update writes the new residual of its block as ``r{round}-b{block}.safetensors`` (fsync of the file,
rename, fsync of the folder); a full sync writes ``r{round}-reset``. The residuals *as of* round R are,
per block, the newest file at or before R and after the newest reset at or before R: a node that already
answered R+1 (or R+2) when the server died still resumes from R's. A few rounds back are kept, plus
each block's newest older file: the folder holds at most ``blocks + KEEP_ROUNDS`` files.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from safetensors.torch import load_file, save_file

from .core import PendingUpdate, Tensors
from .durable import fsync_path

KEEP_ROUNDS = 4  # a checkpoint is at most 2 rounds behind what a node answered: room to spare
_FILE = re.compile(r"r(\d+)-(b(\d+)\.safetensors|reset)$")


@dataclass
class NodeState:
    """One node's state between two of its rounds (the node runtime, ``node.Node``, changes it)."""

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
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # the node's own, as its socket
        final, tmp = self.dir / name, self.dir / f".{name}.tmp"
        if tensors is None:
            tmp.write_bytes(b"")
        else:
            save_file({n: t.detach().cpu().contiguous() for n, t in tensors.items()}, str(tmp))
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        fsync_path(self.dir)

    def save(self, server_round: int, block: int, residual: Tensors) -> None:
        """Block ``block``'s residual after round ``server_round``."""
        self._write(f"r{server_round:05d}-b{block}.safetensors", residual)
        self._prune(server_round)

    def reset(self, server_round: int) -> None:
        """A full sync in round ``server_round`` dropped every residual."""
        self._write(f"r{server_round:05d}-reset", None)
        self._prune(server_round)

    def as_of(self, server_round: int) -> dict[int, Tensors]:
        """Each block's residual as it was after round ``server_round``."""
        newest: dict[int, Path] = {}
        for rnd, block, path in self._entries():
            if rnd > server_round:
                break
            if block is None:
                newest.clear()
            else:
                newest[block] = path
        return {block: load_file(str(path)) for block, path in newest.items()}

    def restart_at(self, server_round: int, residuals: dict[int, Tensors]) -> None:
        """This store now holds exactly ``residuals`` as of round ``server_round`` (a resumed run's start)."""
        self.clear()
        self.reset(server_round)
        for block, residual in sorted(residuals.items()):
            self.save(server_round, block, residual)

    def clear(self) -> None:
        if self.dir.is_dir():
            shutil.rmtree(self.dir)

    def begin(self, run_id: int) -> None:
        """Mark this store as run ``run_id``'s (durably): a node restarted later in the same run goes on
        from its newest residuals instead of starting the run again."""
        self._write(f"run-{run_id}", None)

    def begun(self, run_id: int) -> bool:
        """Whether run ``run_id`` has already started on this store (this node is a restarted process)."""
        return (self.dir / f"run-{run_id}").is_file()

    def _prune(self, newest_round: int) -> None:
        """Drop what no ``as_of(R)`` for ``R >= newest_round - KEEP_ROUNDS`` reads."""
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
