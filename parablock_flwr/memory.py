"""How a process holds memory: its large buffers mapped and given back when freed (glibc), its peak, and what
the machine has free. Torch-free: the launcher sets the environment that its children start with."""

from __future__ import annotations

import ctypes
import functools
import gc
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h); setting one stops glibc moving it
LARGE_BUFFER_BYTES = 2**20  # buffers from this size up get a mapping of their own (``map_large_buffers``)
HEAP_KEPT_BYTES = 32 * 2**20  # what a heap keeps of the space freed at its top (``map_large_buffers``)
HUGE_PAGES = "glibc.malloc.hugetlb=1"  # the glibc tunable (2.35+) that madvises each mapping for huge pages


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


def map_large_buffers() -> bool:
    """Serve every buffer of 1 MiB or more (a block's tensors, their rounding, the step, their bytes on the wire)
    from a mapping of its own, given back to the system when freed, so that what the process holds is what it
    uses, round after round.

    glibc's default maps only buffers above a threshold that rises to 32 MiB as buffers are freed; a block's
    tensors below it, and (before this) every buffer when the heap kept what it freed, share one heap, where a
    buffer that lives on (a residual, the pending update, the replica's saved values) pins the freed space
    around it: a deployed BCD worker of a 0.30 B model grew round after round, to 1.3 times plan's figure by
    round 4 (docs/results/deployed_memory.md now). With the environment's ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``
    (``HUGE_PAGES``; ``tools.launch`` and the units in deploy/ set it) each mapping asks for transparent huge
    pages, so that a fresh buffer's pages fault in 2 MiB at a time (without it, the server's aggregation took
    twice as long: docs/transport.md, "Pages faulted in each round"). The buffers a round makes again every
    round (a block's update, rounding, sum, step and received bytes) are kept across rounds by ``kept_blocks``,
    which hands them out of these mappings and gives back, once a round, what lay unused.

    Below the threshold, the heaps keep up to ``HEAP_KEPT_BYTES`` of what is freed at their top (glibc's own
    default, once its threshold is fixed, gives back all but 128 KiB): the stream's messages (half a
    ``LARGE_BUFFER_BYTES`` each, ``transport.service.CHUNK_BYTES``), copied by gRPC and Python a few times on
    their way, are freed as fast as they come and reuse the same warm pages, not pages faulted in for each message.

    Call it first, before the process's threads allocate. Logs one line saying what holds, for the operator;
    False (nothing changed) where the C library is not glibc."""
    libc = _glibc()
    mapped = libc is not None and libc.mallopt(M_MMAP_THRESHOLD, LARGE_BUFFER_BYTES) == 1
    if mapped:
        libc.mallopt(M_TRIM_THRESHOLD, HEAP_KEPT_BYTES)
    huge = mapped and huge_pages_asked()
    huge_line = "yes" if huge else f"no (start this process with GLIBC_TUNABLES={HUGE_PAGES})"
    log.info("large buffers mapped, given back when freed: %s; on huge pages: %s",
             "yes" if mapped else "no (not glibc)", huge_line)  # fmt: skip
    return mapped


def huge_pages_asked() -> bool:
    """Whether this process was started with ``HUGE_PAGES`` among its glibc tunables."""
    return HUGE_PAGES in os.environ.get("GLIBC_TUNABLES", "").split(":")


def with_huge_pages(env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``HUGE_PAGES`` added to its glibc tunables (kept as they are when it is there)."""
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    if HUGE_PAGES in tunables:
        return env
    return {**env, "GLIBC_TUNABLES": ":".join([*tunables, HUGE_PAGES])}


def freeze_loaded() -> None:
    """Move everything alive now (the libraries, the model just loaded) out of the collector's sight: its full
    passes then scan only what later rounds made, in milliseconds (``collect_round_garbage``). What was frozen
    before (a previous run's model) is thawed and collected first, or its cycles would outlive it."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def collect_round_garbage() -> float:
    """One full pass of the garbage collector, once a round's reply is out: a reference cycle that holds a
    round's blocks is freed by the next round, not after hundreds (the collector's own full passes are rare in
    a process with millions of objects, as one with torch and a model has). Its seconds, for the log."""
    started = time.perf_counter()
    gc.collect()
    return time.perf_counter() - started


def peak_rss_bytes() -> int | None:
    """This process's peak resident memory so far (Linux's ``VmHWM``), what an operator sizes a site by;
    None where /proc does not say it."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def release_freed_memory() -> None:
    """Give the system back what this process's heap has freed (``malloc_trim``): after a model's load or a full
    sync, whose many small copies would otherwise stay in the heap."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def available_bytes() -> int | None:
    """``MemAvailable`` (Linux), bounded by the cgroup's limit (a container's ``memory.max``); None elsewhere."""
    try:
        with open("/proc/meminfo") as meminfo:
            free = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return free


def current_rss_bytes() -> int:
    """What this process holds now (``statm``'s resident pages); 0 where /proc does not say it."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
