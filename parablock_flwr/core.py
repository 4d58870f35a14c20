"""ParaBlock's math, as defined by this project (see docs/algorithm.md).

This module is framework-free: no Flower here, only torch tensors keyed by
parameter name. Strategies and ClientApps are thin adapters around it.

Notation (as in the spec): global model ``x``, blocks ``B_1..B_M``, schedule
``b_1..b_R``, client update ``Δ_i^r``, aggregate ``Δ̄^r``, server learning rate
``η_s``. We call ``g^r = η_s Δ̄^r`` the *global step* of round r: the server
applies ``x^r[b_r] = x^{r-1}[b_r] + g^r`` and clients apply the very same
float operation, which is what keeps every copy of ``x`` bit-identical.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .config import NON_LAYER_MODES, SCHEDULES  # the choices live with the other settings (no torch there)

Tensors = dict[str, torch.Tensor]


# --------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockPartition:
    """The trainable parameters of a model, split into blocks.

    ``blocks[b]`` holds the parameter names of block ``b``; every parameter
    not in any block is frozen and never moves.
    """

    blocks: tuple[tuple[str, ...], ...]
    labels: tuple[str, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def names(self, block: int) -> tuple[str, ...]:
        return self.blocks[block]

    def all_names(self) -> tuple[str, ...]:
        return tuple(name for block in self.blocks for name in block)


def find_decoder_layers(model: nn.Module) -> str:
    """Return the qualified name of the model's list of decoder layers.

    Architectures keep their layers under different paths (``model.layers``,
    ``transformer.h``, ``gpt_neox.layers``, ``model.decoder.layers``...), so
    we look for the ``ModuleList`` whose length is the configured number of
    hidden layers instead of hard-coding paths.
    """
    num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    candidates = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) > 0
    ]
    if num_layers is not None:
        matching = [(n, m) for n, m in candidates if len(m) == num_layers]
        if matching:
            return matching[0][0]
    if not candidates:
        raise ValueError(
            f"cannot find decoder layers in {type(model).__name__}: expected an nn.ModuleList of decoder layers"
        )
    return max(candidates, key=lambda item: len(item[1]))[0]


def partition_blocks(
    model: nn.Module,
    layers_per_block: int,
    non_layer_params: str = "frozen",
    trainable: Callable[[str], bool] = lambda name: True,
) -> BlockPartition:
    """Split the model into blocks of ``layers_per_block`` consecutive layers.

    Parameters outside the decoder layers (embeddings, final norm, LM head)
    are frozen, or form one extra block when ``non_layer_params="block"``.
    Tied weights appear once (``named_parameters`` de-duplicates them).
    Only names for which ``trainable(name)`` holds enter a block: with LoRA,
    a block is the adapters of its layers and the base weights stay frozen.
    """
    if non_layer_params not in NON_LAYER_MODES:
        raise ValueError(f"non-layer-params={non_layer_params!r}: expected one of {NON_LAYER_MODES}")
    layers_name = find_decoder_layers(model)
    num_layers = len(model.get_submodule(layers_name))
    if not 1 <= layers_per_block <= num_layers:
        raise ValueError(
            f"layers-per-block={layers_per_block}: expected 1..{num_layers} (the model has {num_layers} decoder layers)"
        )
    prefix = layers_name + "."
    per_layer: list[list[str]] = [[] for _ in range(num_layers)]
    others: list[str] = []
    for name, _ in model.named_parameters():
        if not trainable(name):
            continue
        if name.startswith(prefix):
            per_layer[int(name[len(prefix) :].split(".", 1)[0])].append(name)
        else:
            others.append(name)
    blocks, labels = [], []
    for start in range(0, num_layers, layers_per_block):
        stop = min(start + layers_per_block, num_layers)
        blocks.append(tuple(n for layer in per_layer[start:stop] for n in layer))
        labels.append(f"layers {start}-{stop - 1}")
    if non_layer_params == "block" and others:
        blocks.append(tuple(others))
        labels.append("non-layer")
    for names, label in zip(blocks, labels):
        if not names:
            raise ValueError(f"block {label!r} of {type(model).__name__} has no trainable parameter")
    return BlockPartition(tuple(blocks), tuple(labels))


def one_block(partition: BlockPartition) -> BlockPartition:
    """All blocks merged into one: FedAvg is BCD whose only block is everything."""
    return BlockPartition((partition.all_names(),), ("all",))


# --------------------------------------------------------------------------
# Schedule
# --------------------------------------------------------------------------
def block_schedule(policy: str, num_blocks: int, num_rounds: int, seed: int) -> list[int]:
    """The block ``b_r`` of each round r = 1..R (list index r-1), seeded."""
    if policy not in SCHEDULES:
        raise ValueError(f"schedule={policy!r}: expected one of {SCHEDULES}")
    rng = random.Random(seed)
    if policy == "ascending":
        return [r % num_blocks for r in range(num_rounds)]
    if policy == "descending":
        return [num_blocks - 1 - r % num_blocks for r in range(num_rounds)]
    if policy == "uniform-random":
        return [rng.randrange(num_blocks) for _ in range(num_rounds)]
    schedule: list[int] = []  # random permutation per epoch over the blocks
    while len(schedule) < num_rounds:
        epoch = list(range(num_blocks))
        rng.shuffle(epoch)
        schedule.extend(epoch)
    return schedule[:num_rounds]


# --------------------------------------------------------------------------
# Updates, aggregation, global step
# --------------------------------------------------------------------------
def snapshot(params: Mapping[str, torch.Tensor], names: Iterable[str]) -> Tensors:
    """Detached fp32 copies of the named tensors."""
    return {n: params[n].detach().to(torch.float32).clone() for n in names}


def delta(after: Mapping[str, torch.Tensor], before: Mapping[str, torch.Tensor]) -> Tensors:
    """``Δ = after - before`` in fp32: the optimizer's changes to a block."""
    return {n: after[n].detach().float() - before[n] for n in before}


