"""A node worker whose computation is a stand-in for a GPU's: it waits ``--compute-s`` seconds off the CPU (a
sleep releases the GIL and takes no core, as a GPU kernel does) and returns a fixed update of the block, made
once per block. Everything else is the real worker (``parablock-flwr worker``): the replica, the correction,
rounding with error feedback, the residuals' durable writes, the transport. ``benchmarks.stand_in`` starts one
per SuperNode in place of the real worker, so that a round's per-byte legs show as they would beside a GPU.

    python -m benchmarks.stand_in_worker --compute-s 2.5 --socket PATH [worker options]
"""

from __future__ import annotations

import sys
import time

import torch

from parablock_flwr.node import runtime
from parablock_flwr.training import TrainResult

UPDATE_SCALE = 1e-4  # about what an AdamW step moves a weight: rounding sees realistic magnitudes


def stand_in(compute_s: float):
    """``node.compute.compute_update``'s stand-in: the same signature, a sleep of ``compute_s``, and the block's
    fixed update (the same tensors every round: nothing downstream changes an update in place)."""
    updates: dict[int, dict[str, torch.Tensor]] = {}

    def compute_update(resources, cfg, job) -> TrainResult:
        started = time.time()
        if job.block not in updates:  # once per block, before the wait: a round's own legs never include it
            params, names = resources.replica.params, resources.partition.names(job.block)
            first = next(iter(updates.values()), {})  # blocks of equal shapes share one set of tensors
            same = [tuple(t.shape) for t in first.values()] == [tuple(params[n].shape) for n in names]
            gen = torch.Generator().manual_seed(job.block)
            tensors = list(first.values()) if same else [torch.randn(params[n].shape, generator=gen) * UPDATE_SCALE
                                                         for n in names]  # fmt: skip
            updates[job.block] = dict(zip(names, tensors))
            started = time.time()
        time.sleep(compute_s)
        rows = resources.rows(cfg, job.partition_id, job.num_partitions)
        return TrainResult(dict(updates[job.block]), 1.0, started, time.time(), num_examples=len(rows))

    return compute_update


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "--compute-s":
        sys.exit("usage: python -m benchmarks.stand_in_worker --compute-s SECONDS [worker options]")
    runtime.compute_update = stand_in(float(argv[1]))  # what Node submits, for fresh and ahead computations
    from parablock_flwr.cli import main as cli

    return cli(["worker", *argv[2:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
