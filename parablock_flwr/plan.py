"""`parablock-flwr plan`: the memory a run needs, from the model's config alone (no weights).

The model's parameter shapes come from its ``config.json`` by arithmetic for the decoders
``decoder_shapes`` knows (Llama, SmolLM2, Mistral, Qwen2, Qwen3), else from the model built on
PyTorch's ``meta`` device (shapes, no storage); they are partitioned into blocks as a run partitions
them, and each term of what a node worker holds is computed from the parameter counts and the run
config:

- on the device: the weights (P x 2 bytes with ``weights = "bf16"``, else 4), the trained block in
  fp32 with its start snapshot, gradient and two AdamW moments (B x 20 bytes), with ``weights = "fp32"``
  the new tensors of the blocks a computation changes (the model's own tensors are ``x``: they are set
  aside meanwhile, ``ModelReplica.local_model``), the activations of one micro-batch from the block's
  first layer up, and the fp32 logits with their log-softmax and gradient;
- in host memory: the fp32 master of ``x`` (``weights = "bf16"``: every trainable tensor, never written
  by a computation, so nothing is copied to restore it), every block's residual
  (a rounding ``transfer-dtype``: the whole trainable model in fp32), ParaBlock's pending update, the
  update as computed, rounded (with its new residual) and as it travels, the step as it came and
  decoded, and the Python runtime; a node rounds and sends an update once its block has trained, so a
  CPU node's peak counts the larger of the two, plus (running ahead) the bytes moving meanwhile
  (``cpu_total``);
- on the server: the model in fp32, every reply of a round and the step, the evaluation's logits, and
  the evaluator process (a second Python with torch) with its own replica of the model (on ``eval-device``);
- on the server's disk (the run folder): the step log, one fp32 step per round unless
  ``snapshot-every`` bounds it, and ParaBlock's pending updates for a resume.

On a CPU node the device is the host: its peak RSS is the sum of both columns (``cpu_total``),
which `benchmarks/deployed_memory.py` measures a deployed worker against. The figures are upper
bounds of the steady state (batches padded to ``max-seq-len``); loading adds, for a moment, the
bf16 model in host memory before it moves to the device.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace

from . import core
from .config import ConfigError, RunConfig
from .decoder_shapes import Shapes, decoder_shapes
from .durable import replace_file
from .paths import EMBEDDED, cache_dir
from .strategies import client_half
from .strategies.update_spill import IN_MEMORY
from .tools.app_config import check_overrides

GIB = 2**30
# Python with torch, transformers and datasets imported; the libraries' resident share depends on the
# page cache (more when their files were just written), so a process's RSS varies around this figure
# (docs/deployment.md, "Measured memory against the plan").
RUNTIME_BYTES = 560 * 2**20
CUDA_CONTEXT_BYTES = 600 * 2**20  # the CUDA context and allocator slack, outside max_memory_allocated
# What the CUDA libraries add to a GPU worker's RSS (docs/deployment.md, "Measured memory against the plan").
CUDA_HOST_BYTES = 1024 * 2**20
SERVER_RUNTIME_BYTES = 900 * 2**20  # the ServerApp process and the SuperLink beside it
EVALUATOR_RUNTIME_BYTES = 600 * 2**20  # the evaluator process, its model aside
# The run-config fields a model's partition (and so its ModelShape) depends on.
SHAPE_KEYS = ("trainable", "layers_per_block", "non_layer_params", "one_block", "lora_rank", "lora_target_modules")


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
    layer_params: int  # the trainable parameters of one decoder layer (the time model's unit of a block)
    dtype_bytes: int  # bytes per parameter of the checkpoint's dtype (its files' size, when not on disk)


def check_model_exists(spec: str) -> None:
    """A model named as a path (``/``, ``./``, ``~`` first, or more than one ``/``) must be on this disk: asking
    the hub for it would answer with the hub's error, or wait for a hub it cannot reach."""
    as_path = spec.startswith(("/", ".", "~")) or spec.count("/") > 1
    if as_path and not spec.startswith("embedded:") and not Path(spec).expanduser().exists():
        raise ConfigError(
            f"model={spec!r}: no such file or folder; expected a model folder, its config.json, "
            f"an embedded: name or a hub id (org/name)"
        )


def model_config(spec: str):
    """``AutoConfig`` of a model folder, a ``config.json`` file, or an id/``embedded:`` name."""
    from transformers import AutoConfig

    path = Path(spec).expanduser()
    if path.is_file():
        return AutoConfig.from_pretrained(str(path.parent)) if path.name == "config.json" else _config_file(path)
    from .model import resolve_model

    return AutoConfig.from_pretrained(resolve_model(spec))


