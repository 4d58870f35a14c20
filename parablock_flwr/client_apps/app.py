"""The ClientApp: one block's local training per message, for ParaBlock and sequential BCD.

Per-node state (the pending update of ParaBlock and the global version it
sits on) lives in ``context.state``: in simulation one Ray actor serves many
virtual nodes. What is per process (model, tokenizer, data) is loaded once
per process and reused by every node the process serves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import datasets
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from .. import core
from ..config import RunConfig
from ..data import client_partition, sample_batches, tokenized_splits
from ..model import load_model, load_tokenizer
from ..records import to_record, to_tensors
from ..replica import ModelReplica, StepLog
from ..runtime import round_seed, setup_torch
from ..training import TrainSettings, train_block

log = logging.getLogger("parablock_flwr")
app = ClientApp()


@dataclass
class ProcessResources:
    """Loaded once per process (Ray actor), shared by all the nodes it serves."""

    key: tuple
    replica: ModelReplica
    partition: core.BlockPartition
    train_rows: datasets.Dataset
    pad_id: int


_RESOURCES: ProcessResources | None = None


def resources(cfg: RunConfig, run_id: int) -> ProcessResources:
    """This process's model replica and data, rebuilt only for a new run or model."""
    global _RESOURCES
    key = (run_id, cfg.model, cfg.dataset, cfg.num_examples, cfg.heldout_examples, cfg.seed,
           cfg.max_seq_len, cfg.layers_per_block, cfg.non_layer_params)
    if _RESOURCES is None or _RESOURCES.key != key:
        _RESOURCES = None  # free the previous run's model before loading the next
        model = load_model(cfg.model)
        if torch.cuda.is_available():
            model.to("cuda")
        tokenizer = load_tokenizer(cfg.model)
        train_rows, _ = tokenized_splits(cfg.dataset, cfg.num_examples, cfg.heldout_examples, cfg.seed,
                                         tokenizer, cfg.max_seq_len)
        partition = core.partition_blocks(model, cfg.layers_per_block, cfg.non_layer_params)
        _RESOURCES = ProcessResources(key, ModelReplica(model), partition, train_rows, tokenizer.pad_token_id)
    return _RESOURCES


def load_pending(state: RecordDict) -> core.PendingUpdate | None:
    if "pending" not in state.config_records:
        return None
    meta = state["pending"]
    delta = to_tensors(state["pending-delta"])
    return core.PendingUpdate(block=int(meta["block"]), base_version=int(meta["base-version"]), delta=delta)


def save_pending(state: RecordDict, pending: core.PendingUpdate) -> None:
    state["pending"] = ConfigRecord({"block": pending.block, "base-version": pending.base_version})
    state["pending-delta"] = to_record(pending.delta)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Round r: train ``b_r``; for ParaBlock from ``x^{r-2} + Δ^{r-1}``, then correct."""
    cfg = RunConfig.from_flower(context.run_config)
    setup_torch(cfg)
    res = resources(cfg, context.run_id)
    round_cfg = msg.content["round"]
    server_round, block = int(round_cfg["server-round"]), int(round_cfg["block"])
    partition_id = int(context.node_config.get("partition-id", 0))
    num_partitions = int(context.node_config.get("num-partitions", 1))

    step_log = StepLog(round_cfg["run-dir"])
    message_step = to_tensors(msg.content["global-step"])

    def fetch_step(version: int):
        """``g^{r-1}`` came with the message; older steps from the server's log."""
        if version == server_round - 1:
            return int(round_cfg["step-block"]), message_step
        return step_log.read(version)

    if round_cfg["algorithm"] == "parablock":
        base_version, pending = core.parablock_base(load_pending(context.state), server_round)
    else:
        base_version, pending = server_round - 1, None
    replica = res.replica
    replica.advance_to(base_version, fetch_step)

    rows = client_partition(res.train_rows, partition_id, num_partitions)
    seed = round_seed(cfg, server_round, partition_id)
    torch.manual_seed(seed)
    batches = sample_batches(rows, cfg.local_steps, cfg.batch_size, seed, res.pad_id)
    settings = TrainSettings(cfg.local_steps, cfg.learning_rate, cfg.weight_decay, cfg.lr_schedule,
                             cfg.warmup_steps, cfg.max_grad_norm, cfg.precision)
    names = res.partition.names(block)
    with replica.local_model(pending, names) as model:
        result = train_block(model, names, batches, settings)

    content = RecordDict({
        "update": to_record(result.delta),
        "metrics": MetricRecord({
            "server-round": server_round, "block": block, "num-examples": len(rows), "partition-id": partition_id,
            "train-loss": result.mean_loss, "compute-s": result.compute_s, "base-version": base_version,
        }),
    })
    if round_cfg["algorithm"] == "parablock":
        save_pending(context.state, core.correct(block, result.delta, server_round))
        if cfg.verify_invariant:
            # y after the correction is x^{r-1} + Δ^r; the replica holds x^{base}.
            steps = ([message_step] if base_version == server_round - 2 else []) + [result.delta]
            digest = core.digest_after(replica.params, res.partition.all_names(), *steps)
            content["trace"] = ConfigRecord({"local-model-sha256": digest})
    return Message(content=content, reply_to=msg)

