"""Differential privacy of a round's updates (docs/privacy.md), as arithmetic: each client's update clipped to
an L2 norm, and Gaussian noise of a seeded generator, on the mean (central) or on each update (local).

Every copy of ``x`` takes the server's noisy step as it takes any step (``apply_step``), so ParaBlock's
correction, which replays ``g^{r-1}``, stays exact; the plain-PyTorch reference calls these same functions.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

import torch

from .algorithm import Tensors


def l2_norm(update: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of a whole block's update (every tensor of it as one vector), in float64 and in sorted name
    order: the same bits whatever order a copy holds the tensors in."""
    if not update:
        return 0.0
    norms = [torch.linalg.vector_norm(update[n].detach(), dtype=torch.float64) for n in sorted(update)]
    return float(torch.linalg.vector_norm(torch.stack([n.cpu() for n in norms])))


def clip_scale(update: Mapping[str, torch.Tensor], max_norm: float) -> float | None:
    """``C / ‖Δ‖`` where the update lies outside the ball of radius ``max_norm``; None inside it, or where the
    norm is not finite (the reply's checks refuse such an update)."""
    norm = l2_norm(update)
    if not norm > max_norm or not math.isfinite(norm):
        return None
    return max_norm / norm


def clip(update: Tensors, max_norm: float) -> tuple[Tensors, bool]:
    """``Δ · min(1, C / ‖Δ‖)``: the update scaled onto the ball of radius ``max_norm`` (the same tensors when it
    is inside); second, whether it was scaled. The server's one pass scales each chunk as this does
    (``applied_mean_step``'s ``clip_scales``)."""
    scale = clip_scale(update, max_norm)
    if scale is None:
        return update, False
    return {n: t * scale for n, t in update.items()}, True


def noise_seed(secret: int, server_round: int, partition_id: int = -1) -> int:
    """The seed of round r's noise: on the server (``partition_id = -1``) or on one client. A hash, so that
    knowing one round's seed says nothing of another's."""
    text = f"parablock-dp:{secret}:{server_round}:{partition_id}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


def gaussian(like: Mapping[str, torch.Tensor], seed: int) -> Tensors:
    """Standard normal fp32 noise shaped as ``like``, drawn in sorted name order from a CPU generator seeded
    by ``seed``: the same bits on every machine (a CUDA generator's draws differ from the CPU's)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return {n: torch.randn(like[n].shape, generator=generator, dtype=torch.float32) for n in sorted(like)}


@torch.no_grad()
def add_noise(values: Tensors, noise: Mapping[str, torch.Tensor], std: float) -> Tensors:
    """In place: ``v += std · z`` (one float op per tensor, the same on every copy); returns ``values``."""
    for n, t in values.items():
        t.add_(noise[n].to(device=t.device), alpha=std)
    return values
