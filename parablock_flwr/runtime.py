"""What both apps set up the same way: torch's determinism and threads, and seeds."""

from __future__ import annotations

import os

import torch

from .config import RunConfig


def setup_torch(cfg: RunConfig) -> None:
    """Deterministic kernels and a fixed thread count (float sums depend on it)."""
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def round_seed(cfg: RunConfig, server_round: int, partition_id: int) -> int:
    """The seed of one client's round: its batches and any dropout."""
    return (cfg.seed * 1_000_003 + server_round * 10_007 + partition_id) % (2**63)
