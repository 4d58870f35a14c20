"""What both apps set up the same way: torch's determinism and threads, seeds, and how a process keeps the
memory it frees."""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

from .config import RunConfig

log = logging.getLogger(__name__)


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


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8


@functools.cache
def _glibc():
    """The C library when it is glibc (``mallopt`` and ``malloc_trim``); None elsewhere (macOS, musl)."""
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols: the C library it runs on
    except OSError:
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim")):
        return None
    libc.mallopt.argtypes, libc.malloc_trim.argtypes = [ctypes.c_int, ctypes.c_int], [ctypes.c_size_t]
    return libc


def keep_freed_memory() -> bool:
    """Serve this process's large buffers from one heap that keeps what it frees, for the next round.

    Every round allocates and frees buffers of a block's size: the update, its rounding, the step, their
    bytes on the wire. glibc maps each buffer above 32 MiB afresh and unmaps it when freed, so the kernel
    faults in and zeroes every page of it again each round (on the project's VM, joining a 977 MB step took
    0.59-0.67 s into fresh pages, 0.17-0.18 s into pages already touched: ``python -m benchmarks.direct_legs
    --sizes-mb 973 --allocators default,keep``). With no mappings, no trimming and one arena, a round reuses
    the pages the last one freed. The process's memory then stays at its peak, which ``plan`` counts; a
    transient peak (a model's load, a full sync) is given back by ``release_freed_memory``.

    Call it first: a thread that allocated before it keeps its own arena, and a later thread may be given
    that arena (whose large buffers are still mapped afresh). Logs one line saying whether it does, for the
    operator; False (nothing changed) where the C library is not glibc."""
    libc = _glibc()
    settings = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, -1))  # -1: never trim (man mallopt)
    kept = libc is not None and all([libc.mallopt(param, value) == 1 for param, value in settings])
    log.info("freed memory kept for the next round: %s", "yes" if kept else "no (not glibc)")
    return kept


def release_freed_memory() -> None:
    """Give the system back what this process has freed (``malloc_trim``): after a model's load or a full
    sync, whose copies ``keep_freed_memory`` would otherwise keep."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
