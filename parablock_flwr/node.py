"""What one node computes, shared by the inline ClientApp (simulation) and the node worker.

``train_round`` is one client round of any algorithm: the algorithm's client half
(``strategies.BCDClient``, ``strategies.ParaBlockClient``) says which model it
trains from and what the client keeps; ``compute_update`` trains block ``b_r`` from
``x^{base} + pending`` and returns ``Δ_i^r``. When it runs (inline in the handler,
or ahead in the worker's background thread) is the driver's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import datasets
import torch

from . import core
from .config import RunConfig
from .data import client_partition, sample_batches, tokenized_splits
from .model import load_for_training, load_tokenizer
from .replica import FetchStep, ModelReplica
from .runtime import round_seed
from .training import BetweenSteps, TrainResult, TrainSettings, train_block


@dataclass
class NodeResources:
    """Loaded once per process (a Ray actor or a node worker) and reused."""

    key: tuple[int, RunConfig]
    replica: ModelReplica
    partition: core.BlockPartition
    train_rows: datasets.Dataset
    pad_id: int


if TYPE_CHECKING:
    from .strategies import BCDClient

_RESOURCES: NodeResources | None = None


def resources(cfg: RunConfig, run_id: int) -> NodeResources:
    """This process's model replica and data, rebuilt only for a new run or model."""
    global _RESOURCES
    key = (run_id, cfg)
    if _RESOURCES is None or _RESOURCES.key != key:
        _RESOURCES = None  # free the previous run's model before loading the next
        model, partition = load_for_training(cfg)
        if torch.cuda.is_available():
            model.to("cuda")
        tokenizer = load_tokenizer(cfg.model)
        train_rows, _ = tokenized_splits(
            cfg.dataset, cfg.num_examples, cfg.heldout_examples, cfg.seed, tokenizer, cfg.max_seq_len
        )
        _RESOURCES = NodeResources(key, ModelReplica(model), partition, train_rows, tokenizer.pad_token_id)
    return _RESOURCES


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
        base_version, pending = client.start_point(pending, server_round)
        resources.replica.advance_to(base_version, fetch_step)
        result = compute_update(
            resources, cfg, server_round, block, pending, base_version, partition_id, num_partitions
        )
    else:
        base_version, result = computed_ahead
    if cfg.transfer_dtype != "fp32":
        result.delta, residuals[block] = core.round_with_feedback(
            result.delta, residuals.get(block), cfg.transfer_dtype
        )
    kept = client.finish_round(resources.replica, result.delta, block, server_round, fetch_step)
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
) -> TrainResult:
    """Train ``block`` from ``x^{base_version} + pending``; the replica is left as it was."""
    rows = client_partition(
        resources.train_rows, partition_id, num_partitions, cfg.partitioning, cfg.dirichlet_alpha, cfg.seed
    )
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
        cfg.precision,
    )
    names = resources.partition.names(block)
    with resources.replica.local_model(base_version, pending, names) as model:
        result = train_block(model, names, batches, settings, between_steps)
    result.num_examples = len(rows)
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
    }