def aggregate(updates: Iterable[Tensors], weights: list[float]) -> Tensors:
    """``Δ̄ = Σ w_i Δ_i / Σ w_i``, computed as ``Σ (w_i / Σw) Δ_i`` in the given order.

    Normalising the weights first makes a single client's aggregate equal
    its update to the last bit (``1.0 * Δ == Δ``), which the tests rely on.
    ``updates`` may be a generator: only the running sum and the current
    update are held, however many clients there are.
    """
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"aggregate: weights sum to {total}, expected > 0")
    updates = iter(updates)
    out: Tensors = {}
    for i, w in enumerate(weights):
        update = next(updates, None)
        if update is None:
            raise ValueError(f"aggregate: got {i} updates and {len(weights)} weights")
        for n, t in update.items():
            if i == 0:
                out[n] = (w / total) * t
            else:
                out[n].add_(t, alpha=w / total)
    if next(updates, None) is not None:
        raise ValueError(f"aggregate: got more updates than the {len(weights)} weights")
    return out


def global_step(mean_update: Tensors, server_lr: float) -> Tensors:
    """``g = η_s Δ̄`` (exact when η_s = 1: ``Δ̄``'s own tensors, not a copy of the block)."""
    if server_lr == 1.0:
        return dict(mean_update)
    return {n: server_lr * t for n, t in mean_update.items()}


@torch.no_grad()
def apply_step(params: Mapping[str, torch.Tensor], step: Mapping[str, torch.Tensor]) -> None:
    """In place: ``x[b] += g`` (or ``y[b] += Δ``), the one float op every copy uses."""
    for n, t in step.items():
        params[n].add_(t.to(device=params[n].device, dtype=params[n].dtype))


