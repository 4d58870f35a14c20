"""The one local-training loop, shared by ParaBlock and every baseline."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

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
    micro_batch_size: int = 0  # > 0: each batch runs as micro-batches of this size (gradient accumulation)
    gradient_checkpointing: bool = False  # recompute activations in backward instead of keeping them
    schedule_steps: int = 0  # > 0: the schedule spans this many steps (the run's R x K) ...
    schedule_offset: int = 0  # ... and this round starts at step (r-1) x K of it


@dataclass
class TrainResult:
    delta: Tensors
    mean_loss: float
    started: float  # wall-clock (time.time) start and end: the deployment timeline uses them
    ended: float
    num_examples: int = 0  # the client's local dataset size, its aggregation weight
    truncated: int = 0  # examples of this round's batches cut at max-seq-len
    oom_retries: int = 0  # 1: the round ran again with half the micro-batch after running out of memory
    dp_clipped: int | None = None  # differential privacy, central mode: 1 if the update was clipped

    @property
    def compute_s(self) -> float:
        return self.ended - self.started


def autocast(precision: str, device: torch.device | None = None):
    """bf16 autocast on the model's device; updates stay fp32 (the weights are fp32)."""
    if precision == "bf16":
        device_type = device.type if device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
        return torch.autocast(device_type=device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def run_schedule(optimizer: torch.optim.Optimizer, settings: TrainSettings) -> torch.optim.lr_scheduler.LambdaLR:
    """``lr-schedule`` over this round's K steps, or (``schedule_steps``) over the whole run, from step
    ``schedule_offset``: warm-up and decay are not restarted every round."""
    # Imported here: transformers' optimization module imports its Trainer's utilities and, through them, peft,
    # seconds of CPU that a process evaluating only (the ServerApp, its evaluator) never needs.
    from transformers import get_scheduler

    total = settings.schedule_steps or settings.local_steps
    inner = get_scheduler(
        settings.lr_schedule, optimizer, num_warmup_steps=settings.warmup_steps, num_training_steps=total
    )
    if not settings.schedule_offset:
        return inner
    factor, offset = inner.lr_lambdas[0], settings.schedule_offset
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: factor(step + offset))


def micro_batches(batch: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    """The batch in slices of ``size`` rows (all of it when ``size`` is 0 or not smaller)."""
    rows = batch["input_ids"].shape[0]
    if not size or size >= rows:
        return [batch]
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, rows, size)]


def accumulated_loss(model: nn.Module, batch: dict[str, torch.Tensor], settings: TrainSettings, device) -> float:
    """Forward and backward of one batch, as micro-batches whose gradients add up to the batch's:
    each micro-batch's token losses are summed and divided by the whole batch's answer tokens (what
    the loss of the batch in one piece averages over). Returns the batch's loss."""
    pieces = micro_batches(batch, settings.micro_batch_size)
    if len(pieces) == 1:
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast(settings.precision, device):
            loss = model(**batch).loss
        loss.backward()
        return loss.item()
    tokens = int((batch["labels"][:, 1:] != -100).sum())  # the shifted labels the loss counts
    total = 0.0
    for piece in pieces:
        piece = {k: v.to(device) for k, v in piece.items()}
        with autocast(settings.precision, device):
            loss = model(**piece, num_items_in_batch=tokens).loss  # sum over the piece / the batch's tokens
        loss.backward()
        total += loss.item()
    return total


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
    scheduler = run_schedule(optimizer, settings)
    device = next(model.parameters()).device
    if settings.gradient_checkpointing and not getattr(model, "is_activation_checkpointing", False):
        # Non-reentrant: gradients reach the block even though the embeddings below it are frozen.
        # (newer transformers renamed gradient_checkpointing_enable, which warns at every call.)
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    losses = []
    try:
        for _, batch in zip(range(settings.local_steps), batches):
            loss = accumulated_loss(model, batch, settings, device)
            torch.nn.utils.clip_grad_norm_(block, settings.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss)
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
