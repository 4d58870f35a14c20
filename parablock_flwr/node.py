"""What one node computes, shared by the inline ClientApp (simulation) and the node worker.

``train_round`` is one client round of any algorithm: the algorithm's client half
(``strategies/fedbcd/client.py``, ``strategies/parablock/client.py``) says which model it
trains from and what the client keeps; ``compute_update`` trains block ``b_r`` from
``x^{base} + pending`` and returns ``Δ_i^r``. When it runs (inline in the handler,
or ahead in the worker's background thread) is the driver's business.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import datasets
import torch

from . import core
from .config import RunConfig
from .data import (
    client_partition,
    local_rows_limit,
    node_splits,
    sample_batches,
    tokenized_rows,
    tokenized_splits,
    truncated_in_batches,
)
from .evaluation import evaluate
from .model import load_for_training, load_tokenizer
from .node_data import NodeSettings
from .replica import FetchStep, ModelReplica
from .runtime import round_seed
from .strategies.fedbcd.client import BCDClient
from .strategies.parablock.client import CorrectionSlot
from .training import BetweenSteps, TrainResult, TrainSettings, train_block


@dataclass
class NodeResources:
    """Loaded once per process (a Ray actor or a node worker) and reused."""

    key: tuple[int, RunConfig, NodeSettings]
    replica: ModelReplica
    partition: core.BlockPartition
    train_rows: datasets.Dataset  # the node's own rows, or the run's training rows to take a partition of
    pad_id: int
    heldout_rows: datasets.Dataset | None = None  # for evaluation = "clients"
    tokenizer: object = None
    settings: NodeSettings = NodeSettings()

    def rows(self, cfg: RunConfig, partition_id: int, num_partitions: int) -> datasets.Dataset:
        """The rows this node trains on: its own data, or its partition of the run's dataset."""
        if self.settings.local:
            return self.train_rows
        return client_partition(
            self.train_rows, partition_id, num_partitions, cfg.partitioning, cfg.dirichlet_alpha, cfg.seed
        )


_RESOURCES: NodeResources | None = None
WEIGHTS_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def resources(cfg: RunConfig, run_id: int, settings: NodeSettings | None = None) -> NodeResources:
    """This process's model replica and data, rebuilt only for a new run, model or node settings.

    A node with its own ``dataset`` (``settings``) loads only that, never the run config's
    ``dataset``; its held-out rows are its ``heldout-dataset``, or (``evaluation = "clients"``
    without one) the first ``heldout-examples`` rows of its own data."""
    global _RESOURCES
    settings = settings or NodeSettings()
    key = (run_id, cfg, settings)
    if _RESOURCES is None or _RESOURCES.key != key:
        _RESOURCES = None  # free the previous run's model before loading the next
        model, partition = load_for_training(cfg, cfg.weights)  # bf16: no fp32 copy of the whole model
        device = node_device(settings.device)
        weights_dtype = WEIGHTS_DTYPES[cfg.weights]
        replica = ModelReplica(model, partition.all_names(), weights_dtype)  # weights cast before the move
        model.to(device)
        tokenizer = load_tokenizer(cfg.model, cfg.prompt_format)
        own_heldout = cfg.heldout_examples if cfg.evaluation == "clients" else 0
        if settings.local:
            train_rows, heldout_rows = node_splits(
                settings.dataset, settings.heldout_dataset, own_heldout, cfg.num_examples, cfg.seed, tokenizer,
                cfg.max_seq_len,
            )  # fmt: skip
        else:
            train_rows, heldout_rows = tokenized_splits(
                cfg.dataset, cfg.num_examples, cfg.heldout_examples, cfg.seed, tokenizer, cfg.max_seq_len
            )
            if settings.heldout_dataset:
                limit = local_rows_limit(settings.heldout_dataset, cfg.num_examples)
                heldout_rows = tokenized_rows(settings.heldout_dataset, limit, cfg.seed, tokenizer, cfg.max_seq_len)
        _RESOURCES = NodeResources(
            key, replica, partition, train_rows, tokenizer.pad_token_id, heldout_rows, tokenizer, settings
        )
    return _RESOURCES