def local_config_file(spec: str) -> Path | None:
    """The ``config.json`` that ``spec`` names on this disk without transformers' help (a file, a folder,
    an ``embedded:`` model converted before), or None (a hub id: ``model_config`` asks the hub cache)."""
    path = Path(spec).expanduser()
    if spec.startswith("embedded:") and spec.removeprefix("embedded:") in EMBEDDED:
        path = cache_dir() / spec.removeprefix("embedded:")
    if path.is_dir():
        path = path / "config.json"
    return path if path.is_file() else None


def shape_key(cfg: RunConfig, config_text: str) -> str:
    """What a model's shape depends on: its config, the run config's partition and LoRA keys, and the
    transformers version (which builds the model)."""
    from importlib.metadata import version

    parts = [config_text, version("transformers"), version("peft") if cfg.trainable == "lora" else ""]
    parts += [str(getattr(cfg, k)) for k in SHAPE_KEYS]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def config_values(spec: str) -> dict | None:
    """The values of the ``config.json`` that ``spec`` names on this disk, or None (not on this disk, or
    not a JSON object: transformers then reads it, and says what is wrong)."""
    file = local_config_file(spec)
    try:
        values = json.loads(file.read_text()) if file is not None else None
    except (OSError, ValueError):
        return None
    return values if isinstance(values, dict) else None


def shape_for(cfg: RunConfig, spec: str, config_of, values: dict | None) -> ModelShape:
    """The model's shape by arithmetic from its config's ``values`` when ``decoder_shapes`` knows the
    architecture (no transformers: the first plan of a model takes as long as the next), else built
    on the meta device and cached."""
    shape = arithmetic_shape(cfg, values) if values is not None else None
    return shape if shape is not None else cached_shape(cfg, spec, config_of)


def cached_shape(cfg: RunConfig, spec: str, config_of) -> ModelShape:
    """``model_shape``, kept on disk by ``shape_key``: building a model, even on the meta device, needs
    transformers' modeling code, whose import alone takes seconds. A cache file that cannot be read is
    rebuilt."""
    file = local_config_file(spec)
    if file is None:
        return model_shape(cfg, config_of())
    cached = cache_dir() / "plan-shapes" / f"{shape_key(cfg, file.read_text())}.json"
    try:
        values = json.loads(cached.read_text())
        return ModelShape(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
    except (OSError, ValueError, TypeError):
        pass
    shape = model_shape(cfg, config_of())
    try:
        replace_file(cached, json.dumps(asdict(shape)))
    except OSError:
        pass  # a read-only cache only costs the next plan its seconds
    return shape


def _config_file(path: Path):
    from transformers import AutoConfig

    values = json.loads(path.read_text())
    return AutoConfig.for_model(values.pop("model_type"), **values)


def model_shape(cfg: RunConfig, config) -> ModelShape:
    """Build the model on the ``meta`` device (no memory), with LoRA when ``train = "lora"``, and
    partition it as a run does."""
    import torch
    from transformers import AutoModelForCausalLM

    from .model import add_lora, is_lora_name

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
        trainable = lambda name: True  # noqa: E731
        if cfg.trainable == "lora":
            model, trainable = add_lora(model, cfg), is_lora_name
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    widths = {"num_layers": text.num_hidden_layers, "hidden": text.hidden_size,
              "intermediate": getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
              "vocab": text.vocab_size, "dtype_bytes": dtype_bytes(dtype)}  # fmt: skip
    return partitioned_shape(cfg, model, trainable, widths)


def arithmetic_shape(cfg: RunConfig, values: dict) -> ModelShape | None:
    """``model_shape`` from a ``config.json``'s values by arithmetic (``decoder_shapes``), without
    transformers; None for an architecture or a config it does not know."""
    found = decoder_module(json.dumps(values, sort_keys=True), cfg.trainable, cfg.lora_rank, cfg.lora_target_modules)
    if found is None:
        return None
    module, adapters = found
    trainable = adapters.__contains__ if cfg.trainable == "lora" else lambda name: True
    widths = {"num_layers": values["num_hidden_layers"], "hidden": values["hidden_size"],
              "intermediate": values["intermediate_size"], "vocab": values["vocab_size"],
              "dtype_bytes": dtype_bytes(values.get("dtype") or values.get("torch_dtype"))}  # fmt: skip
    return partitioned_shape(cfg, module, trainable, widths)


@functools.lru_cache(maxsize=4)
def decoder_module(config_json: str, train: str, lora_rank: int, lora_targets: str):
    """``meta_module`` of ``decoder_shapes`` and the names of its LoRA adapters, or None; kept for the
    other partitions the fits' search tries (building the module tree is most of a shape's time)."""
    values = json.loads(config_json)
    shapes = decoder_shapes(values, train, lora_rank, lora_targets)
    if shapes is None:
        return None
    adapters = frozenset(name for name, _ in shapes if ".lora_A." in name or ".lora_B." in name)
    return meta_module(shapes, values["num_hidden_layers"]), adapters


def dtype_bytes(dtype) -> int:
    """Bytes per parameter of a config's ``dtype`` (a torch dtype or its name; none: fp32)."""
    return 4 if str(dtype or "float32").endswith("float32") else 2


def meta_module(shapes: Shapes, num_layers: int):
    """A module tree holding meta tensors of these names and shapes and nothing else: what
    ``core.partition_blocks`` reads of a model (its layer list, its named parameters), so that the
    arithmetic's shapes are partitioned by the one partitioning a run uses."""
    import torch
    from torch import nn

    root = nn.Module()
    root.config = SimpleNamespace(num_hidden_layers=num_layers)
    for name, shape in shapes:
        *path, leaf = name.split(".")
        module = root
        for part, after in zip(path, path[1:] + [leaf]):
            child = getattr(module, part, None)
            if child is None:
                child = nn.ModuleList() if after.isdigit() else nn.Module()
                module.add_module(part, child)
            module = child
        module.register_parameter(leaf, nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False))
    return root


