"""`parablock-flwr plan`: the memory a run needs, from the model's config alone (no weights).

The model is built on PyTorch's ``meta`` device (shapes, no storage), partitioned into blocks as a
run partitions it, and each term of what a node worker holds is computed from the parameter counts
and the run config:

- on the device: the weights (P x 2 bytes with ``weights = "bf16"``, else 4), the trained block in
  fp32 with its start snapshot, gradient and two AdamW moments (B x 20 bytes), the fp32 copies the
  replica saves of the blocks a round touches (``weights = "fp32"`` only: they are the device model's
  own tensors), the activations of one micro-batch from the block's first layer up, and the fp32
  logits with their log-softmax and gradient;
- in host memory: the fp32 master of ``x`` (``weights = "bf16"``: every trainable tensor), the
  replica's saved copies and the last step's overwritten values (bf16 weights), the pending update,
  the update being built and the update being sent (B x 4 bytes each), and the Python runtime;
- on the server: the model in fp32, every reply of a round and the step, the evaluation's logits, and
  the evaluator process (a second Python with torch) with its own replica of the model (on ``eval-device``);
- on the server's disk (the run folder): the step log, one fp32 step per round unless
  ``snapshot-every`` bounds it, and ParaBlock's pending updates for a resume.

On a CPU node the device is the host: its peak RSS is the sum of both columns (``cpu_total``),
which `benchmarks/memory_check.py` measures against. The figures are upper bounds of the steady state
(batches padded to ``max-seq-len``); loading adds, for a moment, the bf16 model in host memory
before it moves to the device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from . import core
from .config import RunConfig
from .strategies.update_spill import IN_MEMORY

GIB = 2**30
RUNTIME_BYTES = 560 * 2**20  # Python with torch, transformers and datasets imported (measured: 490-600 MiB)
CUDA_CONTEXT_BYTES = 600 * 2**20  # the CUDA context and allocator slack, outside max_memory_allocated
# What the CUDA libraries add to a GPU worker's RSS: the tests' tiny model peaked at 1,550 MiB on an
# H200 against the 560 MiB of RUNTIME_BYTES on a CPU (scripts/gpu-check.sh, 2026-12-01).
CUDA_HOST_BYTES = 1024 * 2**20
SERVER_RUNTIME_BYTES = 900 * 2**20  # the ServerApp process and the SuperLink beside it
EVALUATOR_RUNTIME_BYTES = 600 * 2**20  # the evaluator process, its model aside (measured: 596 MiB RSS, tiny model)


@dataclass(frozen=True)
class ModelShape:
    """What the memory terms need from a model: its parameters by block, its widths."""

    parameters: int  # P, every parameter (tied ones once)
    trainable: int  # T, the trainable parameters (every block)
    blocks: tuple[int, ...]  # B_b, parameters of each block
    first_layers: tuple[int, ...]  # the lowest decoder layer of each block (backward reaches down to it)
    num_layers: int
    hidden: int
    intermediate: int
    vocab: int


def model_config(spec: str):
    """``AutoConfig`` of a model folder, a ``config.json`` file, or an id/``embedded:`` name."""
    from transformers import AutoConfig

    path = Path(spec).expanduser()
    if path.is_file():
        return AutoConfig.from_pretrained(str(path.parent)) if path.name == "config.json" else _config_file(path)
    from .model import resolve_model

    return AutoConfig.from_pretrained(resolve_model(spec))


def _config_file(path: Path):
    from transformers import AutoConfig

    values = json.loads(path.read_text())
    return AutoConfig.for_model(values.pop("model_type"), **values)


def model_shape(cfg: RunConfig, config) -> ModelShape:
    """Build the model on the ``meta`` device (no memory), with LoRA when ``train = "lora"``, and
    partition it as a run does."""
    from transformers import AutoModelForCausalLM

    from .model import add_lora, is_lora_name

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        trainable = lambda name: True  # noqa: E731
        if cfg.trainable == "lora":
            model, trainable = add_lora(model, cfg), is_lora_name
    partition = core.partition_blocks(model, cfg.layers_per_block, cfg.non_layer_params, trainable)
    if cfg.one_block:
        partition = core.one_block(partition)
    params = dict(model.named_parameters())
    prefix = core.find_decoder_layers(model) + "."
    firsts = []
    for names in partition.blocks:
        layers = [int(n[len(prefix) :].split(".", 1)[0]) for n in names if n.startswith(prefix)]
        firsts.append(min(layers) if layers and len(layers) == len(names) else 0)  # non-layer: the embeddings
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return ModelShape(
        parameters=sum(p.numel() for p in params.values()),
        trainable=sum(params[n].numel() for n in partition.all_names()),
        blocks=tuple(sum(params[n].numel() for n in names) for names in partition.blocks),
        first_layers=tuple(firsts),
        num_layers=text.num_hidden_layers,
        hidden=text.hidden_size,
        intermediate=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
        vocab=text.vocab_size,
    )


def worker_terms(cfg: RunConfig, shape: ModelShape, block: int) -> dict[str, dict[str, int]]:
    """Bytes a node worker holds while it trains ``block`` (the pending update and the next exist):
    ``{"device": {...}, "host": {...}}``."""
    b = shape.blocks[block]
    largest = max(shape.blocks)
    bf16 = cfg.weights == "bf16"
    micro = cfg.micro_batch_size or cfg.batch_size
    tokens = micro * cfg.max_seq_len  # an upper bound: batches are padded to their longest row
    act_bytes = 2 if (bf16 or cfg.precision == "bf16") else 4  # bf16 autocast keeps matmul outputs in bf16
    layers_up = shape.num_layers - shape.first_layers[block]  # backward runs from the top down to the block
    per_layer = 8 * shape.hidden + 4 * shape.intermediate  # what a decoder layer keeps for backward, per token
    if cfg.gradient_checkpointing:  # each layer's input kept, one layer's activations at a time
        activations = tokens * (layers_up * shape.hidden + per_layer) * act_bytes
    else:
        activations = tokens * layers_up * per_layer * act_bytes
    # The blocks a round touches: the trained one, the pending update's and the last step's (ParaBlock).
    touched = min(b + 2 * largest, shape.trainable)
    logits = tokens * shape.vocab * 4 * 3  # logits, log-softmax, their gradient
    # Under bf16 autocast (bf16 weights imply it), torch caches a bf16 copy of each fp32 weight that
    # needs a gradient (the block's) for the forward pass.
    autocast_copy = b * 2 if (bf16 or cfg.precision == "bf16") else 0
    device = {
        "weights": (shape.parameters - b) * (2 if bf16 else 4) + b * 4,
        "block_training_state": b * 16,  # start snapshot, gradient, two AdamW moments (fp32)
        "saved_copies": 0 if bf16 else touched * 4 + largest * 4,  # the replica's, and the last step's
        "activations": activations,
        "logits_fp32_x3": logits,
        "autocast_block_copy": autocast_copy,
        # AdamW's multi-tensor step (CUDA's default) makes one fp32 temporary the size of the block
        # (the square roots of the second moments), after the backward's transients are freed: only
        # what it needs beyond them (measured on an H200: docs/deploy-8b.md, "Measured on a GPU").
        "adamw_step_beyond_backward": max(0, b * 4 - (activations + logits + autocast_copy)),
    }
    host = {
        "runtime": RUNTIME_BYTES,
        "master_of_x": shape.trainable * 4 if bf16 else 0,
        "saved_copies": touched * 4 + largest * 4 if bf16 else 0,
        "updates": largest * 4 * 3,  # pending, the one being built, the one being sent
    }
    return {"device": device, "host": host}


def transfer_bytes_per_value(transfer_dtype: str) -> float:
    """What ``transfer-dtype`` sends per value: its width, and int8's fp32 scale per block of values."""
    width = core.TRANSFER_DTYPES[transfer_dtype].itemsize
    return width + (4 / core.INT8_BLOCK if transfer_dtype == "int8" else 0)


