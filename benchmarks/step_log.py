"""The server's disk writes each round: ``g^r`` into the step log (one block, fp32, fsynced and
renamed), every ``snapshot-every`` rounds a snapshot of every trainable tensor (``Run.write_step_log``),
and ParaBlock's pending update of each client (``checkpoint.stage_pending``: one block, fp32), on
SmolLM2-135M's default 5-layer blocks. All three used to lie between a round's last reply and the
next round's messages; now the step and snapshot are written after those messages are out
(``step_log_write_s`` in the records) and the pending updates on a thread of their own
(``Run.stage_pending``). Prints the medians and the disk's rate here, and what they give for
Llama-3.1-8B's largest block and trainable weights (the plan's shapes: bytes over the measured rate).

    .venv/bin/python -m benchmarks.step_log              # about 1 min
    .venv/bin/python -m benchmarks.step_log --no-write
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import PROJECT_DIR, write_report
from parablock_flwr import core
from parablock_flwr.checkpoint import clear_staged_pending, stage_pending
from parablock_flwr.config import RunConfig
from parablock_flwr.model import load_for_training
from parablock_flwr.plan import model_config, model_shape
from parablock_flwr.replica import StepLog

SECTION = "## The server's disk writes each round, off the critical path"
LLAMA_8B = PROJECT_DIR / "docs" / "model-configs" / "llama-3.1-8b"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--clients", type=int, default=3, help="pending updates staged a round")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    cfg = RunConfig()
    model, partition = load_for_training(cfg)
    params = {n: p.detach() for n, p in model.named_parameters() if n in partition.all_names()}
    steps, snapshots, pendings, step_bytes = [], [], [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        log = StepLog(Path(folder))
        for server_round in range(1, args.rounds + 1):
            block = (server_round - 1) % partition.num_blocks
            step = {n: torch.full_like(params[n], 1e-6) for n in partition.names(block)}
            start = time.perf_counter()
            log.write(server_round, block, step)
            steps.append(time.perf_counter() - start)
            step_bytes.append(sum(t.numel() * 4 for t in step.values()))
            start = time.perf_counter()
            log.write_snapshot(server_round, params)
            log.prune()
            snapshots.append(time.perf_counter() - start)
            clear_staged_pending(Path(folder))
            start = time.perf_counter()
            for partition_id in range(args.clients):
                stage_pending(Path(folder), partition_id, core.PendingUpdate(block, server_round - 1, step))
            pendings.append((time.perf_counter() - start) / args.clients)
    trainable = sum(t.numel() for t in params.values()) * 4
    rate = trainable / statistics.median(snapshots)  # bytes a second, the larger writes
    big = model_shape(cfg, model_config(str(LLAMA_8B)))
    staged_rate = sum(step_bytes) / sum(pendings)  # into the page cache: not fsynced
    step8b = max(big.blocks) * 4
    rows = [
        ("SmolLM2-135M, measured", max(step_bytes), statistics.median(steps), statistics.median(pendings),
         trainable, statistics.median(snapshots)),
        ("Llama-3.1-8B, from the rates", step8b, step8b / rate, step8b / staged_rate, big.trainable * 4,
         big.trainable * 4 / rate),
    ]  # fmt: skip
    lines = [
        "| model | largest block, MiB (fp32) | its step written, s | a client's pending update staged, s "
        "| trainable, GiB (fp32) | a snapshot written, s |",
        "|---|---|---|---|---|---|",
        *[
            f"| {m} | {sb / 2**20:.1f} | {s:.2f} | {p:.2f} | {tb / 2**30:.2f} | {t:.2f} |"
            for m, sb, s, p, tb, t in rows
        ],
        "",
        f"The disk here: {rate / 2**20:.0f} MiB/s written, fsynced and renamed (median of {args.rounds} snapshots); "
        f"{staged_rate / 2**20:.0f} MiB/s staged (not fsynced). Taken off the critical path, for the 8B model "
        f"at these rates with {args.clients} clients: {rows[1][2] + args.clients * rows[1][3]:.1f} s of every "
        f"ParaBlock round (a lower bound: {args.clients} blocks of 4 GiB outgrow the kernel's dirty-page limit, "
        f"and writing slows toward the disk's rate), and {rows[1][5]:.0f} s more in each round that writes a snapshot.",
    ]
    report = "\n".join(lines)
    print(report)
    if not args.no_write:
        write_report("step_log", SECTION, __doc__, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