def partitioned_shape(cfg: RunConfig, model, trainable, widths: dict[str, int]) -> ModelShape:
    """The ``ModelShape`` of a (meta) model partitioned as a run partitions it; ``widths``: the
    config's layer count, hidden, intermediate and vocabulary sizes and checkpoint dtype width."""
    try:
        partition = core.partition_blocks(model, cfg.layers_per_block, cfg.non_layer_params, trainable)
    except ValueError as err:  # a key's value this model cannot take: a config error, as any other
        raise ConfigError(str(err)) from None
    if cfg.one_block:
        partition = core.one_block(partition)
    params = dict(model.named_parameters())
    prefix = core.find_decoder_layers(model) + "."
    firsts = []
    for names in partition.blocks:
        layers = [int(n[len(prefix) :].split(".", 1)[0]) for n in names if n.startswith(prefix)]
        firsts.append(min(layers) if layers and len(layers) == len(names) else 0)  # non-layer: the embeddings
    trained = set(partition.all_names())
    return ModelShape(
        parameters=sum(p.numel() for p in params.values()),
        trainable=sum(params[n].numel() for n in partition.all_names()),
        blocks=tuple(sum(params[n].numel() for n in names) for names in partition.blocks),
        first_layers=tuple(firsts),
        layer_params=sum(p.numel() for n, p in params.items() if n.startswith(prefix + "0.") and n in trained),
        **widths,
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
    # weights = "fp32": the computation's new tensors of the trained block and (running ahead) the pending update's
    # block, the model's own (x) set aside meanwhile. A node worker keeps no values of the version before its own
    # (a process serving several simulated nodes keeps one block more: ``ModelReplica.keeps_previous``).
    ahead = client_half(cfg.algorithm, cfg.correction_mode).runs_ahead
    local_values = min(b + (largest if ahead else 0), shape.trainable) * 4
    logits = tokens * shape.vocab * 4 * 3  # logits, log-softmax, their gradient
    # Under bf16 autocast (bf16 weights imply it), torch caches a bf16 copy of each fp32 weight that
    # needs a gradient (the block's) for the forward pass.
    autocast_copy = b * 2 if (bf16 or cfg.precision == "bf16") else 0
    device = {
        "weights": (shape.parameters - b) * (2 if bf16 else 4) + b * 4,
        "block_training_state": b * 16,  # start snapshot, gradient, two AdamW moments (fp32)
        "local_values": 0 if bf16 else local_values,
        "activations": activations,
        "logits_fp32_x3": logits,
        "autocast_block_copy": autocast_copy,
        # AdamW's multi-tensor step (CUDA's default) makes one fp32 temporary the size of the block
        # (the square roots of the second moments), after the backward's transients are freed: only
        # what it needs beyond them (measured on an H200: docs/deploy-8b.md, "Measured on a GPU").
        "adamw_step_beyond_backward": max(0, b * 4 - (activations + logits + autocast_copy)),
    }
    rounding, sent = cfg.transfer_dtype != "fp32", round(largest * transfer_bytes_per_value(cfg.transfer_dtype))
    host = {
        "runtime": RUNTIME_BYTES,
        "master_of_x": shape.trainable * 4 if bf16 else 0,
        "residuals": shape.trainable * 4 if rounding else 0,  # every block's error feedback, kept between rounds
        # Δ_i^r, kept until the next step as it travelled (``core.EncodedTensors``: int8 a quarter of fp32)
        # (``correction = "none"``: an fp32 offset, not what was sent)
        "pending_update": (sent if rounding and cfg.correction_mode != "none" else largest * 4) if ahead else 0,
        "update": largest * 4,  # Δ as the computation returns it, until it is rounded
        # SENDING, once the block has trained: the update rounded and its new residual, and the bytes of the update
        # and of the step (kept as they came, read chunk by chunk when applied: ``wire.Decoded``); a node running
        # ahead moves the bytes while the next block trains.
        "update_rounded": largest * 4 * 2 * rounding,
        "bytes_on_the_wire": 2 * sent,
    }
    return {"device": device, "host": host}


# What exists only while a block trains (COMPUTING) and only while its update is rounded and sent (SENDING): the
# node's peak holds the larger of the two beside what it keeps (``Plan.cpu_total``).
COMPUTING = ("block_training_state", "activations", "logits_fp32_x3", "autocast_block_copy",
             "adamw_step_beyond_backward", "local_values")  # fmt: skip
SENDING = ("update_rounded", "bytes_on_the_wire")


def transfer_bytes_per_value(transfer_dtype: str) -> float:
    """What ``transfer-dtype`` sends per value: its width, and int8's fp32 scale per block of values."""
    width = core.TRANSFER_DTYPES[transfer_dtype].itemsize
    return width + (4 / core.INT8_BLOCK if transfer_dtype == "int8" else 0)


def server_terms(cfg: RunConfig, shape: ModelShape, num_nodes: int) -> dict[str, int]:
    """Bytes the ServerApp holds: the model in fp32, a round's replies and step, evaluation."""
    largest = max(shape.blocks)
    sent = round(largest * transfer_bytes_per_value(cfg.transfer_dtype))  # a block as it travels
    terms = {
        "runtime": SERVER_RUNTIME_BYTES,
        "model_fp32": shape.parameters * 4,
        # The updates a round holds as they came (update_spill.IN_MEMORY; the rest spilled), one decoded
        # at a time, their mean, the step.
        "replies_and_step": min(num_nodes, IN_MEMORY) * sent + largest * 4 * 3,
        # A round with a full sync (a resumed run's first round, a node back after missing more steps
        # than there are blocks): one copy of every trainable tensor, shared by its messages, until
        # the round's step.
        "full_sync": shape.trainable * 4,
        # The SuperLink (on this machine) holds each message until its node confirms it, each reply until
        # the ServerApp does: the round's step (one copy for every node), a full sync, N replies.
        "superlink_messages": (num_nodes + 1) * sent + shape.trainable * 4,
    }
    if cfg.dp and cfg.dp_mode == "central" and cfg.dp_noise_multiplier > 0:
        terms["dp_noise"] = largest * 4  # the round's noise, drawn while the nodes train (privacy.ServerPrivacy)
    if cfg.transport == "direct":
        # The blocks move on the stream (a node that falls back excepted): the SuperLink holds control data;
        # the stream holds the round's published step (the record's own bytes, as sent) and its inbox the
        # uploads waiting for their replies, this round's and the next's moved ahead, as many in memory as
        # the round holds updates (the rest in files under output-dir).
        del terms["superlink_messages"]
        terms["stream_records"] = (min(num_nodes, IN_MEMORY) + 1) * sent
    if cfg.evaluation == "server":
        tokens = cfg.eval_batch_size * cfg.max_seq_len
        terms["evaluation"] = tokens * shape.vocab * 4 * 2 + tokens * shape.hidden * 4 * 4
    if cfg.evaluation == "server" or cfg.save_every:  # the evaluator process and its replica of x (on eval-device)
        terms["evaluator_runtime"] = EVALUATOR_RUNTIME_BYTES
        terms["evaluator_replica"] = shape.parameters * 4
    return terms


SIMULATION_ONLY = "node_state_simulation"  # the one disk term a deployment keeps on its sites, not the server


def disk_terms(cfg: RunConfig, shape: ModelShape, num_nodes: int) -> dict[str, int]:
    """Bytes the run folder grows to by the last round: the step log (``replica.StepLog``: each round's
    step as it travelled; with ``snapshot-every = N`` at most 3 snapshots of every trainable tensor in fp32
    and 2N steps, from a snapshot's write to the prune before the next round's messages; 2 snapshots
    between), and ParaBlock's pending updates (each sampled node's last update as it travelled, staged as
    replies come and in the checkpoint: two copies while the newer replaces the older)."""
    sent = round(max(shape.blocks) * transfer_bytes_per_value(cfg.transfer_dtype))  # a block as it travels
    terms = {"step_log": cfg.num_server_rounds * sent}
    if cfg.snapshot_every:
        terms["step_log"] = min(terms["step_log"], 3 * shape.trainable * 4 + 2 * cfg.snapshot_every * sent)
    if cfg.algorithm == "parablock":  # its server half stages them as they came (checkpoint.stage_pending)
        terms["pending_updates"] = 2 * num_nodes * sent
    # A round's accepted updates wait for their sum as they came (strategies/update_spill.py).
    terms["round_spill"] = max(0, num_nodes - IN_MEMORY) * sent
    # Simulation: each virtual node's state under RUN_DIR/node-state (deployment: on the node's own disk):
    # its pending update as sent, and (a rounding transfer-dtype) the fp32 residual of each block it trained.
    blocks_trained = min(cfg.num_server_rounds, len(shape.blocks)) if cfg.transfer_dtype != "fp32" else 0
    residuals = blocks_trained * max(shape.blocks) * 4
    terms[SIMULATION_ONLY] = num_nodes * ((sent if cfg.algorithm == "parablock" else 0) + residuals)
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
        """A CPU node's peak RSS: device and host terms in one memory (no CUDA), what a block's training adds
        and what sending its update adds never at once (a node running ahead moves the bytes meanwhile)."""
        terms = {k: self.device.get(k, 0) + self.host.get(k, 0) for k in {*self.device, *self.host}}
        computing, sending = (sum(terms[k] for k in names) for names in (COMPUTING, SENDING))
        if client_half(self.cfg.algorithm, self.cfg.correction_mode).runs_ahead:
            computing += terms["bytes_on_the_wire"]
        return sum(terms.values()) - sum(terms[k] for k in (*COMPUTING, *SENDING)) + max(computing, sending)

    @property
    def server_total(self) -> int:
        return sum(self.server.values())

    @property
    def disk_total(self) -> int:
        """The run folder of a deployment; a simulation also keeps its virtual nodes' state there."""
        return sum(v for k, v in self.disk.items() if k != SIMULATION_ONLY)


def make_plan(cfg: RunConfig, shape: ModelShape, num_nodes: int = 3) -> Plan:
    per_block = [worker_terms(cfg, shape, b) for b in range(len(shape.blocks))]
    worst = max(per_block, key=lambda t: sum(t["device"].values()))
    return Plan(cfg, shape, worst["device"], worst["host"], server_terms(cfg, shape, num_nodes),
                disk_terms(cfg, shape, num_nodes))  # fmt: skip


def worker_plan(cfg: RunConfig) -> Plan:
    """The plan of one node worker of ``cfg``'s run (what a node checks before it loads the model)."""
    return make_plan(cfg, shape_for(cfg, cfg.model, lambda: model_config(cfg.model), config_values(cfg.model)), 1)


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


def render(plan: Plan, fits: list[Plan] | None, gpu_gb: float | None, extra: list[str] = ()) -> str:
    """The table `parablock-flwr plan` prints (``extra`` lines after the table, before the fits)."""
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
        + ", ".join(f"{k} {gib(v)}" for k, v in plan.disk.items() if k != SIMULATION_ONLY)
        + f"; in a simulation also {SIMULATION_ONLY} {gib(plan.disk[SIMULATION_ONLY])} (a deployment keeps it on"
        " the sites) |",
    ]
    if not cfg.snapshot_every and cfg.num_server_rounds > 2 * len(shape.blocks):
        every = len(shape.blocks)
        bounded = disk_terms(replace(cfg, snapshot_every=every), shape, 0)["step_log"]
        if bounded < plan.disk["step_log"]:
            lines.append(f"the step log grows by {gib(max(shape.blocks) * 4)} GiB a round: snapshot-every={every} "
                         f"bounds it at {gib(bounded)} GiB, whatever the number of rounds")  # fmt: skip
    lines += extra
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


