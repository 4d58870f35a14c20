"""The one local-training loop, shared by ParaBlock and every baseline."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import get_scheduler

from .core import Tensors, delta, snapshot


@dataclass(frozen=True)
class TrainSettings:
    local_steps: int
    learning_rate: float
    weight_decay: float
    lr_schedule: str
    warmup_steps: int
    max_grad_norm: float
    precision: str


@dataclass
class TrainResult:
    delta: Tensors
    mean_loss: float
    started: float  # wall-clock (time.time) start and end: the deployment timeline uses them
    ended: float
    num_examples: int = 0  # the client's local dataset size, its aggregation weight

    @property
    def compute_s(self) -> float:
        return self.ended - self.started


def autocast(precision: str):
    """bf16 autocast on the model's device; updates stay fp32 (the weights are fp32)."""
    if precision == "bf16":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


BetweenSteps = Callable[[int, dict[str, torch.Tensor], Tensors], None]


def train_block(
    model: nn.Module,
    names: Iterable[str],
    batches: Iterable[dict[str, torch.Tensor]],
    settings: TrainSettings,
    between_steps: BetweenSteps | None = None,
) -> TrainResult:
    """Train only the named parameters for ``local_steps`` steps; return ``Δ``.

    A fresh AdamW over the block alone: the rest keeps ``requires_grad=False``
    so autograd stops at the lowest trainable layer and no optimizer state
    exists outside the block. The model's parameters are left *changed*
    (``y[b] += Δ``); the caller decides what to keep.

    ``between_steps(k, params, before)`` runs after step k < K, never inside
    a step: the node worker applies an aggregate that arrived mid-round there
    (``on-receipt``), shifting ``before`` so that ``Δ`` still counts only the
    optimizer's own changes.
    """
    started = time.time()
    params = dict(model.named_parameters())
    names = tuple(names)
    block = [params[n] for n in names]
    before = snapshot(params, names)
    for p in block:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(block, lr=settings.learning_rate, weight_decay=settings.weight_decay)
    scheduler = get_scheduler(
        settings.lr_schedule, optimizer, num_warmup_steps=settings.warmup_steps, num_training_steps=settings.local_steps
    )
    device = next(model.parameters()).device
    model.train()
    losses = []
    try:
        for _, batch in zip(range(settings.local_steps), batches):
            batch = {k: v.to(device) for k, v in batch.items()}
            with autocast(settings.precision):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(block, settings.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if between_steps is not None and len(losses) < settings.local_steps:
                with torch.no_grad():
                    between_steps(len(losses), params, before)
    finally:
        for p in block:
            p.requires_grad_(False)
        model.eval()
    if len(losses) != settings.local_steps:
        raise ValueError(f"local-steps={settings.local_steps}: only {len(losses)} batches were available")
    update = {n: t.cpu() for n, t in delta(params, before).items()}  # updates travel from host memory
    return TrainResult(update, sum(losses) / len(losses), started, time.time())