def node_device(name: str) -> torch.device:
    """The node's device: as named (``cuda:1``), else CUDA when there is a GPU, else the CPU."""
    if not name:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and (not torch.cuda.is_available() or (device.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"device={name!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    return device


def evaluate_replica(resources: NodeResources, cfg: RunConfig, version: int, generate: bool) -> dict:
    """``evaluation = "clients"``: the held-out loss of ``x^version`` (the replica, nothing applied, nothing
    running on it) on this node's held-out rows, as reply metrics. The caller guarantees that no
    computation uses the replica meanwhile (the worker runs it before starting the next one)."""
    if resources.replica.version != version:
        have = resources.replica.version
        raise RuntimeError(f"evaluation of x^{version} asked while this node's model is at x^{have}")
    if resources.heldout_rows is None or not len(resources.heldout_rows):
        raise ValueError("evaluation='clients': this node has no held-out rows")
    own = dataclasses.replace(cfg, dataset=resources.settings.dataset or cfg.dataset)  # task accuracy by its data
    metrics, _ = evaluate(resources.replica.model, resources.tokenizer, resources.heldout_rows, own, generate)
    out = {
        "eval-version": version,
        "heldout-loss": metrics["heldout_loss"],
        "heldout-examples": len(resources.heldout_rows),
    }
    if "task_accuracy" in metrics:
        out["task-accuracy"], out["task-examples"] = metrics["task_accuracy"], metrics["task_examples"]
    return out


def evaluation_due(round_cfg) -> int | None:
    """The version the server asks this message to evaluate (``evaluate-version``), or None."""
    version = int(round_cfg.get("evaluate-version", -1))
    return version if version >= 0 else None


@dataclass
class ClientRound:
    """What a client round produced: the update to send and the state the client keeps."""

    result: TrainResult
    base_version: int  # the global version it trained from
    kept: core.PendingUpdate | None  # the client's own update not yet in the global model
    trace: dict[str, str] = field(default_factory=dict)  # the local model's digest (verify-invariant)


def train_round(
    resources: NodeResources,
    cfg: RunConfig,
    client: BCDClient,
    server_round: int,
    block: int,
    pending: core.PendingUpdate | None,
    fetch_step: FetchStep,
    partition_id: int,
    num_partitions: int,
    residuals: dict[int, core.Tensors],
    computed_ahead: tuple[int, TrainResult] | None = None,
) -> ClientRound:
    """One client round of any algorithm, the same in simulation and deployment.

    Train ``b_r`` from the client half's start point (unless the worker already
    computed it ahead: ``(base_version, result)``), round the update to
    ``transfer-dtype`` (error feedback through ``residuals``, by block), then let the
    client half finish the round with the update as sent (ParaBlock: the correction).
    The replica ends at ``x^{r-1}``.
    """
    if computed_ahead is None:
        base_version, pending = client.start_point(pending, server_round, fetch_step)
        resources.replica.advance_to(base_version, fetch_step)
        slot = None
        if cfg.correction_mode == "on-receipt" and pending is not None:  # trained from x^{r-2} + Δ_i^{r-1}
            # Inline (simulation), g^{r-1} came with the message: it is applied at the first step
            # boundary, as a node worker does when the exchange is shorter than one local step.
            slot = CorrectionSlot()
            slot.post(fetch_step(server_round - 1)[1], pending.delta)
        result = compute_update(
            resources, cfg, server_round, block, pending, base_version, partition_id, num_partitions, slot
        )
    else:  # the worker computed it from x^{base_version} + pending (client.start_point's)
        base_version, result = computed_ahead
    if cfg.transfer_dtype != "fp32":
        result.delta, residuals[block] = core.round_with_feedback(
            result.delta, residuals.get(block), cfg.transfer_dtype
        )
    kept = client.finish_round(resources.replica, pending, result.delta, block, server_round, fetch_step)
    resources.replica.advance_to(server_round - 1, fetch_step)
    trace = {}
    if cfg.verify_invariant and kept is not None:  # y after the correction is x^{r-1} + Δ_i^r
        trace["local-model-sha256"] = core.digest_after(
            resources.replica.params, resources.partition.all_names(), kept.delta
        )
    return ClientRound(result, base_version, kept, trace)


def compute_update(
    resources: NodeResources,
    cfg: RunConfig,
    server_round: int,
    block: int,
    pending: core.PendingUpdate | None,
    base_version: int,
    partition_id: int,
    num_partitions: int,
    between_steps: BetweenSteps | None = None,
    after_training: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> TrainResult:
    """Train ``block`` from ``x^{base_version} + pending``; the replica is left as it was.
    ``after_training`` sees the trained model's parameters before they are restored."""
    rows = resources.rows(cfg, partition_id, num_partitions)
    seed = round_seed(cfg, server_round, partition_id)
    torch.manual_seed(seed)
    batches = sample_batches(rows, cfg.local_steps, cfg.batch_size, seed, resources.pad_id)
    settings = TrainSettings(
        cfg.local_steps,
        cfg.learning_rate,
        cfg.weight_decay,
        cfg.lr_schedule,
        cfg.warmup_steps,
        cfg.max_grad_norm,
        "bf16" if cfg.weights == "bf16" else cfg.precision,  # bf16 weights with an fp32 block: autocast
        micro_batch_size=cfg.micro_batch_size,
        gradient_checkpointing=cfg.gradient_checkpointing,
        # lr-schedule-scope = "run": one schedule over R x K steps, round r starting at step (r-1) x K
        schedule_steps=cfg.num_server_rounds * cfg.local_steps if cfg.lr_schedule_scope == "run" else 0,
        schedule_offset=(server_round - 1) * cfg.local_steps if cfg.lr_schedule_scope == "run" else 0,
    )
    names = resources.partition.names(block)
    with resources.replica.local_model(base_version, pending, names) as model:
        result = train_block(model, names, batches, settings, between_steps)
        if after_training is not None:
            after_training(dict(model.named_parameters()))
    result.num_examples = len(rows)
    result.truncated = truncated_in_batches(rows, cfg.local_steps, cfg.batch_size, seed)
    return result


def update_metrics(result: TrainResult, server_round: int, block: int, partition_id: int, base_version: int) -> dict:
    """The metrics every reply carries with ``Δ_i^r`` (what ``strategies.reply_checks`` reads)."""
    return {
        "server-round": server_round,
        "block": block,
        "num-examples": result.num_examples,
        "partition-id": partition_id,
        "train-loss": result.mean_loss,
        "compute-s": result.compute_s,
        "base-version": base_version,
        "truncated-examples": result.truncated,
    }