def run_config_defaults() -> dict[str, object]:
    """Every run-config key and its default: what ``plan``'s overrides are checked against."""
    return RunConfig().as_run_config()


def load_spike_bytes(cfg: RunConfig, shape: ModelShape) -> int:
    """A worker's host memory for a moment at load: the whole model in ``weights``' dtype (with LoRA's
    adapters in fp32) before it moves to the device, with bf16 weights' fp32 master, and the runtime.
    With LoRA the steady host column holds only adapters, so this is far above it."""
    bf16 = cfg.weights == "bf16"
    adapters = shape.trainable if cfg.trainable == "lora" else 0
    model = (shape.parameters - adapters) * (2 if bf16 else 4) + adapters * 4
    return RUNTIME_BYTES + model + (shape.trainable * 4 if bf16 else 0)


def site_disk_terms(cfg: RunConfig, shape: ModelShape, spec: str) -> dict[str, int]:
    """Bytes a site keeps on disk: the model's files, the residual store (``node.state.ResidualStore``:
    at most one fp32 residual per block plus ``KEEP_ROUNDS`` rounds', only with a rounded
    ``transfer-dtype``), and the datasets cache (``datasets`` copies a data file into Arrow once, about
    its size; reasoning-gym's rows are made in memory)."""
    from .node.state import KEEP_ROUNDS

    terms = {"model_files": model_file_bytes(cfg, shape, spec)}
    if cfg.transfer_dtype != "fp32":
        terms["residual_store"] = (len(shape.blocks) + KEEP_ROUNDS) * max(shape.blocks) * 4
    source = Path(cfg.dataset.partition(":")[2]).expanduser()
    if not cfg.dataset.startswith("reasoning-gym:") and source.exists():
        files = [source] if source.is_file() else [f for f in source.rglob("*") if f.is_file()]
        terms["datasets_cache"] = sum(f.stat().st_size for f in files)
    return terms