@torch.no_grad()
def apply_step_keeping(params: Mapping[str, torch.Tensor], step: Mapping[str, torch.Tensor]) -> Tensors:
    """``apply_step``'s float op into new storage, which each tensor then takes (``.data``: the same
    tensor and parameter objects, so a model holding them sees the new values); returns the replaced
    tensors, ``x^{r-1}[b]``, uncopied. The server keeps them for a full sync; cloning them first was
    one more pass over the block between the last reply and the next message."""
    before: Tensors = {}
    for n, t in step.items():
        before[n] = params[n].detach()
        params[n].data = before[n] + t.to(device=before[n].device, dtype=before[n].dtype)
    return before


def digest(params: Mapping[str, torch.Tensor], names: Iterable[str]) -> str:
    """SHA-256 over the named tensors' bytes, in the given order (read in place: ``tobytes()`` would copy
    the whole model first, 0.7 s of the server's CPU each round for SmolLM2-135M)."""
    h = hashlib.sha256()
    for n in names:
        h.update(n.encode())
        h.update(_c_order_buffer(params[n]))
    return h.hexdigest()


def tensor_sha256(tensor: torch.Tensor) -> str:
    """SHA-256 of one tensor's bytes (read in place)."""
    return hashlib.sha256(_c_order_buffer(tensor)).hexdigest()


def _c_order_buffer(tensor: torch.Tensor):
    """The tensor's bytes in C order, as a C-contiguous array whose buffer hashlib reads as it is."""
    return tensor.detach().cpu().contiguous().numpy()


class ModelDigest:
    """The digest of ``x`` each checkpoint stores: SHA-256 over every named tensor's name and its own
    SHA-256, in order. Each tensor is hashed again only after a step changed it (``changed``), so a
    round's checkpoint hashes the round's block, not the model, whose bytes are many times a block's."""

    def __init__(self, names: Iterable[str]):
        self.names = tuple(names)
        self._hashes: dict[str, str] = {}

    def changed(self, names: Iterable[str]) -> None:
        """These tensors moved (a step was applied): hash them again next time."""
        for n in names:
            self._hashes.pop(n, None)

    def __call__(self, params: Mapping[str, torch.Tensor]) -> str:
        h = hashlib.sha256()
        for n in self.names:
            if n not in self._hashes:
                self._hashes[n] = tensor_sha256(params[n])
            h.update(n.encode())
            h.update(self._hashes[n].encode())
        return h.hexdigest()


def digest_after(params: Mapping[str, torch.Tensor], names: Iterable[str], *steps: Tensors) -> str:
    """Digest of ``params`` with ``steps`` added in order, ``params`` left unchanged.

    Both sides of the invariant check use it: the server on ``x^{r-1} + Δ_i^r``,
    the client on its local model, so both perform the same float additions.
    """
    names = tuple(names)
    view: dict[str, torch.Tensor] = {n: params[n] for n in names}
    for step in steps:
        for n, t in step.items():
            view[n] = view[n].detach() + t.to(device=view[n].device, dtype=view[n].dtype)
    return digest(view, names)


# --------------------------------------------------------------------------
# The client's local model: a global version plus its own pending update
# --------------------------------------------------------------------------
@dataclass
class PendingUpdate:
    """A ParaBlock client's own update not yet folded into the global model.

    The client's local model is ``y = x^{base_version}`` with
    ``y[block] += delta``. After the correction of round r,
    ``base_version = r - 1`` and ``delta = Δ_i^r``: the spec's invariant.
    """

    block: int
    base_version: int
    delta: Tensors


def parablock_base(pending: PendingUpdate | None, server_round: int) -> tuple[int, PendingUpdate | None]:
    """Which model round r's computation starts from.

    Normally ``y = x^{r-2} + Δ_i^{r-1}`` (the stale start that lets the
    client compute while round r-1's exchange is in flight). A client with
    no usable pending update (round 1, or it missed round r-1) is
    resynchronised: it starts from ``x^{r-1}`` with nothing pending, which
    is exactly a sequential-BCD round.
    """
    if pending is not None and pending.base_version == server_round - 2:
        return server_round - 2, pending
    return server_round - 1, None