def server_terms(cfg: RunConfig, shape: ModelShape, num_nodes: int) -> dict[str, int]:
    """Bytes the ServerApp holds: the model in fp32, a round's replies and step, evaluation."""
    largest = max(shape.blocks)
    terms = {
        "runtime": SERVER_RUNTIME_BYTES,
        "model_fp32": shape.parameters * 4,
        # The updates a round holds as they came (update_spill.IN_MEMORY; the rest spilled), one decoded
        # at a time, their mean, the step.
        "replies_and_step": min(num_nodes, IN_MEMORY) * round(largest * transfer_bytes_per_value(cfg.transfer_dtype))
        + largest * 4 * 3,
        # A round with a full sync (a resumed run's first round, a node back after missing more steps
        # than there are blocks): one copy of every trainable tensor, shared by its messages, until
        # the round's step.
        "full_sync": shape.trainable * 4,
        # The SuperLink (on this machine) holds each message until its node confirms it, each reply until
        # the ServerApp does: the round's step (one copy for every node), a full sync, N replies.
        "superlink_messages": round((num_nodes + 1) * largest * transfer_bytes_per_value(cfg.transfer_dtype))
        + shape.trainable * 4,
    }
    if cfg.evaluation == "server":
        tokens = cfg.eval_batch_size * cfg.max_seq_len
        terms["evaluation"] = tokens * shape.vocab * 4 * 2 + tokens * shape.hidden * 4 * 4
    if cfg.evaluation == "server" or cfg.save_every:  # the evaluator process and its replica of x (on eval-device)
        terms["evaluator_runtime"] = EVALUATOR_RUNTIME_BYTES
        terms["evaluator_replica"] = shape.parameters * 4
    return terms


