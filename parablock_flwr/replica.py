"""A process's copy of the global model, and the server's log of global steps.

A copy of ``x`` only moves by replaying global steps ``g^k`` with the same
float operation the server used, so every copy stays bit-identical to the
server's ``x^k``. The steps come with the messages: ``g^{r-1}`` in every
round-r message, plus the steps a node missed (``catch-up``), or the current
values of every block when it missed more steps than there are blocks. In
simulation one Ray actor serves many virtual nodes, so an actor's copy can
be behind the node it serves: it replays the rest from the server's step
log in the run folder (written before round k+1 is sent).
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
FetchStep = Callable[[int], Step]  # version k -> (b_k, g^k)


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
    """The global model ``x^version``, moved forward only by replaying global steps.

    It also keeps the values the last step overwrote, so that ``x^{version-1}``
    (what a ParaBlock client computes from) can be shown again exactly when
    another node served by this process has already moved the copy on.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.params = dict(model.named_parameters())
        self.version = 0
        self._before_last_step: Tensors = {}

    def advance_to(self, version: int, fetch_step: FetchStep) -> None:
        """Apply ``g^{v+1}..g^{version}``; asking for an older version is a no-op."""
        while self.version < version:
            _, step = fetch_step(self.version + 1)
            self._before_last_step = {n: self.params[n].detach().clone() for n in step}
            apply_step(self.params, step)
            self.version += 1

    def reset_to(self, version: int, values: Tensors) -> None:
        """Become ``x^version`` from the exact values of every trainable tensor (a full resync)."""
        with torch.no_grad():
            for n, t in values.items():
                self.params[n].copy_(t.to(device=self.params[n].device, dtype=self.params[n].dtype))
        self.version, self._before_last_step = version, {}

    @contextlib.contextmanager
    def local_model(
        self, version: int, pending: PendingUpdate | None, train_names: tuple[str, ...]
    ) -> Iterator[nn.Module]:
        """Yield the model as ``x^version + Δ_pending``; restore ``x`` exactly afterwards.

        ``version`` is this copy's version or the one before it. Only the
        pending block, the block about to be trained and (for the version
        before) the last step's block can change, so only they are saved and
        copied back.
        """
        back = {}
        if version == self.version - 1 and self._before_last_step:
            back = self._before_last_step
        elif version != self.version:
            raise RuntimeError(
                f"this process's model is at global version {self.version}, a computation needs version {version}"
            )
        touched = set(train_names) | (set(pending.delta) if pending else set()) | set(back)
        saved = {n: self.params[n].detach().clone() for n in touched}
        try:
            with torch.no_grad():
                for n, t in back.items():
                    self.params[n].copy_(t)
            if pending is not None:
                apply_step(self.params, pending.delta)
            yield self.model
        finally:
            with torch.no_grad():
                for n, t in saved.items():
                    self.params[n].copy_(t)


def catch_up_steps(round_cfg, arrays: dict[str, torch.Tensor]) -> dict[int, Step]:
    """The global steps a round-r message carries: ``g^{r-1}`` and any missed ones.

    ``arrays`` are the message's ``global-step`` tensors; missed steps come in
    ``catch-up`` tensors named ``v{k}/{param}`` (``FedBCD.catch_up``).
    """
    server_round = int(round_cfg["server-round"])
    steps: dict[int, Step] = {}
    if server_round > 1:
        steps[server_round - 1] = (int(round_cfg["step-block"]), arrays["global-step"])
    for version, block in zip(round_cfg.get("catch-up-versions", []), round_cfg.get("catch-up-blocks", [])):
        prefix = f"v{version}/"
        steps[int(version)] = (
            int(block),
            {n[len(prefix) :]: t for n, t in arrays["catch-up"].items() if n.startswith(prefix)},
        )
    return steps


def resumed_pending(round_cfg, arrays: dict[str, Tensors]) -> PendingUpdate | None:
    """The client's own ``Δ_i^R`` that a resumed server hands back in round R+1 (``resume-pending``).

    After a server restart the client processes are new: the server's checkpoint
    is the only copy of the update each client would compute round R+1 from.
    """
    if "resume-pending" not in arrays:
        return None
    return PendingUpdate(
        block=int(round_cfg["resume-pending-block"]),
        base_version=int(round_cfg["resume-pending-version"]),
        delta=arrays["resume-pending"],
    )