@torch.no_grad()
def correct_in_place(params: Mapping[str, torch.Tensor], before: Tensors, step: Tensors, own_update: Tensors) -> None:
    """The ``on-receipt`` correction, applied to a model in the middle of training.

    ``y[b_{r-1}] += η_s Δ̄^{r-1} − Δ_i^{r-1}`` on the live parameters. If the
    block being trained is that block too, its ``before`` snapshot moves by the
    same amount so that ``Δ_i^r`` keeps counting only the optimizer's changes.
    Not bit-exact (float sums in another order): the deterministic mode corrects
    at the end instead (``strategies.ParaBlockClient.correct``).
    """
    for n, g in step.items():
        change = g - own_update[n]
        params[n].add_(change.to(device=params[n].device, dtype=params[n].dtype))
        if n in before:
            before[n].add_(change.to(before[n].device))


def uncorrected_offset(offset: Tensors, own_update: Tensors, steps: Iterable[Tensors]) -> Tensors:
    """``correction = "none"``: a client model that never takes in the aggregate, ``y = x^v + offset``,
    after its own update and written on a version ``len(steps)`` newer: ``offset + Δ_i − Σ g``."""
    out = dict(offset)
    for n, t in own_update.items():
        out[n] = out[n] + t if n in out else t.clone()
    for step in steps:
        for n, g in step.items():
            out[n] = out[n] - g if n in out else -g
    return out


# --------------------------------------------------------------------------
# Transfer precision: Δ_i and g travel rounded, every copy applies the rounded values
# --------------------------------------------------------------------------
# int8 is symmetric and blockwise: ``quantize_int8`` (one fp32 power-of-two scale per INT8_BLOCK values).
TRANSFER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}
INT8_BLOCK = 256  # int8: values per scale, within one tensor (its flattened values; the last block may be short)