def model_file_bytes(cfg: RunConfig, shape: ModelShape, spec: str) -> int:
    """The model's weight files as they are on disk, else its parameters at the config's dtype."""
    file = local_config_file(spec)
    if file is not None:
        weights = [f for f in file.parent.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf")]
        if weights:
            return sum(f.stat().st_size for f in weights)
    base = shape.parameters - (shape.trainable if cfg.trainable == "lora" else 0)
    return base * (4 if shape.dtype_bytes == 4 else 2)


def block_bytes(cfg: RunConfig, values: int) -> int:
    """One direction's bytes for a block of ``values``: its update up, the round's step down."""
    return round(values * transfer_bytes_per_value(cfg.transfer_dtype))


def time_rows(cfg: RunConfig, shape: ModelShape, step_s: float | None, link: core.LinkModel) -> list[dict]:
    """Each round's modeled time (``core.LinkModel``, ``core.modeled_round_seconds``): per block of
    the schedule, its bytes, the exchange's time, the compute of ``local-steps`` steps of ``step_s``,
    ParaBlock's round (the larger of the two; on the stream with correction at-end the update's upload
    leaves beside the next computation) and sequential FedBCD's (their sum)."""
    rows = []
    for b, values in enumerate(shape.blocks):
        nbytes = block_bytes(cfg, values)
        comm = link.comm_seconds(nbytes, nbytes)
        row = {"block": b, "bytes": nbytes, "comm_s": comm}
        if step_s is not None:
            compute = cfg.local_steps * step_s
            ahead = ahead_seconds(cfg, link, nbytes)
            row |= {
                "compute_s": compute,
                "parablock_s": core.modeled_round_seconds([compute], [comm], overlapped=True, ahead_s=[ahead]),
                "fedbcd_s": core.modeled_round_seconds([compute], [comm], overlapped=False),
            }
        rows.append(row)
    return rows


def ahead_seconds(cfg: RunConfig, link: core.LinkModel, nbytes: int) -> float:
    """What ParaBlock's update takes out of the exchange by leaving as soon as it is computed (on the stream,
    correction at-end: ``LinkModel.ahead_seconds``); 0 otherwise."""
    return link.ahead_seconds(nbytes) if cfg.correction_mode == "at-end" else 0.0


def balance(cfg: RunConfig, shape: ModelShape, step_s: float, link: core.LinkModel) -> tuple[int, int]:
    """(local-steps, layers-per-block) at which compute fills the largest block's window: the fewest
    steps whose compute covers it at this ``layers-per-block``, and the most layers per block whose
    window this ``local-steps`` covers (0: not even one layer's, the fixed cost alone exceeds it)."""
    largest = block_bytes(cfg, max(shape.blocks))
    window = link.comm_seconds(largest, largest)  # ahead or not: the compute covers the exchange
    steps = max(1, math.ceil(window / step_s))
    per_layer = shape.layer_params
    layers = 0
    for n in range(1, shape.num_layers + 1):
        nbytes = block_bytes(cfg, n * per_layer)
        if link.comm_seconds(nbytes, nbytes) <= cfg.local_steps * step_s:
            layers = n
    return steps, layers


def grouped(rows: list[dict]) -> list[tuple[str, dict]]:
    """Runs of blocks with the same figures as one row ("0-5"): a 32-layer model is not 32 rows."""
    out: list[tuple[int, int, dict]] = []
    for r in rows:
        same = out and {k: v for k, v in out[-1][2].items() if k != "block"} == {
            k: v for k, v in r.items() if k != "block"
        }
        out[-1:] = [(out[-1][0], r["block"], r)] if same else out[-1:] + [(r["block"], r["block"], r)]
    return [(f"{a}" if a == b else f"{a}-{b}", r) for a, b, r in out]


def mbs(value: float) -> str:
    return f"{value:g} MB/s" if value else "not modeled"


def time_header(cfg: RunConfig, link: core.LinkModel) -> str:
    """The time section's first line: the link and the run's transport's fixed and per-byte costs."""
    head = (
        f"time per round (core.LinkModel): uplink {link.uplink_mbps:g} Mbit/s, downlink {link.downlink_mbps:g} "
        f"Mbit/s, latency {link.latency_ms:g} ms, fixed cost per exchange (message-overhead-s) "
        f"{link.message_overhead_s:g} s, "
    )
    if link.transport == "flower":
        per_byte, dtype = mbs(link.message_throughput_mbs), cfg.transfer_dtype
        return head + f"framework per-byte cost (message-throughput-mbs) {per_byte}; transfer-dtype={dtype}"
    return head + (
        f"per-byte cost on the run's stream (stream-throughput-mbs) {mbs(link.stream_throughput_mbs)} and a round "
        f"trip per direction for its calls; transport=direct transfer-dtype={cfg.transfer_dtype}"
    )


def beside_header(link: core.LinkModel) -> str:
    """The heading of the other transport's figures, so that an operator can choose; with Flower's
    per-byte cost not modeled, the two cannot be compared yet, and it says so."""
    measure = "" if link.message_throughput_mbs else ": measure it (python -m benchmarks.time_model) before comparing"
    if link.transport == "direct":
        flower = f"; Flower's per-byte cost (message-throughput-mbs) is not modeled{measure}" if measure else ""
        return (
            'beside it, transport="direct" (block records on the run\'s stream: the same fixed cost, per-byte '
            f"cost (stream-throughput-mbs) {mbs(link.stream_throughput_mbs)} and a round trip per direction for "
            f"its calls{flower}):"
        )
    return (
        'beside it, transport="flower" (block records inside Flower\'s messages: the same fixed cost, per-byte '
        f"cost (message-throughput-mbs) {mbs(link.message_throughput_mbs)}{measure}):"
    )


def time_table(cfg: RunConfig, shape: ModelShape, step_s: float | None, link: core.LinkModel) -> list[str]:
    """A row per block on ``link``, then (with a step time) the run's total and the balance."""
    rows = time_rows(cfg, shape, step_s, link)
    if step_s is None:
        lines = ["| block | MB each way | exchange s |", "|---|---|---|"]
        return lines + [f"| {b} | {r['bytes'] / 1e6:,.1f} | {r['comm_s']:.2f} |" for b, r in grouped(rows)]
    lines = [
        "| block | MB each way | exchange s | compute s | parablock round s | fedbcd round s |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {b} | {r['bytes'] / 1e6:,.1f} | {r['comm_s']:.2f} | {r['compute_s']:.2f} | "
        f"{r['parablock_s']:.2f} | {r['fedbcd_s']:.2f} |"
        for b, r in grouped(rows)
    ]
    schedule = core.block_schedule(cfg.schedule, len(shape.blocks), cfg.num_server_rounds, cfg.seed)
    para = sum(rows[b]["parablock_s"] for b in schedule)
    seq = sum(rows[b]["fedbcd_s"] for b in schedule)
    lines.append(f"{cfg.num_server_rounds} rounds ({cfg.schedule}): parablock {para:,.1f} s, fedbcd {seq:,.1f} s")
    steps, layers = balance(cfg, shape, step_s, link)
    by_layers = (
        f"layers-per-block={layers} (with local-steps={cfg.local_steps})"
        if layers
        else f"no layers-per-block (the fixed cost alone exceeds local-steps={cfg.local_steps} steps)"
    )
    lines.append(
        f"compute matches the window at local-steps={steps} (with layers-per-block={cfg.layers_per_block}) "
        f"or at {by_layers}"
    )
    return lines


def render_time(cfg: RunConfig, shape: ModelShape, step_s: float | None, step_source: str) -> list[str]:
    """The time section: the link and the run's transport's costs, a row per block, the run's total,
    the balance; then the same for the other transport."""
    link = core.LinkModel.from_config(cfg)
    lines = ["", time_header(cfg, link)]
    if step_s is None:
        lines.append("compute not modeled: give --step-time-s S (one local step, measured) or --probe")
    else:
        lines.append(f"one local step {step_s:.3g} s ({step_source}) x local-steps={cfg.local_steps}")
    lines += time_table(cfg, shape, step_s, link)
    other = core.LinkModel.from_config(cfg, transport="flower" if cfg.transport == "direct" else "direct")
    return lines + ["", beside_header(other), *time_table(cfg, shape, step_s, other)]


def probe_step_seconds(cfg: RunConfig, device: str = "", steps: int = 3) -> float:
    """One local step of the lowest block (backward reaches furthest), measured on this machine's device
    (``cuda`` if there is one) with the run's model, batch-size and max-seq-len: the median of ``steps``
    steps after one warm-up step."""
    import statistics
    import time

    import torch

    from .model import load_for_training, node_device
    from .training import TrainSettings, train_block

    model, partition = load_for_training(cfg, cfg.weights)
    model.to(node_device(device))
    vocab = model.get_input_embeddings().weight.shape[0]
    gen = torch.Generator().manual_seed(cfg.seed)
    ids = torch.randint(0, vocab, (cfg.batch_size, cfg.max_seq_len), generator=gen)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    settings = TrainSettings(1, cfg.learning_rate, cfg.weight_decay, "constant", 0, cfg.max_grad_norm,
                             cfg.precision, cfg.micro_batch_size, cfg.gradient_checkpointing)  # fmt: skip
    times = []
    for _ in range(steps + 1):
        started = time.perf_counter()
        train_block(model, partition.names(0), [batch], settings)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def plan_command(
    model: str,
    overrides: dict,
    gpu_memory_gb: float | None,
    num_nodes: int,
    step_time_s: float | None = None,
    probe: bool = False,
) -> str:
    """`parablock-flwr plan MODEL [KEY=VALUE ...] [--gpu-memory-gb G] [--step-time-s S | --probe]`: the
    tables as text. An unknown key or a wrongly typed value raises ``OverrideError`` first."""
    check_overrides(overrides, run_config_defaults())
    cfg = RunConfig.from_flower({**overrides, "model": model})
    check_model_exists(model)
    config = None

    def config_of():
        nonlocal config
        config = config if config is not None else model_config(model)
        return config

    shapes: dict[tuple, ModelShape] = {}
    values = config_values(model)

    def shape_of(c: RunConfig) -> ModelShape:
        key = tuple(getattr(c, k) for k in SHAPE_KEYS)
        if key not in shapes:
            shapes[key] = shape_for(c, model, config_of, values)
        return shapes[key]

    plan = make_plan(cfg, shape_of(cfg), num_nodes)
    fits = None
    if gpu_memory_gb is not None:
        fits = fitting_settings(cfg, shape_of, int(gpu_memory_gb * 1e9), num_nodes)
    source = "given"
    if probe:
        step_time_s, source = probe_step_seconds(cfg), "probed here, lowest block"
    lines = [
        f"per-site host at load (a moment, before the move to the device): {gib(load_spike_bytes(cfg, plan.shape))} "
        f"GiB (the model in weights={cfg.weights}{', with the LoRA adapters' if cfg.trainable == 'lora' else ''})"
    ]
    disk = site_disk_terms(cfg, plan.shape, model)
    lines.append(
        f"per-site disk: {gib(sum(disk.values()))} GiB: " + ", ".join(f"{k} {gib(v)}" for k, v in disk.items())
    )
    lines += render_time(cfg, plan.shape, step_time_s, source)
    lines += privacy_lines(cfg)
    return render(plan, fits, gpu_memory_gb, lines)


def privacy_lines(cfg: RunConfig) -> list[str]:
    """With differential privacy (docs/privacy.md): the epsilon the run ends at, its sites' updates released
    in every round (the most a site's can be; ``dp-target-epsilon`` may stop it before)."""
    if not cfg.dp:
        return []
    from .privacy import epsilon

    rounds = cfg.num_server_rounds
    if cfg.dp_noise_multiplier == 0:
        return [f"differential privacy: updates clipped to {cfg.dp_clip_norm:g}, no noise: no finite epsilon"]
    eps = epsilon(cfg.dp_noise_multiplier, rounds, cfg.dp_delta)
    line = (f"differential privacy ({cfg.dp_mode}): epsilon {eps:.3f} at delta {cfg.dp_delta:g} after {rounds} "
            f"rounds (noise multiplier {cfg.dp_noise_multiplier:g}, clip norm {cfg.dp_clip_norm:g})")  # fmt: skip
    if 0 < cfg.dp_target_epsilon < eps:
        last = max((k for k in range(rounds + 1) if epsilon(cfg.dp_noise_multiplier, k, cfg.dp_delta)
                    <= cfg.dp_target_epsilon), default=0)  # fmt: skip
        line += f"; dp-target-epsilon={cfg.dp_target_epsilon:g} stops it after round {last}"
    return [line]
