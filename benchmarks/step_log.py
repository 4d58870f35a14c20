"""The server's step log each round: writing ``g^r`` (one block, fp32, fsynced and renamed) and,
every ``snapshot-every`` rounds, a snapshot of every trainable tensor, on SmolLM2-135M's default
5-layer blocks, as ``Run.write_step_log`` does. Both used to lie between a round's last reply and
the next round's messages; they now run after those messages are out (``step_log_write_s`` in the
records). Prints the medians and the disk's rate here, and what they give for Llama-3.1-8B's
largest block and trainable weights (the plan's shapes: bytes over the measured rate).

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

from benchmarks.common import PROJECT_DIR, command, machine, replace_doc_section
from parablock_flwr.config import RunConfig
from parablock_flwr.model import load_for_training
from parablock_flwr.plan import model_config, model_shape
from parablock_flwr.replica import StepLog

SECTION = "## The server's step log, each round"
LLAMA_8B = PROJECT_DIR / "docs" / "model-configs" / "llama-3.1-8b"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    cfg = RunConfig()
    model, partition = load_for_training(cfg)
    params = {n: p.detach() for n, p in model.named_parameters() if n in partition.all_names()}
    steps, snapshots, step_bytes = [], [], []
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
    trainable = sum(t.numel() for t in params.values()) * 4
    rate = trainable / statistics.median(snapshots)  # bytes a second, the larger writes
    big = model_shape(cfg, model_config(str(LLAMA_8B)))
    rows = [
        ("SmolLM2-135M, measured", max(step_bytes), statistics.median(steps), trainable, statistics.median(snapshots)),
        ("Llama-3.1-8B, from the rate", max(big.blocks) * 4, max(big.blocks) * 4 / rate,
         big.trainable * 4, big.trainable * 4 / rate),
    ]  # fmt: skip
    lines = [
        "| model | largest step, MiB (fp32) | a step written, s | trainable, GiB (fp32) | a snapshot written, s |",
        "|---|---|---|---|---|",
        *[f"| {m} | {sb / 2**20:.1f} | {s:.2f} | {tb / 2**30:.2f} | {t:.2f} |" for m, sb, s, tb, t in rows],
        "",
        f"The disk here: {rate / 2**20:.0f} MiB/s written, fsynced and renamed (median of {args.rounds} snapshots). "
        f"Taken off the critical path: for the 8B model at this rate, {rows[1][2]:.1f} s of every round and "
        f"{rows[1][4]:.0f} s more in each round that writes a snapshot.",
    ]
    report = "\n".join(lines)
    print(report)
    if not args.no_write:
        body = f"Command: `{command('step_log')}`  \nDate: {time.strftime('%Y-%m-%d')}  \n{machine()}\n\n"
        body += __doc__.split("\n\n")[0] + "\n\n" + report + "\n"
        replace_doc_section(SECTION, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