def int8_blocks(numel: int) -> int:
    """How many scales a tensor of ``numel`` values travels with in int8."""
    return -(-numel // INT8_BLOCK)


def quantize_int8(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8, round to nearest: the flattened values in blocks of ``INT8_BLOCK``, each with
    the smallest power-of-two fp32 scale ``s >= max|v| / 127`` (0 for an all-zero block).

    Power-of-two scales make ``q * s`` exact and the rounding idempotent: quantising dequantised values
    gives back the same ``q`` and ``s`` (``max|q|`` is then in [64, 127], which picks the same ``s``), so
    the server can round ``g``, apply it, and encode it again for the wire without changing a bit.
    """
    # Few passes and fresh buffers over the block: the server quantises it on its critical path.
    # max|v| is max(max, -min), without |v|'s copy.
    flat = tensor.detach().reshape(-1).float()
    n = flat.numel()
    padded = int8_blocks(n) * INT8_BLOCK
    blocks = (flat if padded == n else torch.nn.functional.pad(flat, (0, padded - n))).view(-1, INT8_BLOCK)
    low, high = torch.aminmax(blocks, dim=1)
    bound = torch.maximum(high, -low) / 127
    mantissa, exponent = torch.frexp(bound)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)  # an exact power of two is its own scale
    scale = torch.pow(2.0, exponent.double()).float()  # exact in float64, then exactly representable
    scale = torch.where(bound > 0, scale, 0.0)
    scale = torch.where(bound.isfinite(), scale, bound)  # a non-finite block keeps its scale: it is refused
    divisor = torch.where(scale > 0, scale, 1.0)[:, None]
    q = torch.div(blocks, divisor).round_().clamp_(-127, 127).nan_to_num_(0.0).to(torch.int8)
    return q.view(-1)[:n], scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The flat fp32 values ``q * s`` (each exact: ``s`` is a power of two), written once into the
    result (the scales are broadcast over each block, not repeated into a block-sized copy)."""
    n = q.numel()
    full = n // INT8_BLOCK * INT8_BLOCK
    out = torch.empty(n, dtype=torch.float32, device=q.device)
    torch.mul(q[:full].view(-1, INT8_BLOCK), scale[: full // INT8_BLOCK, None], out=out[:full].view(-1, INT8_BLOCK))
    if full < n:  # the tensor's short last block
        torch.mul(q[full:], scale[full // INT8_BLOCK], out=out[full:])
    return out


def round_for_transfer(tensors: Tensors, transfer_dtype: str) -> Tensors:
    """The values as they will arrive, in fp32: exactly representable in ``transfer_dtype``.

    The server applies the rounded ``g`` it sends, so every copy of ``x`` stays identical.
    """
    if transfer_dtype == "fp32":
        return tensors
    if transfer_dtype == "int8":
        return {n: dequantize_int8(*quantize_int8(t)).view(t.shape) for n, t in tensors.items()}
    dtype = TRANSFER_DTYPES[transfer_dtype]
    return {n: t.to(dtype).to(torch.float32) for n, t in tensors.items()}


def round_with_feedback(update: Tensors, residual: Tensors | None, transfer_dtype: str) -> tuple[Tensors, Tensors]:
    """Error feedback: ``sent = round(Δ + e)``, ``e' = Δ + e − sent``.

    A client sends (and keeps as its pending update) exactly ``sent``, so the invariant
    ``y = x^{r-1} + sent`` stays bit-exact; what rounding dropped, ``e'``, is added to its
    next update of the same block instead of being lost.
    """
    corrected = {n: t + residual[n] for n, t in update.items()} if residual else update
    sent = round_for_transfer(corrected, transfer_dtype)
    return sent, {n: corrected[n] - sent[n] for n in corrected}


# --------------------------------------------------------------------------
# Time model
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class LinkModel:
    """A client's link and the framework's cost of one exchange: rates in Mbit/s, one-way latency in
    ms, the fixed cost of one exchange (``message_overhead_s``: delivery, process start, polls, the
    server's aggregation) and the rate at which the framework's processes move a message's bytes
    besides the link (``message_throughput_mbs``, MB/s; 0: not modeled): an exchange costs
    ``overhead + bytes / throughput`` besides the link. ``python -m benchmarks.time_model`` fits both
    to two runs of two message sizes."""

    uplink_mbps: float
    downlink_mbps: float
    latency_ms: float
    message_overhead_s: float = 0.0
    message_throughput_mbs: float = 0.0

    @classmethod
    def from_config(cls, cfg) -> LinkModel:
        """The time model of a ``config.RunConfig``."""
        return cls(cfg.uplink_mbps, cfg.downlink_mbps, cfg.latency_ms, cfg.message_overhead_s,
                   cfg.message_throughput_mbs)  # fmt: skip

    def comm_seconds(self, bytes_up: int, bytes_down: int) -> float:
        """Time from a reply leaving the client to the next message reaching it: the fixed cost, the
        framework's per-byte cost and the link's, added (on one host they share the same CPUs)."""
        throughput = self.message_throughput_mbs * 1e6
        framework = (bytes_up + bytes_down) / throughput if throughput else 0.0
        return (
            self.message_overhead_s
            + framework
            + 2 * self.latency_ms / 1e3
            + 8 * bytes_up / (self.uplink_mbps * 1e6)
            + 8 * bytes_down / (self.downlink_mbps * 1e6)
        )


def modeled_round_seconds(compute_s: list[float], comm_s: list[float], overlapped: bool) -> float:
    """Round time of the slowest client: compute + comm, or their max.

    ParaBlock hides the exchange of round r-1 behind the compute of round r,
    so an overlapped round costs ``max(compute, comm)``; sequential BCD
    waits for both, ``compute + comm``.
    """
    per_client = [max(c, m) if overlapped else c + m for c, m in zip(compute_s, comm_s)]
    return max(per_client, default=0.0)
