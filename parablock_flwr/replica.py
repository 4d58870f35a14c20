"""A process's copy of the global model, and the server's log of global steps.

In simulation one Ray actor serves many virtual nodes and a node's messages
may land on any actor, so each actor's copy of ``x`` can fall behind. It
catches up by replaying the global steps ``g^k`` it missed, read from the
server's step log in the run folder (written before round k+1 is sent),
with the same float operation the server used: every copy stays
bit-identical to the server's ``x^k``.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .core import PendingUpdate, Tensors, apply_step

Step = tuple[int, Tensors]  # (block, g)


class StepLog:
    """``global-steps/v{k}.safetensors``: the block and ``g^k`` of every round k."""

    def __init__(self, run_dir: Path | str):
        self.dir = Path(run_dir) / "global-steps"

    def write(self, version: int, block: int, step: Tensors) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.dir / f"v{version:05d}.safetensors"
        tmp = final.with_suffix(".tmp")
        tensors = {n: t.contiguous() for n, t in step.items()}
        save_file(tensors, str(tmp), metadata={"block": json.dumps(block), "version": str(version)})
        os.replace(tmp, final)  # readers never see a half-written step

    def read(self, version: int) -> Step:
        path = self.dir / f"v{version:05d}.safetensors"
        if not path.exists():
            raise FileNotFoundError(f"global step v{version} is missing from {self.dir}")
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            block = json.loads(f.metadata()["block"])
        return block, load_file(str(path))


class ModelReplica:
    """The global model ``x^version``, moved forward only by replaying global steps."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.params = dict(model.named_parameters())
        self.version = 0

    def advance_to(self, version: int, fetch_step: Callable[[int], Step]) -> None:
        """Apply ``g^{v+1}..g^{version}``. Going back is impossible and an error."""
        if version < self.version:
            raise RuntimeError(
                f"this process's model is at global version {self.version}, "
                f"a message needs version {version}: messages of an earlier round arrived late"
            )
        while self.version < version:
            _, step = fetch_step(self.version + 1)
            apply_step(self.params, step)
            self.version += 1

    @contextlib.contextmanager
    def local_model(self, pending: PendingUpdate | None, train_names: tuple[str, ...]) -> Iterator[nn.Module]:
        """Yield the model as ``x + Δ_pending``; restore ``x`` exactly afterwards.

        Only the pending block and the block about to be trained can change, so
        only they are saved and copied back.
        """
        touched = set(train_names) | (set(pending.delta) if pending else set())
        saved = {n: self.params[n].detach().clone() for n in touched}
        try:
            if pending is not None:
                apply_step(self.params, pending.delta)
            yield self.model
        finally:
            with torch.no_grad():
                for n, t in saved.items():
                    self.params[n].copy_(t)