def disk_terms(cfg: RunConfig, shape: ModelShape, num_nodes: int) -> dict[str, int]:
    """Bytes the run folder grows to by the last round: the step log (``replica.StepLog``: each round's
    step in fp32; with ``snapshot-every = N`` at most 3 snapshots of every trainable tensor and 2N
    steps, from a snapshot's write to the prune before the next round's messages; 2 snapshots
    between), and ParaBlock's pending updates (each sampled node's last update, staged as replies come
    and in the checkpoint: two copies while the newer replaces the older)."""
    step = max(shape.blocks) * 4
    terms = {"step_log": cfg.num_server_rounds * step}
    if cfg.snapshot_every:
        terms["step_log"] = min(terms["step_log"], 3 * shape.trainable * 4 + 2 * cfg.snapshot_every * step)
    if cfg.algorithm == "parablock":  # its server half stages them (Run.stage_pending)
        terms["pending_updates"] = 2 * num_nodes * step
    # A round's accepted updates wait for their sum as they came (strategies/update_spill.py).
    sent = round(max(shape.blocks) * transfer_bytes_per_value(cfg.transfer_dtype))
    terms["round_spill"] = max(0, num_nodes - IN_MEMORY) * sent
    # Simulation: each virtual node's state under RUN_DIR/node-state (deployment: on the node's own disk):
    # its pending update as sent, and (a rounding transfer-dtype) the fp32 residual of each block it trained.
    residuals = min(cfg.num_server_rounds, len(shape.blocks)) * step if cfg.transfer_dtype != "fp32" else 0
    terms["node_state_simulation"] = num_nodes * ((sent if cfg.algorithm == "parablock" else 0) + residuals)
    return terms


@dataclass(frozen=True)
class Plan:
    cfg: RunConfig
    shape: ModelShape
    device: dict[str, int]  # the worst block's terms (the largest sum)
    host: dict[str, int]
    server: dict[str, int]
    disk: dict[str, int]

    @property
    def device_total(self) -> int:
        """What a GPU must hold: the terms plus the CUDA context."""
        return sum(self.device.values()) + CUDA_CONTEXT_BYTES

    @property
    def host_total(self) -> int:
        """A GPU worker's RAM: the terms plus the CUDA libraries."""
        return sum(self.host.values()) + CUDA_HOST_BYTES

    @property
    def cpu_total(self) -> int:
        """A CPU node's peak RSS: device and host terms in one memory (no CUDA)."""
        return sum(self.device.values()) + sum(self.host.values())

    @property
    def server_total(self) -> int:
        return sum(self.server.values())

    @property
    def disk_total(self) -> int:
        return sum(self.disk.values())


def make_plan(cfg: RunConfig, shape: ModelShape, num_nodes: int = 3) -> Plan:
    per_block = [worker_terms(cfg, shape, b) for b in range(len(shape.blocks))]
    worst = max(per_block, key=lambda t: sum(t["device"].values()))
    return Plan(cfg, shape, worst["device"], worst["host"], server_terms(cfg, shape, num_nodes),
                disk_terms(cfg, shape, num_nodes))  # fmt: skip


def fitting_settings(cfg: RunConfig, shape_of, gpu_bytes: int, num_nodes: int = 3) -> list[Plan]:
    """The settings closest to ``cfg`` whose device total fits ``gpu_bytes``: first full-weight blocks,
    then LoRA blocks. Tried in order: bf16 weights, gradient checkpointing, smaller micro-batches,
    then fewer layers per block (largest first: fewer, larger blocks move more per round)."""
    found = []
    for train in ("full", "lora"):
        if cfg.algorithm.startswith("fedavg-") and train != cfg.trainable:
            continue
        for plan in _candidates(replace(cfg, train=train), shape_of, num_nodes):
            if plan.device_total <= gpu_bytes:
                found.append(plan)
                break
    return found


