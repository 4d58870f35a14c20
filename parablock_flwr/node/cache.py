"""What a node process loads once and keeps (``resources``): the model replica and the data (a Ray actor or a node
worker holds one ``NodeResources``, rebuilt only for a new run, model or node settings)."""

from __future__ import annotations

from dataclasses import dataclass

import datasets
import torch

from .. import core
from ..config import RunConfig
from ..data import client_partition, local_rows_limit, node_splits, tokenized_rows, tokenized_splits
from ..memory import available_bytes, current_rss_bytes, freeze_loaded, release_freed_memory
from ..model import load_for_training, load_tokenizer, node_device
from ..replica import ModelReplica
from .request import RequestRefused
from .settings import NodeSettings


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
    # Source rows ``max-seq-len`` cut before their answer, dropped (data.Split): the node's own data's,
    # or (a partition of the run's dataset) the whole dataset's, the same on every such node.
    dropped_for_length: int = 0
    malformed_rows: int = 0  # its data's rows skipped as malformed (data.Malformed), counted like the above

    def rows(self, cfg: RunConfig, partition_id: int, num_partitions: int) -> datasets.Dataset:
        """The rows this node trains on: its own data, or its partition of the run's dataset."""
        if self.settings.local:
            return self.train_rows
        return client_partition(
            self.train_rows, partition_id, num_partitions, cfg.partitioning, cfg.dirichlet_alpha, cfg.seed
        )


_RESOURCES: NodeResources | None = None
WEIGHTS_DTYPES = {"fp32": None, "bf16": torch.bfloat16}


def resources(
    cfg: RunConfig, run_id: int, settings: NodeSettings | None = None, serves_one_node: bool = False
) -> NodeResources:
    """This process's model replica and data, rebuilt only for a new run, model or node settings.
    ``serves_one_node`` (a node worker): its replica keeps no values of the version before its own,
    which only a process serving several nodes (a Ray actor) computes from (``ModelReplica``).

    A node with its own ``dataset`` (``settings``) loads only that, never the run config's
    ``dataset``; its held-out rows are its ``heldout-dataset``, or (``evaluation = "clients"``
    without one) the first ``heldout-examples`` rows of its own data."""
    global _RESOURCES
    settings = settings or NodeSettings()
    if (refused := settings.refusal(cfg.model, cfg.dataset)) is not None:
        raise RequestRefused(refused)  # the node config's allow-lists: nothing loaded, nothing changed
    key = (run_id, cfg, settings)
    if _RESOURCES is None or _RESOURCES.key != key:
        check_fits(cfg, run_id, settings)
        _RESOURCES = None  # free the previous run's model before loading the next
        _RESOURCES = _load(key, keeps_previous=not serves_one_node)
    return _RESOURCES


def _load(key: tuple[int, RunConfig, NodeSettings], keeps_previous: bool = True) -> NodeResources:
    """The replica on the node's device, the tokenizer, and the node's rows (its own, or the run's)."""
    _, cfg, settings = key
    model, partition = load_for_training(cfg, cfg.weights)  # bf16: no fp32 copy of the whole model
    device = node_device(settings.device)
    replica = ModelReplica(model, partition.all_names(), WEIGHTS_DTYPES[cfg.weights], keeps_previous)  # cast, then move
    model.to(device)
    tokenizer = load_tokenizer(cfg.model, cfg.prompt_format)
    own_heldout = cfg.heldout_examples if cfg.evaluation == "clients" else 0
    if settings.local:
        split = node_splits(
            settings.dataset, settings.heldout_dataset, own_heldout, cfg.num_examples, cfg.seed, tokenizer,
            cfg.max_seq_len,
        )  # fmt: skip
    else:
        split = tokenized_splits(
            cfg.dataset, cfg.num_examples, cfg.heldout_examples, cfg.seed, tokenizer, cfg.max_seq_len
        )
    train_rows, heldout_rows = split
    if not settings.local and settings.heldout_dataset:
        limit = local_rows_limit(settings.heldout_dataset, cfg.num_examples)
        heldout_rows = tokenized_rows(settings.heldout_dataset, limit, cfg.seed, tokenizer, cfg.max_seq_len)
    resources = NodeResources(
        key, replica, partition, train_rows, tokenizer.pad_token_id, heldout_rows, tokenizer, settings,
        split.dropped_for_length, split.malformed,
    )  # fmt: skip
    release_freed_memory()  # the load's transient copies, which the heap would keep
    freeze_loaded()  # what stays for the run: out of the collector's per-round passes
    return resources


def check_fits(cfg: RunConfig, run_id: int, settings: NodeSettings) -> None:
    """Refuse (``RequestRefused``: nothing changes) a run whose model this process would have to load and cannot hold
    (``memory_refusal``): a node killed mid-round loses the round, a refused one nothing."""
    if _RESOURCES is not None and _RESOURCES.key == (run_id, cfg, settings):
        return
    if (short := memory_refusal(cfg, settings)) is not None:  # what this process holds counts as free
        raise RequestRefused(short)


def memory_refusal(cfg: RunConfig, settings: NodeSettings) -> str | None:
    """Why this node cannot hold this run (None: it can, or nothing says what it has): ``plan``'s peak for its
    worker against what the site lets it use (``memory-limit-gib``) or, without that, what this machine and its
    container have free now, plus what this process already holds (``plan`` counts its runtime). On a GPU, the
    device's free memory too. One line, numbers only, naming what to change."""
    from ..plan import gib, worker_plan

    device = node_device(settings.device)
    plan = worker_plan(cfg)
    needed, has, source = plan.cpu_total if device.type == "cpu" else plan.host_total, *host_memory(settings)
    where = "memory"
    if (has is None or needed <= has) and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        needed, has, where = plan.device_total, free + torch.cuda.memory_reserved(device), f"{device} memory"
        source = "free on the device, plus what this process has reserved"
    if has is None or needed <= has:
        return None
    return (f"{where}: this run needs about {gib(needed)} GiB on this node (parablock-flwr plan's peak for its worker: "
            f"algorithm={cfg.algorithm}, layers-per-block={cfg.layers_per_block}, transfer-dtype={cfg.transfer_dtype}, "
            f"weights={cfg.weights}) and it has {gib(has)} GiB ({source}); nothing loaded: lower layers-per-block, "
            f"micro-batch-size or max-seq-len, or set gradient-checkpointing = true")  # fmt: skip


def host_memory(settings: NodeSettings) -> tuple[int | None, str]:
    """What this node's process may use (bytes, None: unknown) and where the figure comes from."""
    if settings.memory_limit_gib:
        try:
            limit = float(settings.memory_limit_gib)
        except ValueError:
            limit = -1.0
        if not limit > 0:
            raise RequestRefused(
                f"node config memory-limit-gib={settings.memory_limit_gib!r}: expected a number of GiB > 0 "
                "(plan prints what a run needs)"
            )
        return int(limit * 2**30), "node config memory-limit-gib"
    free = available_bytes()
    if free is None:
        return None, ""
    return free + current_rss_bytes(), "free on this machine now (MemAvailable, within its cgroup), plus this process"


def loaded() -> NodeResources | None:
    """The resources this process holds, if any: the worker bounds a run's messages by its model."""
    return _RESOURCES
