"""What one node computes, shared by the inline ClientApp (simulation) and the node worker.

``compute_update`` is one client round of either algorithm: train block
``b_r`` from ``x^{base} + pending`` and return ``Δ_i^r``. Which base and
pending to use is the algorithm (``core.parablock_base``); when it runs
(inline in the handler, or in the worker's background thread) is the mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import datasets
import torch

from . import core
from .config import RunConfig
from .data import client_partition, sample_batches, tokenized_splits
from .model import load_for_training, load_tokenizer
from .replica import ModelReplica
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
        train_rows, _ = tokenized_splits(cfg.dataset, cfg.num_examples, cfg.heldout_examples, cfg.seed,
                                         tokenizer, cfg.max_seq_len)
        _RESOURCES = NodeResources(key, ModelReplica(model), partition, train_rows, tokenizer.pad_token_id)
    return _RESOURCES


def compute_update(res: NodeResources, cfg: RunConfig, server_round: int, block: int,
                   pending: core.PendingUpdate | None, base_version: int, partition_id: int, num_partitions: int,
                   between_steps: BetweenSteps | None = None) -> TrainResult:
    """Train ``block`` from ``x^{base_version} + pending``; the replica is left as it was."""
    rows = client_partition(res.train_rows, partition_id, num_partitions, cfg.partitioning, cfg.dirichlet_alpha,
                            cfg.seed)
    seed = round_seed(cfg, server_round, partition_id)
    torch.manual_seed(seed)
    batches = sample_batches(rows, cfg.local_steps, cfg.batch_size, seed, res.pad_id)
    settings = TrainSettings(cfg.local_steps, cfg.learning_rate, cfg.weight_decay, cfg.lr_schedule,
                             cfg.warmup_steps, cfg.max_grad_norm, cfg.precision)
    names = res.partition.names(block)
    with res.replica.local_model(base_version, pending, names) as model:
        result = train_block(model, names, batches, settings, between_steps)
    result.num_examples = len(rows)
    return result


def update_metrics(result: TrainResult, server_round: int, block: int, partition_id: int,
                   base_version: int) -> dict:
    """The metrics every reply carries with ``Δ_i^r`` (what ``FedBCD.check_reply`` reads)."""
    return {"server-round": server_round, "block": block, "num-examples": result.num_examples,
            "partition-id": partition_id, "train-loss": result.mean_loss, "compute-s": result.compute_s,
            "base-version": base_version}