def _candidates(cfg: RunConfig, shape_of, num_nodes: int):
    weights = dict.fromkeys((cfg.weights, "bf16"))
    checkpointing = dict.fromkeys((cfg.gradient_checkpointing, True))
    start = cfg.micro_batch_size or cfg.batch_size
    micros = [m for m in range(start, 0, -1) if cfg.batch_size % m == 0]
    for lpb in range(cfg.layers_per_block, 0, -1):
        shape = shape_of(replace(cfg, layers_per_block=lpb))
        for w in weights:
            for gc in checkpointing:
                for m in micros:
                    c = replace(cfg, layers_per_block=lpb, weights=w, gradient_checkpointing=gc, micro_batch_size=m)
                    yield make_plan(c, shape, num_nodes)


def gib(n: int) -> str:
    return f"{n / GIB:,.1f}"


def render(plan: Plan, fits: list[Plan] | None, gpu_gb: float | None) -> str:
    """The table `parablock-flwr plan` prints."""
    cfg, shape = plan.cfg, plan.shape
    lines = [
        f"model: {cfg.model}  P={shape.parameters / 1e9:.3f} B parameters, {shape.num_layers} layers, "
        f"trainable T={shape.trainable / 1e9:.3f} B in {len(shape.blocks)} blocks (largest "
        f"B={max(shape.blocks) / 1e6:,.1f} M)",
        f"run config: train={cfg.trainable} weights={cfg.weights} precision={cfg.precision} "
        f"layers-per-block={cfg.layers_per_block} batch-size={cfg.batch_size} "
        f"micro-batch-size={cfg.micro_batch_size} max-seq-len={cfg.max_seq_len} "
        f"gradient-checkpointing={str(cfg.gradient_checkpointing).lower()}",
        "",
        "| memory | GiB | terms (GiB) |",
        "|---|---|---|",
        f"| per-site device (one worker, one GPU) | {gib(plan.device_total)} | "
        + ", ".join(f"{k} {gib(v)}" for k, v in plan.device.items())
        + f", cuda_context {gib(CUDA_CONTEXT_BYTES)} |",
        f"| per-site host (RAM, one worker) | {gib(plan.host_total)} | "
        + ", ".join(f"{k} {gib(v)}" for k, v in plan.host.items())
        + f", cuda_libraries {gib(CUDA_HOST_BYTES)} |",
        f"| a CPU-only node (device and host in RAM) | {gib(plan.cpu_total)} | |",
        f"| server (ServerApp) | {gib(plan.server_total)} | "
        + ", ".join(f"{k} {gib(v)}" for k, v in plan.server.items())
        + " |",
        f"| server disk (the run folder, {cfg.num_server_rounds} rounds) | {gib(plan.disk_total)} | "
        + ", ".join(f"{k} {gib(v)}" for k, v in plan.disk.items())
        + " |",
    ]
    if not cfg.snapshot_every and cfg.num_server_rounds > 2 * len(shape.blocks):
        every = len(shape.blocks)
        bounded = disk_terms(replace(cfg, snapshot_every=every), shape, 0)["step_log"]
        if bounded < plan.disk["step_log"]:
            lines.append(f"the step log grows by {gib(max(shape.blocks) * 4)} GiB a round: snapshot-every={every} "
                         f"bounds it at {gib(bounded)} GiB, whatever the number of rounds")  # fmt: skip
    if gpu_gb is not None:
        lines += ["", f"fits a {gpu_gb:g} GB GPU:"]
        if not fits:
            lines.append("  nothing: not even one layer per block with LoRA, micro-batch 1 and bf16 weights")
        for f in fits or []:
            c = f.cfg
            lines.append(
                f"  train={c.trainable} weights={c.weights} layers-per-block={c.layers_per_block} "
                f"micro-batch-size={c.micro_batch_size} gradient-checkpointing={str(c.gradient_checkpointing).lower()}"
                f"  -> device {gib(f.device_total)} GiB, host {gib(f.host_total)} GiB"
            )
    return "\n".join(lines)


def plan_command(model: str, overrides: dict, gpu_memory_gb: float | None, num_nodes: int) -> str:
    """`parablock-flwr plan MODEL [KEY=VALUE ...] [--gpu-memory-gb G]`: the table as text."""
    cfg = RunConfig.from_flower({**overrides, "model": model})
    config = model_config(model)
    shapes: dict[tuple, ModelShape] = {}

    def shape_of(c: RunConfig) -> ModelShape:
        key = (c.trainable, c.layers_per_block)
        if key not in shapes:
            shapes[key] = model_shape(c, config)
        return shapes[key]

    plan = make_plan(cfg, shape_of(cfg), num_nodes)
    fits = None
    if gpu_memory_gb is not None:
        fits = fitting_settings(cfg, shape_of, int(gpu_memory_gb * 1e9), num_nodes)
    return render(plan, fits, gpu_memory_gb)
